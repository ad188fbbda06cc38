"""Per-bucket batch budgets: the budget.json file `shardtrain tune` writes, and the closed loop that moves them.

    budget.json  {"version": 1, "budget_table": [[edge_s, max_batch_seconds], ...], "memory_target_bytes": ...,
                  "buckets": [{edge_s, shortest_s, utterances, batch_seconds, peak_bytes, step_s}, ...], ...}
      -> BucketConfig.budget_table: the planners cut duration buckets at its edges and plan each bucket's
         batches to its own budget (a row of duration d takes the first edge >= d; past the last, the last)

Why a table and not one number: padded activations grow with the longest utterance in a batch (and
quadratically with attention), so one `max_batch_seconds` is either too small for short buckets (the device
idles) or too large for long ones (an out-of-memory crash hours in).

Closed loop (`adapt`): the trainer records the peak memory of every step's batches per bucket; between epochs
only (the plan of a running epoch never changes, so resume stays exact) a bucket whose peak came above
`high` x the memory limit, or that ran out of memory, is tightened, and one that stayed below `low` x the limit is
loosened, towards `target` x the limit under an affine model (peak = fixed + k x budget), by at most `max_step`
per epoch and within [`min_scale`, `max_scale`] x the tuned budget. Pure functions here; the loop applies them.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class BudgetConfig:
    file: str = ""
    """budget.json from `shardtrain tune` (`--batch-budget`): its table replaces stream.bucket.budget_table.
    Empty = stream.bucket as configured."""
    memory_limit_mb: float = 0.0
    """Memory the closed loop keeps each step under; 0 = the tuned file's target (total x fraction on CUDA)."""
    adapt: bool = True
    """Move the budgets between epochs from the measured per-bucket peaks (needs a budget table)."""
    high: float = 0.92
    """Tighten a bucket whose peak exceeded this share of the memory limit."""
    low: float = 0.6
    """Loosen a bucket whose peak stayed below this share of the memory limit."""
    target: float = 0.85
    """Share of the limit a moved budget aims at."""
    max_step: float = 1.25
    """Largest factor a budget moves by in one epoch (either way; an out-of-memory bucket at least halves)."""
    min_scale: float = 0.25
    """Bounds of a moved budget, as multiples of the tuned one."""
    max_scale: float = 4.0
    oom_split: bool = True
    """Survive an out-of-memory step by redoing it in halves (train/update.py); False keeps DDP's overlapped
    gradient all-reduce and lets an out-of-memory error stop the run."""

    def __post_init__(self) -> None:
        if self.memory_limit_mb < 0:
            raise ValueError("budget.memory_limit_mb must be >= 0 (0 = the tuned target)")
        if not 0 < self.low < self.target < self.high <= 1.0:
            raise ValueError("budget.low < budget.target < budget.high <= 1 must hold")
        if self.max_step <= 1.0 or not 0 < self.min_scale <= 1.0 <= self.max_scale:
            raise ValueError("budget.max_step must be > 1, budget.min_scale in (0, 1], budget.max_scale >= 1")


Table = tuple[tuple[float, float], ...]


def check_table(table: Any, where: str = "budget_table") -> Table:
    """A table as tuples, refused (naming `where`) unless edges ascend and every budget is > 0."""
    rows = tuple((float(e), float(b)) for e, b in table)
    if not rows:
        raise ValueError(f"{where}: empty budget table")
    edges = [e for e, _ in rows]
    if edges != sorted(edges) or len(set(edges)) != len(edges):
        raise ValueError(f"{where}: edges must ascend strictly, got {edges}")
    if any(not b > 0 or not math.isfinite(b) for _, b in rows):
        raise ValueError(f"{where}: every max_batch_seconds must be > 0, got {[b for _, b in rows]}")
    return rows


def write_budget(path: str | os.PathLike, doc: dict) -> None:
    """budget.json, written atomically (a tune killed mid-write leaves the old file)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps({"version": FILE_VERSION, "created_unix": time.time(), **doc}, indent=1))
    os.replace(tmp, p)


def read_budget(path: str | os.PathLike) -> dict:
    """The parsed budget.json, its table checked; errors name `--batch-budget`."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--batch-budget {path}: cannot read it ({e})") from None
    if doc.get("version") != FILE_VERSION:
        raise ValueError(f"--batch-budget {path}: version {doc.get('version')!r}, this shardtrain reads "
                         f"{FILE_VERSION}; re-run `shardtrain tune`")
    doc["budget_table"] = check_table(doc.get("budget_table") or (), f"--batch-budget {path}")
    return doc


def bucket_of(table: Table | None, max_duration_s: float) -> int:
    """Row of `table` that plans a batch whose longest utterance is `max_duration_s` (the first edge >= it; the
    last row past the end); without a table, the 1-second duration band (what OOM splitting keys on)."""
    if not table:
        return int(max_duration_s)
    for i, (edge, _) in enumerate(table):
        if max_duration_s <= edge + 1e-6:
            return i
    return len(table) - 1


@dataclass(frozen=True, slots=True)
class Move:
    bucket: int
    edge_s: float
    old_s: float
    new_s: float
    peak_bytes: float
    """Largest peak seen in the bucket this epoch (inf: it ran out of memory)."""
    why: str

    def as_dict(self) -> dict:
        return {"bucket": self.bucket, "edge_s": self.edge_s, "old_s": self.old_s, "new_s": self.new_s,
                "peak_mb": None if math.isinf(self.peak_bytes) else round(self.peak_bytes / 2**20, 3),
                "why": self.why}


def adapt(table: Table, tuned: Table, peaks: list[float], limit_bytes: float, fixed_bytes: float,
          cfg: BudgetConfig) -> tuple[Table, list[Move]]:
    """The next epoch's table from this epoch's per-bucket peaks (bytes; < 0 = not seen, inf = out of memory).

    A budget moves towards `target` x limit assuming peak = fixed + k x budget (k fitted from this bucket's own
    peak), by at most max_step (at least a halving after an OOM), clamped to [min_scale, max_scale] x tuned, and
    rounded to 0.1 s so small noise does not move it. Pure: every rank computes the same table from the same
    all-reduced peaks."""
    out, moves = [], []
    for i, ((edge, old), (_, base), peak) in enumerate(zip(table, tuned, peaks)):
        new, why = old, ""
        if math.isinf(peak):
            new, why = old * 0.5, "out of memory"
        elif peak > cfg.high * limit_bytes or (0 <= peak < cfg.low * limit_bytes):
            per_s = max(peak - fixed_bytes, 1.0) / old
            want = max(cfg.target * limit_bytes - fixed_bytes, 0.0) / per_s
            new = min(max(want, old / cfg.max_step), old * cfg.max_step)
            why = "near the limit" if peak > cfg.high * limit_bytes else "far below the limit"
        new = round(min(max(new, base * cfg.min_scale), base * cfg.max_scale), 1)
        if why and new != old:
            moves.append(Move(i, edge, old, new, peak, why))
        else:
            new = old
        out.append((edge, new))
    return tuple(out), moves
