"""train/closedloop.py: the trainer's side of per-bucket budgets, on a real model and optimiser in one process:
peaks recorded per bucket (OOMs as inf), the decision at an epoch boundary, its metrics row, and a state that a
resumed run loads to take the same decision (the closed loop in a real training run: tests/train/test_tune.py)."""
from __future__ import annotations

import math

import torch

from pipelines import load_pipeline
from shardtrain.load.batch import Batch
from shardtrain.train import closedloop
from shardtrain.train.budget import BudgetConfig
from shardtrain.train.closedloop import ClosedLoop, table_of, with_table
from shardtrain.world import World

MB = 2**20
TABLE = ((2.0, 40.0), (5.0, 30.0))


def batch(durations: list[float], epoch: int = 1, step: int = 0) -> Batch:
    n = len(durations)
    return Batch(waves=torch.zeros(n, 16), lengths=torch.full((n,), 16), keys=[f"k{i}" for i in range(n)],
                 texts=["a"] * n, durations_s=torch.tensor(durations), sample_rate_hz=16000, epoch=epoch, step=step)


def test_table_of_and_with_table_round_trip_through_the_run_config():
    cfg = load_pipeline("tiny_cpu")
    assert table_of(cfg) is None
    cfg2 = with_table(cfg, TABLE)
    assert table_of(cfg2) == TABLE and cfg2.stream.bucket.budget_table == TABLE and cfg.stream == load_pipeline(
        "tiny_cpu").stream


def test_boundary_decides_from_the_window_and_state_reloads():
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    loop = ClosedLoop(TABLE, BudgetConfig(), limit_bytes=100 * MB)
    assert loop.active and loop.due((batch([1.0]), {})) and not loop.due((batch([1.0], step=3), {}))
    assert not loop.due((batch([1.0]), {"chain": [1]}))  # a re-striped rest of an epoch is no boundary
    loop.record(0, 30 * MB)
    loop.record(0, 20 * MB)  # the window keeps the max
    loop.record_oom([(batch([4.0]), {})], {"micro_batches": [0]})  # a 4 s batch plans in bucket 1: inf
    saved = loop.state()
    assert saved["peaks"] == [30 * MB, None]
    comm = closedloop.Collectives(World(), torch.device("cpu"))
    new, row = loop.boundary(comm, model, opt, torch.device("cpu"), epoch=1, step=7)
    assert new is not None and new[1] == (5.0, 15.0) and new[0][1] > 40.0  # OOM halves; far below grows
    assert row["event"] == "budget" and row["step"] == 7 and row["peak_mb"] == [30.0, -1]
    assert [m["bucket"] for m in row["moves"]] == [0, 1] and row["table"] == [list(r) for r in new]
    assert loop.table == new and loop.peaks == [-1.0, -1.0] and not loop.due((batch([1.0], epoch=1), {}))
    again = ClosedLoop(TABLE, BudgetConfig(), limit_bytes=100 * MB)
    again.load(saved)  # a resumed run: same window, same decision
    assert again.peaks == [30 * MB, math.inf]
    assert again.boundary(comm, model, opt, torch.device("cpu"), epoch=1, step=7)[0] == new


def test_nothing_moves_inside_the_band_and_inactive_without_a_limit():
    model = torch.nn.Linear(8, 4)
    loop = ClosedLoop(TABLE, BudgetConfig(), limit_bytes=100 * MB)
    loop.record(0, 70 * MB)
    loop.record(1, 80 * MB)
    new, row = loop.boundary(closedloop.Collectives(World(), torch.device("cpu")), model, None,
                             torch.device("cpu"), epoch=2, step=1)
    assert new is None and row["moves"] == [] and loop.table == TABLE
    assert not ClosedLoop(TABLE, BudgetConfig(), limit_bytes=None).active
    assert not ClosedLoop(None, BudgetConfig(), limit_bytes=1.0).active
    assert not ClosedLoop(TABLE, BudgetConfig(adapt=False), limit_bytes=1.0).active
