"""BucketConfig.budget_table: per-length batch budgets honoured by both planners (rows and blocks), part of the
bucket fingerprint, and a loader state saved at an epoch boundary resumes under a different table."""
import numpy as np
import pytest

from shardtrain.load.blockplan import make_blocks, plan_blocks, rank_batches
from shardtrain.load.plan import BucketConfig, batch_budget_s, batch_cost, cost_s, plan_epoch, table_edges

from test_plan import all_batches, fake_index

# short batches may hold far more audio than long ones; the middle budget is smaller than the last (not monotone)
TABLE = ((4.0, 90.0), (10.0, 40.0), (20.0, 60.0))


def check(batches, idx, cfg):
    raw = BucketConfig(max_batch_seconds=1e9, padded_budget=cfg.padded_budget)
    fills = []
    for b in batches:
        if not len(b):
            continue
        budget = batch_budget_s(float(idx.duration_s[b].max()), cfg)
        cost = batch_cost(idx.duration_s[b], raw)
        assert cost <= budget + 1e-6, (cost, budget, idx.duration_s[b].max())
        fills.append(cost / budget)
    return np.mean(fills)


def test_budget_of_a_length_hand_checked():
    cfg = BucketConfig(max_batch_seconds=60.0, budget_table=TABLE)
    assert [batch_budget_s(d, cfg) for d in (0.5, 4.0, 4.01, 10.0, 19.0, 25.0)] == [90, 90, 40, 40, 60, 60]
    # costs are in units of max_batch_seconds / b*, b* the smallest budget from the length's entry on
    assert cost_s(np.array([2.0, 8.0, 15.0, 30.0]), cfg).tolist() == pytest.approx(
        [2.0 * 60 / 90, 8.0 * 60 / 40, 15.0, 30.0])
    assert batch_budget_s(7.0, BucketConfig(max_batch_seconds=60.0)) == 60.0


@pytest.mark.parametrize("bad", [(), ((5.0, 10.0), (4.0, 20.0)), ((5.0, 0.0),), ((0.0, 10.0),)])
def test_bad_tables_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="budget_table"):
        BucketConfig(budget_table=bad)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("world_size", [1, 4])
def test_rows_planner_honours_the_table(world_size, padded):
    idx = fake_index(8000, lo=0.5, hi=25.0)
    cfg = BucketConfig(max_batch_seconds=60.0, budget_table=TABLE, padded_budget=padded)
    plan = plan_epoch(idx, seed=2, epoch=0, world_size=world_size, cfg=cfg)
    check(all_batches(plan), idx, cfg)
    rows = np.concatenate(all_batches(plan))
    assert len(rows) == len(np.unique(rows)) == len(idx) - len(plan.too_long)
    # short utterances really get the larger budget: batches of < 4 s clips hold more than 60 s
    short = [b for b in all_batches(plan) if len(b) and idx.duration_s[b].max() <= 4.0]
    raw = BucketConfig(max_batch_seconds=1e9, padded_budget=padded)
    assert max(batch_cost(idx.duration_s[b], raw) for b in short) > 60.0


@pytest.mark.parametrize("world_size", [1, 4])
def test_block_planner_honours_the_table(world_size):
    idx = fake_index(8000, lo=0.5, hi=25.0)
    cfg = BucketConfig(max_batch_seconds=60.0, budget_table=TABLE)
    blocks = make_blocks(idx.duration_s, idx.size, 30.0, cfg.max_batch_seconds, lambda d: cost_s(d, cfg), 4,
                         table_edges(cfg))
    plan = plan_blocks(blocks, seed=1, epoch=0, world_size=world_size, cfg=cfg)
    per_rank = [rank_batches(plan, blocks, lambda r: cost_s(idx.duration_s[r], cfg), r, seed=1)
                for r in range(world_size)]
    batches = [b for bs in per_rank for b in bs]
    check(batches, idx, cfg)
    rows = np.concatenate(batches)
    assert len(rows) == len(np.unique(rows)) == len(idx) - plan.too_long_rows


def test_too_long_follows_the_last_budget():
    idx = fake_index(2000, lo=0.5, hi=25.0)
    cfg = BucketConfig(max_batch_seconds=60.0, budget_table=((4.0, 90.0), (10.0, 20.0)))
    plan = plan_epoch(idx, seed=0, epoch=0, world_size=1, cfg=cfg)
    assert np.array_equal(np.sort(plan.too_long), np.flatnonzero(idx.duration_s > 20.0))
