"""Planning ends for every budget table, world size and bucket population, and keeps its invariants doing so.

A budget table whose edges leave a bucket with fewer rows than ranks once made `plan_epoch` loop forever (a bucket
of one row cut into two chunks, the row moved back and forth): `plan --batch-budget` never returned and a DDP run
stopped at the epoch boundary with every rank busy. Random tables (edges 0.1-40 s), world sizes 1-64 and buckets
of 0-3 rows (plus larger populations) are planned under an alarm; each plan must deliver every row once, give
every rank the same number of steps and keep every batch within its budget.
"""
from __future__ import annotations

import signal
from contextlib import contextmanager

import numpy as np
import pytest

from shardtrain.load.blockplan import make_blocks, plan_blocks, rank_batches
from shardtrain.load.plan import BucketConfig, batch_budget_s, batch_cost, cost_s, plan_epoch, table_edges

from test_plan import fake_index

SECONDS_PER_PLAN = 10


@contextmanager
def time_bound(what: str, seconds: int = SECONDS_PER_PLAN):
    def expire(*_):
        raise TimeoutError(f"planning did not end within {seconds} s: {what}")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def random_case(rng: np.random.Generator):
    """A budget table with 1-12 edges in 0.1-40 s and a population of 0-3 rows around each edge (plus, half the
    time, a few hundred rows spread over the whole range)."""
    edges = np.unique(np.round(rng.uniform(0.1, 40.0, rng.integers(1, 13)), 2))
    budgets = rng.uniform(20.0, 400.0, len(edges)).round(1)
    table = tuple((float(e), float(b)) for e, b in zip(edges, budgets))
    durs = [rng.uniform(max(0.05, e - 0.3), e + 0.3, rng.integers(0, 4)) for e in edges]
    if rng.random() < 0.5:
        durs.append(rng.uniform(0.1, 40.0, rng.integers(10, 400)))
    d = np.sort(np.concatenate(durs))
    return table, d, int(rng.choice([1, 2, 3, 4, 5, 8, 16, 32, 64]))


def index_of(d: np.ndarray):
    idx = fake_index(max(len(d), 1))
    if len(d):
        idx.duration_s[:] = d
        idx.num_samples[:] = (d * 16000).astype(np.int64)
    return idx


def check_plan(plan, idx, cfg, world_size):
    steps = {sum(len(c.batches) for c in (g[r] for g in plan.groups)) for r in range(world_size)}
    assert len(steps) <= 1, f"ranks plan different step counts: {steps}"
    batches = [b for g in plan.groups for c in g for b in c.batches]
    rows = np.concatenate(batches) if batches else np.zeros(0, np.int64)
    assert len(rows) == len(np.unique(rows)) == len(idx) - len(plan.too_long), "a row planned twice or never"
    raw = BucketConfig(max_batch_seconds=1e9, padded_budget=cfg.padded_budget)
    for b in batches:
        if len(b):
            assert batch_cost(idx.duration_s[b], raw) <= batch_budget_s(float(idx.duration_s[b].max()), cfg) + 1e-6


def test_the_reported_hang_ends():
    """Edges every 0.25-0.5 s, world sizes 2, 3, 4 and 8: the table and sizes that hung `plan`."""
    rng = np.random.default_rng(7)
    edges = np.cumsum(rng.uniform(0.25, 0.5, 60)) + 0.5
    table = tuple((float(e), float(b)) for e, b in zip(edges.round(2), rng.uniform(60, 300, len(edges)).round(0)))
    d = np.sort(rng.uniform(0.5, float(edges[-1]), 300))
    idx = index_of(d)
    for ws in (2, 3, 4, 8):
        cfg = BucketConfig(max_batch_seconds=120.0, budget_table=table)
        for epoch in range(3):
            with time_bound(f"world {ws} epoch {epoch}"):
                plan = plan_epoch(idx, seed=0, epoch=epoch, world_size=ws, cfg=cfg)
            check_plan(plan, idx, cfg, ws)


@pytest.mark.parametrize("seed", range(12))
def test_random_tables_worlds_and_tiny_buckets_plan_in_bounded_time(seed):
    rng = np.random.default_rng(1000 + seed)
    for case in range(25):
        table, d, ws = random_case(rng)
        if 0 < len(d) < ws:
            continue  # refused with a clear error (every rank needs a row): covered below
        idx = index_of(d) if len(d) else index_of(np.array([1.0]))
        padded = bool(rng.random() < 0.3)
        cfg = BucketConfig(max_batch_seconds=float(rng.uniform(30, 300)), budget_table=table, padded_budget=padded)
        fit = int((cost_s(idx.duration_s, cfg) <= cfg.max_batch_seconds).sum())
        if 0 < fit < ws:
            continue  # the rows that fit a batch are fewer than the ranks: refused (below)
        with time_bound(f"seed {seed} case {case}: world {ws}, {len(d)} rows, table {table}"):
            plan = plan_epoch(idx, seed=seed, epoch=case, world_size=ws, cfg=cfg)
        check_plan(plan, idx, cfg, ws)


@pytest.mark.parametrize("seed", range(4))
def test_block_planner_ends_on_random_tables(seed):
    rng = np.random.default_rng(2000 + seed)
    for case in range(15):
        table, d, ws = random_case(rng)
        idx = index_of(d)
        cfg = BucketConfig(max_batch_seconds=120.0, budget_table=table)
        if int((cost_s(idx.duration_s, cfg) <= cfg.max_batch_seconds).sum()) < ws or len(d) < ws:
            continue
        with time_bound(f"blocks seed {seed} case {case}: world {ws}, {len(d)} rows, table {table}"):
            blocks = make_blocks(idx.duration_s, idx.size, 30.0, cfg.max_batch_seconds,
                                 lambda x: cost_s(x, cfg), 4, table_edges(cfg))
            plan = plan_blocks(blocks, seed=seed, epoch=case, world_size=ws, cfg=cfg)
            per_rank = [rank_batches(plan, blocks, lambda r: cost_s(idx.duration_s[r], cfg), r, seed=seed)
                        for r in range(ws)]
        assert len({len(b) for b in per_rank}) == 1
        rows = np.concatenate([b for bs in per_rank for b in bs])
        assert len(rows) == len(np.unique(rows)) == len(idx) - plan.too_long_rows


def test_fewer_rows_than_ranks_is_refused_not_planned():
    idx = index_of(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="every rank needs at least one"):
        plan_epoch(idx, seed=0, epoch=0, world_size=4, cfg=BucketConfig(budget_table=((1.5, 60.0),)))
