"""The planners terminate for every budget table, world size and bucket population, and keep the loader's
invariants there (design invariants 2-4): random tables (edges 0.1-40 s), world sizes 1-64, buckets of 0-3 rows
and larger populations, each plan under a time bound (pytest-timeout stops a hang). Pure numpy: no audio."""
import dataclasses
import time

import numpy as np
import pytest

from shardtrain.load.blockplan import make_blocks, plan_blocks, rank_batches
from shardtrain.load.plan import BucketConfig, PlanIndex, batch_budget_s, batch_cost, cost_s, plan_epoch, table_edges

PLAN_BOUND_S = 5.0
"""Most seconds one small plan may take, even on 2 loaded cores (they take milliseconds)."""


def index_of(d: np.ndarray) -> PlanIndex:
    d = np.sort(d)
    n = len(d)
    size = (d * 32_000).astype(np.int64) + 2048
    off = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64)
    return PlanIndex(shard=(off // 20_000_000).astype(np.int32), offset=off, size=size, audio_offset=off + 512,
                     audio_size=size - 2048, json_offset=off + size - 512, json_size=np.full(n, 100),
                     duration_s=d, num_samples=(d * 16000).astype(np.int64), channels=np.ones(n, np.int16))


def random_case(rng: np.random.Generator, *, large: bool = False):
    """(durations, table, world_size, cfg): table edges 0.1-40 s at random steps, budgets 1-200 s, buckets of 0-3
    rows between edges (or a few hundred rows when `large`), world sizes 1-64."""
    edges = np.unique(np.round(np.cumsum(rng.uniform(0.1, rng.choice([0.5, 4.0, 40.0]), 200)), 3))
    edges = edges[edges <= 40.0][: int(rng.integers(1, 60))]
    table = tuple((float(e), float(rng.uniform(1.0, 200.0))) for e in edges)
    lo = np.concatenate([[0.05], edges[:-1]])
    per = rng.integers(0, 300 if large else 4, len(edges))
    d = np.concatenate([rng.uniform(a, b, k) for a, b, k in zip(lo, edges, per)] + [rng.uniform(0.05, 45.0, 2)])
    world_size = int(rng.choice([1, 2, 3, 4, 8, int(rng.integers(1, 65))]))
    cfg = BucketConfig(max_batch_seconds=float(rng.uniform(5.0, 200.0)), budget_table=table,
                       max_batch_size=None if rng.random() < 0.7 else int(rng.integers(1, 16)),
                       padded_budget=bool(rng.random() < 0.25),
                       quadratic_duration_s=None if rng.random() < 0.8 else float(rng.uniform(5, 60)),
                       run_mb=float(rng.choice([0.0, 1.0])), num_buckets=int(rng.choice([1, 8, 30])))
    return d, world_size, cfg


def check_batches(per_rank: list[list[np.ndarray]], idx: PlanIndex, cfg: BucketConfig, kept: int) -> int:
    """Exactly once, equal steps, every batch within its longest utterance's budget; returns empty batches."""
    steps = {len(b) for b in per_rank}
    assert len(steps) == 1, f"ranks have different step counts: {steps}"
    flat = [b for bs in per_rank for b in bs]
    rows = np.concatenate(flat) if flat else np.zeros(0, np.int64)
    assert len(rows) == len(np.unique(rows)) == kept, "a sample is missing or delivered twice"
    raw = BucketConfig(max_batch_seconds=1e12, padded_budget=cfg.padded_budget,
                       quadratic_duration_s=cfg.quadratic_duration_s)
    for b in flat:
        if len(b):
            d = idx.duration_s[b]
            assert batch_cost(cost_s(d, raw), raw) <= batch_budget_s(float(d.max()), cfg) * (1 + 1e-9) + 1e-9
            assert cfg.max_batch_size is None or len(b) <= cfg.max_batch_size
    return sum(len(b) == 0 for b in flat)


def rows_plan(idx, world_size, cfg, seed):
    t = time.perf_counter()
    plan = plan_epoch(idx, seed=seed, epoch=seed % 3, world_size=world_size, cfg=cfg)
    assert time.perf_counter() - t < PLAN_BOUND_S
    return [[b for c in plan.rank_chunks(r) for b in c.batches] for r in range(world_size)], len(plan.too_long)


def blocks_plan(idx, world_size, cfg, seed):
    t = time.perf_counter()
    cost_of = lambda r: cost_s(idx.duration_s[r], cfg)  # noqa: E731
    blocks = make_blocks(idx.duration_s, idx.size, 30.0, cfg.max_batch_seconds, lambda d: cost_s(d, cfg), 4,
                         table_edges(cfg))
    plan = plan_blocks(blocks, seed=seed, epoch=seed % 3, world_size=world_size, cfg=cfg)
    per_rank = [rank_batches(plan, blocks, cost_of, r, seed=seed) for r in range(world_size)]
    assert time.perf_counter() - t < PLAN_BOUND_S
    return per_rank, plan.too_long_rows


def run_case(planner, case: int, large: bool = False) -> int:
    rng = np.random.default_rng(case)
    d, world_size, cfg = random_case(rng, large=large)
    if planner is blocks_plan and (cfg.padded_budget or cfg.run_mb == 0):
        cfg = dataclasses.replace(cfg, padded_budget=False, run_mb=1.0)  # what the block planner refuses
    idx = index_of(d)
    kept = int((cost_s(idx.duration_s, cfg) <= cfg.max_batch_seconds).sum())
    if 0 < kept < world_size:
        with pytest.raises(ValueError, match="ranks"):
            planner(idx, world_size, cfg, case)
        return 0
    per_rank, too_long = planner(idx, world_size, cfg, case)
    assert too_long == len(idx) - kept
    return check_batches(per_rank, idx, cfg, kept)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("planner", [rows_plan, blocks_plan])
@pytest.mark.parametrize("large", [False, True])
def test_random_tables_terminate_and_keep_the_invariants(planner, large):
    for case in range(150 if not large else 25):
        run_case(planner, 1000 * large + case, large)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_issue_budget_edges_every_quarter_to_half_second(world_size):
    """The hang as reported: a table with edges every 0.25-0.5 s left buckets of one row that were cut into two
    chunks, and the rebalancing moved the row back and forth forever."""
    for seed in range(8):
        rng = np.random.default_rng(seed)
        idx = index_of(rng.uniform(0.5, 20.0, int(rng.integers(200, 1500))))
        edges = np.cumsum(rng.uniform(0.25, 0.5, 100))
        table = tuple((float(e), float(rng.uniform(30, 120))) for e in edges[edges < 25])
        cfg = BucketConfig(max_batch_seconds=60.0, budget_table=table)
        per_rank, too_long = rows_plan(idx, world_size, cfg, seed)
        check_batches(per_rank, idx, cfg, len(idx) - too_long)
