"""Weighted mixtures of datasets, planned as one: which rows of each dataset an epoch holds, then plan_epoch.

Semantics (what a user can state in two sentences): an epoch holds as much audio as all datasets together
(or `epoch_hours`), and dataset i fills weight_i / sum(weights) of it, up to one utterance. Each dataset is
read as an endless stream of passes, every pass a fresh random permutation of all its rows, and an epoch takes
the next stretch of that stream, so every sample of a dataset is seen once before any is seen again (a small,
heavily weighted dataset repeats; a large, lightly weighted one is sampled without replacement across epochs).

    per dataset i: duration_s, weight w_i, hours H_i
      -> T_i = epoch audio x w_i / sum(w)                       (seconds of dataset i in every epoch)
      -> stream position of epoch e: pass p = floor(e T_i / H_i), then searchsorted in pass p's cumulative audio
         (pure: epoch e needs no earlier epoch's selection; O(rows) per epoch)
      -> MixEpoch: `source` (dataset) and `row` (its index row) of every virtual row, sorted by duration
      -> PlanIndex gathered from the datasets' columns (shard ids offset per dataset) -> plan_epoch as usual

So the mixture inherits every planner property: lock-step duration bands across datasets, equal steps on
every rank, exactly once over the epoch's virtual rows (a repeated row is two virtual rows), and elastic
re-striping with `exclude` over the same virtual rows; exact resume needs only (seed, epoch, step, chain).
Cost: one permutation and cumsum per dataset and epoch (~0.1 s per million rows) on top of plan_epoch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from shardtrain.load.plan import PlanIndex


@dataclass(frozen=True, slots=True)
class MixEpoch:
    epoch: int
    source: np.ndarray
    """int16 [V]: the dataset of every virtual row (V = rows in this epoch), in duration order."""
    row: np.ndarray
    """int64 [V]: that dataset's index row."""
    seconds: np.ndarray
    """float64 [datasets]: audio seconds each dataset contributes to this epoch."""


def targets_s(hours_s: np.ndarray, weights: np.ndarray, epoch_s: float | None = None) -> np.ndarray:
    """Seconds of each dataset per epoch: its weight's share of `epoch_s` (default: all datasets' audio)."""
    w = np.asarray(weights, np.float64)
    if (w <= 0).any() or not np.isfinite(w).all():
        raise ValueError(f"mixture weights must be positive numbers, got {w.tolist()}")
    total = float(np.sum(hours_s)) if epoch_s is None else float(epoch_s)
    return total * w / w.sum()


def _pass_order(n: int, seed: int, source: int, p: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 7_331, source, p])))
    return rng.permutation(n)


def _stream_pos(dur: np.ndarray, seed: int, source: int, at_s: float) -> tuple[int, int]:
    """(pass, rows into that pass) where the stream of passes has delivered `at_s` seconds."""
    total = float(dur.sum())
    p = int(at_s // total)
    rem = at_s - p * total
    if rem <= 1e-9:
        return p, 0
    cum = np.cumsum(dur[_pass_order(len(dur), seed, source, p)])
    return p, int(np.searchsorted(cum, rem - 1e-9, side="left")) + 1


def _take(dur: np.ndarray, seed: int, source: int, start_s: float, end_s: float) -> np.ndarray:
    """Rows of the stream between two audio positions (each position rounds to the utterance that reaches it)."""
    (p0, i0), (p1, i1) = _stream_pos(dur, seed, source, start_s), _stream_pos(dur, seed, source, end_s)
    out = []
    for p in range(p0, p1 + 1):
        order = _pass_order(len(dur), seed, source, p)
        out.append(order[(i0 if p == p0 else 0):(i1 if p == p1 else len(order))])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def select_epoch(durations: list[np.ndarray], weights, *, seed: int, epoch: int,
                 epoch_s: float | None = None) -> MixEpoch:
    """The virtual rows of `epoch` of a mixture (pure: same arguments, same rows)."""
    if len(durations) != len(weights):
        raise ValueError(f"{len(durations)} datasets but {len(weights)} weights")
    empty = [i for i, d in enumerate(durations) if len(d) == 0 or float(np.sum(d)) <= 0]
    if empty:
        raise ValueError(f"mixture datasets {empty} hold no audio; remove them or fix their index")
    hours = np.array([float(d.sum()) for d in durations])
    t = targets_s(hours, np.asarray(weights, np.float64), epoch_s)
    src, rows = [], []
    for i, d in enumerate(durations):
        r = _take(d, seed, i, epoch * t[i], (epoch + 1) * t[i])
        src.append(np.full(len(r), i, np.int16))
        rows.append(r.astype(np.int64))
    source, row = np.concatenate(src), np.concatenate(rows)
    dur = np.concatenate([durations[i][r] for i, r in enumerate(rows)])
    order = np.lexsort((row, source, dur))  # duration order (ties: dataset, then row) = byte order per dataset
    seconds = np.array([float(durations[i][r].sum()) for i, r in enumerate(rows)])
    return MixEpoch(epoch=epoch, source=source[order], row=row[order], seconds=seconds)


def gather_index(indexes: list[PlanIndex], mix: MixEpoch, shard_base: np.ndarray | None = None) -> PlanIndex:
    """The PlanIndex of a mixture epoch: every column gathered per virtual row; shard ids offset by
    `shard_base[source]` (default: cumulative shard counts), so one shard id names one file of one dataset."""
    if shard_base is None:
        counts = [int(ix.shard.max()) + 1 if len(ix) else 0 for ix in indexes]
        shard_base = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    cols: dict = {}
    first = np.concatenate([[0], np.cumsum([len(ix) for ix in indexes])[:-1]]).astype(np.int64)
    for name in (f.name for f in dataclasses.fields(PlanIndex)):
        parts = [getattr(indexes[i], name) for i in range(len(indexes))]
        if any(p is None for p in parts):  # optional Arrow columns (key, text): only when every dataset has them
            cols[name] = None
        elif not isinstance(parts[0], np.ndarray):
            import pyarrow as pa

            cols[name] = pa.concat_arrays(parts).take(pa.array(first[mix.source] + mix.row))
        else:
            out = np.empty(len(mix.row), parts[0].dtype)
            for i, part in enumerate(parts):
                m = mix.source == i
                out[m] = part[mix.row[m]]
            cols[name] = out
    cols["shard"] = (cols["shard"].astype(np.int64) + shard_base[mix.source]).astype(np.int32)
    return PlanIndex(**cols)
