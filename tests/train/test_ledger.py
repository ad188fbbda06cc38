"""The ledger (train/ledger.py, train/ledger_report.py): attempts replayed in order, epochs accounted.

Fast cases on hand-made micro-batches; tests/integration/test_ledger_run.py checks a real run that is
killed, resumed and re-sized."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from shardtrain.train.ledger import LedgerWriter, attempt_id, read_history
from shardtrain.train.ledger_report import DatasetFacts, account, counts_from_selection, where_seen


@dataclass
class FakeBatch:
    rows: np.ndarray
    sources: np.ndarray
    epoch: int
    step: int


def _epoch_batches(n_rows: int, per_batch: int, epoch: int, seed: int) -> list[np.ndarray]:
    order = np.random.default_rng(seed + epoch).permutation(n_rows)
    return [order[i:i + per_batch] for i in range(0, n_rows, per_batch)]


def _write_attempt(run: Path, *, start: int, t_ms: int, world: int, steps: list[tuple[int, int, int, list]],
                   flush_every: int, datasets=None) -> None:
    """steps: (step, epoch, batch index, [rows per rank]) trained by this attempt, flushed every `flush_every`."""
    writers = [LedgerWriter(run, rank=r, attempt=attempt_id(start, t_ms)) for r in range(world)]
    writers[0].start(start_step=start, world_size=world, datasets=datasets or [{"url": "d", "weight": 1.0}])
    for step, epoch, b, per_rank in steps:
        for r, w in enumerate(writers):
            rows = np.asarray(per_rank[r])
            w.add(step, [(FakeBatch(rows, np.zeros(len(rows), np.int16), epoch, b), {})])
        if step % flush_every == 0:
            for w in writers:
                w.flush(step)


def _facts(n: int) -> list[DatasetFacts]:
    return [DatasetFacts(name="d", weight=1.0, durations_s=np.full(n, 2.0),
                         keys=np.array([f"k{i:03d}" for i in range(n)], dtype=object))]


def _all_once(n: int):
    return lambda epoch: counts_from_selection(np.zeros(n, np.int16), np.arange(n), [n])


def _schedule(n_rows: int, world: int, epochs: int, per_batch: int = 4) -> list[tuple[int, int, int, list]]:
    out, step = [], 0
    for e in range(epochs):
        bs = _epoch_batches(n_rows, per_batch, e, seed=3)
        for b in range(0, len(bs), world):
            step += 1
            out.append((step, e, b // world, [bs[b + r] for r in range(world)]))
    return out


def test_resumed_and_resized_run_is_exactly_once(tmp_path):
    # 48 rows, 4 per batch: 2 ranks -> 6 steps per epoch. Attempt 1 trains steps 1-8 but checkpoints (flushes) at
    # 4 and 8, then a crash after step 10 (flushed at 10 but that checkpoint never committed: the next attempt
    # starts at 8). Attempt 2 resumes at 8 and trains the rest of epoch 1 and epoch 2.
    sched = _schedule(48, 2, 3)
    _write_attempt(tmp_path, start=0, t_ms=1000, world=2, steps=[s for s in sched if s[0] <= 10], flush_every=2)
    _write_attempt(tmp_path, start=8, t_ms=2000, world=2, steps=[s for s in sched if s[0] > 8], flush_every=2)
    h = read_history(str(tmp_path))
    assert [a.start_step for a in h.attempts] == [0, 8]
    assert h.cut and "steps 9-10" in h.cut[0]
    acc = account(h, _facts(48), _all_once(48))
    assert [a.epoch for a in acc] == [0, 1, 2]
    for a in acc:
        d = a.datasets[0]
        assert (d.once, d.never, d.more_than_once, d.over_plan_count) == (48, 0, 0, 0), a
        assert a.complete and not a.broken
    # --key: row 5 is seen once per epoch, each time by one rank
    assert sorted(h["epoch"] for h in where_seen(h, 0, 5)) == [0, 1, 2]


def test_duplicated_step_is_reported_with_its_keys(tmp_path):
    sched = _schedule(48, 2, 1)
    sched[3] = (sched[3][0], 0, sched[3][2], [sched[2][3][0], sched[3][3][1]])  # rank 0 trains step 3's rows again
    _write_attempt(tmp_path, start=0, t_ms=1000, world=2, steps=sched, flush_every=1)
    (acc,) = account(read_history(str(tmp_path)), _facts(48), _all_once(48))
    d = acc.datasets[0]
    assert acc.broken and d.over_plan_count == 4 and d.never == 4
    dup = set(_epoch_batches(48, 4, 0, seed=3)[4].tolist())
    assert set(d.over_plan) == {f"k{i:03d}" for i in dup}


def test_unflushed_steps_are_not_in_the_ledger(tmp_path):
    sched = _schedule(48, 2, 1)
    _write_attempt(tmp_path, start=0, t_ms=1000, world=2, steps=sched[:5], flush_every=4)
    h = read_history(str(tmp_path))
    assert sorted(set(h.step.tolist())) == [1, 2, 3, 4]
    (acc,) = account(h, _facts(48), _all_once(48))
    assert not acc.complete and acc.datasets[0].never == 48 - 4 * 2 * 4
