"""The block-level planner (load/blockplan.py): exactly once, equal steps, budget, lock-step, up to 1,024 ranks."""
import numpy as np
import pytest

from shardtrain.load.blockplan import chunk_rows, make_blocks, plan_blocks, rank_batches
from shardtrain.load.plan import BucketConfig

from test_plan import fake_index


@pytest.mark.parametrize("world_size", [1, 8, 256])
def test_exactly_once_equal_steps_budget(world_size):
    idx = fake_index(40_000, lo=0.5, hi=30.0)
    cfg = BucketConfig(max_batch_seconds=25.0)
    blocks = make_blocks(idx.duration_s, idx.size, 60.0, cfg.max_batch_seconds)
    plan = plan_blocks(blocks, seed=1, epoch=0, world_size=world_size, cfg=cfg)
    per_rank = [rank_batches(plan, blocks, lambda r: idx.duration_s[r], r, seed=1) for r in range(world_size)]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) == plan.steps
    rows = np.concatenate([b for bs in per_rank for b in bs])
    assert len(rows) == len(np.unique(rows)) == len(idx) - plan.too_long_rows
    assert plan.too_long_rows == int((idx.duration_s > 25.0).sum()) > 0
    assert max(float(idx.duration_s[b].sum()) for bs in per_rank for b in bs) <= 25.0 + 1e-9
    for m, members in plan.groups:  # lock-step: at every step all ranks draw from one duration bucket
        assert len({int(plan.bucket[b]) for c in members for b in c}) == 1
    spans = [np.ptp(idx.duration_s[chunk_rows(blocks, c)]) for _, g in plan.groups for c in g if len(c)]
    assert np.median(spans) < 3.0  # a bucket is a narrow band of the 0.5-30 s range


def test_blocks_move_between_chunks_every_epoch():
    idx = fake_index(20_000)
    cfg = BucketConfig(max_batch_seconds=120.0)
    blocks = make_blocks(idx.duration_s, idx.size, 60.0, cfg.max_batch_seconds)
    a, b = (plan_blocks(blocks, seed=0, epoch=e, world_size=4, cfg=cfg) for e in (0, 1))
    pa = {tuple(c.tolist()) for _, g in a.groups for c in g}
    pb = {tuple(c.tolist()) for _, g in b.groups for c in g}
    assert len(pa & pb) < 0.05 * len(pa), (len(pa & pb), len(pa))


def test_1024_ranks_plan_is_small_and_deterministic():
    idx = fake_index(300_000, lo=1.0, hi=20.0)
    cfg = BucketConfig(max_batch_seconds=100.0)
    blocks = make_blocks(idx.duration_s, idx.size, 300.0, cfg.max_batch_seconds)
    p1 = plan_blocks(blocks, seed=3, epoch=2, world_size=1024, cfg=cfg)
    p2 = plan_blocks(blocks, seed=3, epoch=2, world_size=1024, cfg=cfg)
    assert [m for m, _ in p1.groups] == [m for m, _ in p2.groups]
    assert all(len(g) == 1024 for _, g in p1.groups)
    ids = np.concatenate([c for _, g in p1.groups for c in g])
    assert len(ids) == len(np.unique(ids)) == int((~blocks.too_long).sum())
