"""The trainer's side of per-bucket budgets: peaks per bucket over an epoch, and the new table between epochs.

    every step: (bucket, peak bytes) of each micro-batch (train/memory.py), OOMs as inf      -> epoch window
    first batch of a new epoch at a step edge: all-reduce (max) of the window over ranks -> budget.adapt
      -> a "budget" row in metrics.jsonl -> Loader.restart at (epoch + 1, step 0) with the table

Why only at epoch boundaries: the running epoch's plan depends on the table, so changing it mid-epoch would
break exactly-once and exact resume; a loader state at step 0 of an epoch can be resumed with another bucket
config (load/loader.py). The window, the table and the tuned table (the bounds) go into every checkpoint, so a
resumed run takes the same decision at the same boundary. A boundary that falls inside a step
(grad_accum_steps > 1 and an epoch not a multiple of it) is skipped; the window carries on into the next epoch.
Cost: one all-reduce of 2 x buckets + 1 floats per epoch, a loader restart (manifest and index read again, an
epoch plan) when a budget moves.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch

from shardtrain.train.budget import BudgetConfig, Table, adapt, bucket_of, check_table
from shardtrain.train.memory import state_bytes
from shardtrain.train.step import Collectives

log = logging.getLogger(__name__)


def table_of(cfg) -> Table | None:
    """The budget table the run's stream.bucket plans with (None: one max_batch_seconds)."""
    t = cfg.stream.bucket.budget_table
    return check_table(t) if t else None


def with_table(cfg, table: Table):
    """`cfg` planning with `table` (BucketConfig.budget_table: the planners cut duration buckets at its edges)."""
    bucket = dataclasses.replace(cfg.stream.bucket, budget_table=tuple(table))
    return dataclasses.replace(cfg, stream=dataclasses.replace(cfg.stream, bucket=bucket))


class ClosedLoop:
    """Per-bucket peaks of the current window and the table decision at an epoch boundary (module docstring)."""

    def __init__(self, table: Table | None, cfg: BudgetConfig, limit_bytes: float | None,
                 tuned: Table | None = None) -> None:
        self.table, self.cfg, self.limit = table, cfg, limit_bytes
        self.tuned = tuned or table
        self.peaks: list[float] = [-1.0] * len(table or ())
        self.done_epoch = -1
        """The last epoch whose start was decided (its first batch comes again from the rebuilt loader)."""

    @property
    def active(self) -> bool:
        return bool(self.table) and self.cfg.adapt and bool(self.limit)

    def due(self, item: tuple) -> bool:
        """`item` (batch, state) is the first batch of an epoch not yet decided (not of a re-striped rest of
        one: that has a chain)."""
        batch, state = item
        return (self.active and batch.step == 0 and batch.epoch > max(0, self.done_epoch)
                and not state.get("chain"))

    def record(self, bucket: int, peak: float) -> None:
        if self.table and 0 <= bucket < len(self.peaks):
            self.peaks[bucket] = max(self.peaks[bucket], peak)

    def boundary(self, comm: Collectives, model: torch.nn.Module, optimizer, device: torch.device,
                 epoch: int, step: int) -> tuple[Table | None, dict]:
        """At the first batch of `epoch`, before `step` (the first planned with the result): (the new table, or
        None when nothing moved; the metrics row)."""
        assert self.table is not None and self.tuned is not None and self.limit
        self.done_epoch = epoch
        fixed = (float(torch.cuda.memory_allocated(device)) if device.type == "cuda"
                 else float(state_bytes(model, optimizer)))
        # max over ranks via sum of one-hot slots would cost W x buckets; a max of finite values is enough here
        inf = [1.0 if math.isinf(p) else 0.0 for p in self.peaks]
        finite = [p if not math.isinf(p) else -1.0 for p in self.peaks]
        got = comm.max(finite + inf + [fixed])
        nb = len(self.peaks)
        peaks = [math.inf if got[nb + i] > 0 else got[i] for i in range(nb)]
        new, moves = adapt(self.table, self.tuned, peaks, self.limit, got[-1], self.cfg)
        row = {"step": step, "event": "budget", "epoch": epoch, "limit_mb": round(self.limit / 2**20, 3),
               "fixed_mb": round(got[-1] / 2**20, 3),
               "peak_mb": [None if p < 0 else (-1 if math.isinf(p) else round(p / 2**20, 3)) for p in peaks],
               "moves": [m.as_dict() for m in moves], "table": [list(r) for r in new]}
        for m in moves:
            log.info("epoch %d: bucket %d (<= %.2f s): max_batch_seconds %.1f -> %.1f (%s; peak %s of limit %.0f MB)",
                     epoch, m.bucket, m.edge_s, m.old_s, m.new_s, m.why,
                     "OOM" if math.isinf(m.peak_bytes) else f"{m.peak_bytes / 2**20:.1f} MB", self.limit / 2**20)
        self.peaks = [-1.0] * nb
        if not moves:
            return None, row
        self.table = new
        return new, row

    def state(self) -> dict:
        return {"table": [list(r) for r in self.table or ()], "tuned": [list(r) for r in self.tuned or ()],
                "peaks": [None if math.isinf(p) else p for p in self.peaks]}

    def load(self, d: dict | None) -> None:
        if not d or not d.get("table"):
            return
        self.table, self.tuned = check_table(d["table"]), check_table(d["tuned"])
        self.peaks = [math.inf if p is None else float(p) for p in d["peaks"]]

    def record_oom(self, micro: list, event: dict) -> None:
        """The buckets of the micro-batches an oom_split row names ran out of memory this epoch."""
        for i in event["micro_batches"]:
            batch = micro[i][0]
            if len(batch):
                self.record(bucket_of(self.table, float(batch.durations_s.max())), math.inf)
