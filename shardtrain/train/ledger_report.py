"""Accounting of a run's ledger: per epoch, what each dataset's rows were planned to be and what was trained.

    History (train/ledger.py) + per dataset: durations, eligible rows (not over the batch budget), weight
      -> expected(epoch): how often each row belongs to the epoch, from the planner's own selection (1 for every
         row of one dataset under the budget; a small heavily weighted dataset of a mixture may hold a row twice)
      -> EpochAccount: once / never / more than once per dataset, audio share against the weight share, the
         deliveries that did not reach the weights (not_trained: CTC cannot align them, or a skipped step), and
         the rows delivered MORE often than planned (exactly-once broken: a bug or a manual edit) with keys

Pure functions of arrays; the CLI (`shardtrain ledger`) reads the datasets' index columns and the run's config.
Cost: one bincount per dataset and epoch, O(rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from typing import Callable

from shardtrain.train.ledger import History


@dataclass(frozen=True)
class DatasetFacts:
    name: str
    weight: float
    durations_s: np.ndarray
    """float [rows] of the dataset's index."""
    keys: np.ndarray | None = None
    """str [rows] (for naming rows); None prints row numbers."""
    content: str = ""
    """Dataset.content_id today, checked against the one each attempt recorded."""


def counts_from_selection(source: np.ndarray, row: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """int [rows] per dataset: how often an epoch's selection (Planner.selection: dataset number and row of
    every row it holds) holds each row."""
    return [np.bincount(row[source == i], minlength=n).astype(np.int64) for i, n in enumerate(sizes)]


@dataclass
class DatasetAccount:
    name: str
    planned: int
    """Rows the epoch's plan holds (with multiplicity)."""
    trained: int
    """Utterances trained (with multiplicity)."""
    once: int
    never: int
    """Eligible rows planned for the epoch and never delivered to the trainer (the equal-steps tail, or skipped as
    bad data)."""
    more_than_once: int
    """Rows trained more than once in the epoch (whatever the plan)."""
    over_plan: list[str]
    """Rows delivered more often than the plan holds them: exactly-once broken (keys, at most 20)."""
    over_plan_count: int
    audio_s: float
    share: float
    weight_share: float
    not_trained: int = 0
    """Deliveries that did not reach the weights: targets CTC cannot align, or a step skipped (non-finite, fp16
    overflow, no target token anywhere). Counted apart: delivered, so not `never`, but not `trained` either."""


@dataclass
class EpochAccount:
    epoch: int
    complete: bool
    steps: int
    datasets: list[DatasetAccount] = field(default_factory=list)

    @property
    def broken(self) -> bool:
        return any(d.over_plan_count for d in self.datasets)


def account(history: History, facts: list[DatasetFacts], expected: Callable[[int], list[np.ndarray]],
            epochs: list[int] | None = None) -> list[EpochAccount]:
    """One EpochAccount per epoch in the history (or `epochs`); the last epoch is incomplete unless every row
    planned for it was trained."""
    out = []
    all_epochs = sorted(set(history.epoch.tolist()))
    wsum = sum(f.weight for f in facts)
    per_row_epoch = np.repeat(history.epoch, np.diff(history.offsets))
    for e in (epochs if epochs is not None else all_epochs):
        sel = per_row_epoch == e
        rows, src, trained = history.rows[sel], history.sources[sel], history.trained[sel]
        expect = expected(e)
        acc = EpochAccount(epoch=e, complete=any(x > e for x in all_epochs),
                           steps=len(set(history.step[history.epoch == e].tolist())))
        total_s = 0.0
        accounts = []
        for i, f in enumerate(facts):
            r, ok = rows[src == i], trained[src == i]
            if len(r) and int(r.max()) >= len(f.durations_s):
                raise ValueError(f"ledger names row {int(r.max())} of {f.name}, which has {len(f.durations_s)} rows: "
                                 "the dataset changed since the run (its index fingerprint differs)")
            delivered = np.bincount(r, minlength=len(f.durations_s))
            seen = np.bincount(r[ok], minlength=len(f.durations_s))
            over = np.flatnonzero(delivered > expect[i])
            audio = float(f.durations_s[r[ok]].sum())
            total_s += audio
            accounts.append(DatasetAccount(
                name=f.name, planned=int(expect[i].sum()), trained=int(ok.sum()), once=int((seen == 1).sum()),
                never=int(((delivered == 0) & (expect[i] > 0)).sum()), more_than_once=int((seen > 1).sum()),
                over_plan=[str(f.keys[j]) if f.keys is not None else f"row {j}" for j in over[:20]],
                over_plan_count=int(len(over)), audio_s=audio, share=0.0, weight_share=f.weight / wsum,
                not_trained=int(len(r) - ok.sum())))
        for a in accounts:
            a.share = a.audio_s / total_s if total_s else 0.0
        acc.datasets = accounts
        if not acc.complete:
            acc.complete = all(a.never == 0 for a in accounts) and any(a.trained for a in accounts)
        out.append(acc)
    return out


def where_seen(history: History, dataset: int, row: int) -> list[dict]:
    """Every micro-batch that held `row` of dataset `dataset`: epoch, step, rank, batch, attempt, and whether it
    reached the weights."""
    hits = np.flatnonzero((history.rows == row) & (history.sources == dataset))
    out = []
    for h, i in zip(hits.tolist(), np.searchsorted(history.offsets, hits, side="right") - 1):
        out.append({"epoch": int(history.epoch[i]), "step": int(history.step[i]), "rank": int(history.rank[i]),
                    "batch": int(history.batch[i]), "attempt": history.attempts[int(history.attempt[i])].attempt,
                    "trained": bool(history.trained[h])})
    return out
