"""train/metrics.py: metrics.jsonl as the contract (one sorted JSON object a line, rank 0 only), TensorBoard beside
it, and what a resume does to lines logged past its checkpoint (dropped, and counted as redone)."""
from __future__ import annotations

import json

from shardtrain.train.metrics import MetricsLogger, redone_after, truncate_after


def rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_rank0_writes_lines_and_tensorboard_other_ranks_nothing(tmp_path):
    m = MetricsLogger(tmp_path, active=True, tensorboard=True)
    m.log({"step": 1, "loss": 2.5, "lr": 1e-3, "skipped": 0, "event": "x", "flag": True})
    m.log({"step": 2, "val_loss": 2.0, "cer": 0.9})
    m.text("examples", "ref | hyp", 2)
    m.close()
    assert rows(tmp_path / "metrics.jsonl") == [{"event": "x", "flag": True, "loss": 2.5, "lr": 1e-3, "skipped": 0,
                                                 "step": 1}, {"cer": 0.9, "step": 2, "val_loss": 2.0}]
    assert (tmp_path / "metrics.jsonl").read_text().splitlines()[1] == '{"cer": 0.9, "step": 2, "val_loss": 2.0}'
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    other = tmp_path / "r1"
    other.mkdir()
    m1 = MetricsLogger(other, active=False, tensorboard=True)
    m1.log({"step": 1, "loss": 1.0})
    m1.close()
    assert list(other.iterdir()) == []


def test_resume_drops_lines_past_the_checkpoint_and_counts_them(tmp_path):
    path = tmp_path / "metrics.jsonl"
    m = MetricsLogger(tmp_path, active=True, tensorboard=False)
    for step in range(1, 9):
        m.log({"step": step, "loss": 1.0, "audio_s": 10.0})
    m.log({"step": 8, "val_loss": 1.0})  # a validation line carries no loss: not training redone
    m.close()
    assert redone_after(path, 5) == {"steps": 3, "audio_s": 30.0}
    assert redone_after(tmp_path / "none.jsonl", 5) == {"steps": 0, "audio_s": 0.0}
    resumed = MetricsLogger(tmp_path, active=True, tensorboard=False, start_step=5)
    resumed.log({"step": 6, "loss": 0.5})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in rows(path)] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 1.0),
                                                             (6, 0.5)]
    assert truncate_after(path, 2) == 4 and truncate_after(tmp_path / "none.jsonl", 2) == 0
    assert not list(tmp_path.glob("*.tmp"))
