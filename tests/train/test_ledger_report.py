"""train/ledger_report.py: the per-epoch account of a weighted mixture read back from real ledger files
(LedgerWriter -> read_history): audio share against weight share, a row planned twice, the unfinished last epoch,
a dataset that changed since the run (tests/train/test_ledger.py: attempts, cuts and duplicates of one dataset)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from shardtrain.train.ledger import LedgerWriter, attempt_id, read_history
from shardtrain.train.ledger_report import DatasetFacts, account, counts_from_selection, where_seen


def write_run(run, epochs: list[list[tuple[np.ndarray, np.ndarray]]]) -> None:
    """One rank, one attempt; epochs[e] = [(rows, sources) per step]; flushed after every step."""
    w = LedgerWriter(run, rank=0, attempt=attempt_id(0, 1000))
    w.start(start_step=0, world_size=1, datasets=[{"url": "a", "weight": 3.0}, {"url": "b", "weight": 1.0}])
    step = 0
    for e, batches in enumerate(epochs):
        for b, (rows, sources) in enumerate(batches):
            step += 1
            w.add(step, [(SimpleNamespace(rows=rows, sources=sources, epoch=e, step=b), {})])
            w.flush(step)


FACTS = [DatasetFacts("a", 3.0, np.full(6, 2.0), np.array([f"a{i}" for i in range(6)], dtype=object)),
         DatasetFacts("b", 1.0, np.full(2, 1.0))]
# each epoch's plan: every row of a once, row 1 of the small dataset b twice, row 0 of b once
SEL = (np.array([0, 0, 0, 0, 0, 0, 1, 1, 1], np.int16), np.array([0, 1, 2, 3, 4, 5, 1, 1, 0]))


def expected(epoch: int) -> list[np.ndarray]:
    return counts_from_selection(SEL[0], SEL[1], [6, 2])


def test_mixture_account_shares_and_a_row_planned_twice(tmp_path):
    full = [(np.array([0, 1, 2]), np.zeros(3, np.int16)), (np.array([3, 4, 5]), np.zeros(3, np.int16)),
            (np.array([1, 1, 0]), np.ones(3, np.int16))]
    write_run(tmp_path, [full, full[:1]])  # epoch 1 stops after its first step
    h = read_history(str(tmp_path))
    e0, e1 = account(h, FACTS, expected)
    a, b = e0.datasets
    assert (a.planned, a.trained, a.once, a.never, a.over_plan_count) == (6, 6, 6, 0, 0)
    assert (b.planned, b.trained, b.once, b.more_than_once, b.over_plan_count) == (3, 3, 1, 1, 0)
    assert a.audio_s == 12.0 and b.audio_s == 3.0 and a.share == pytest.approx(0.8) and a.weight_share == 0.75
    assert e0.complete and e0.steps == 3 and not e0.broken
    assert not e1.complete and e1.datasets[0].never == 3 and e1.datasets[1].trained == 0
    assert [x["epoch"] for x in where_seen(h, 1, 1)] == [0, 0]  # b's row 1, twice in one batch
    assert account(h, FACTS, expected, epochs=[1])[0].epoch == 1


def test_a_row_trained_more_than_planned_is_named_and_a_changed_dataset_refused(tmp_path):
    write_run(tmp_path, [[(np.array([0, 0, 1]), np.zeros(3, np.int16))]])
    (acc,) = account(read_history(str(tmp_path)), FACTS, expected)
    assert acc.broken and acc.datasets[0].over_plan == ["a0"] and acc.datasets[1].over_plan_count == 0
    small = [DatasetFacts("a", 3.0, np.full(1, 2.0)), FACTS[1]]
    with pytest.raises(ValueError, match="names row 1 of a, which has 1 rows: the dataset changed"):
        account(read_history(str(tmp_path)), small, expected)
