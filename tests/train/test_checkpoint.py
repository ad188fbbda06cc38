"""train/checkpoint.py: a checkpoint set is visible whole or not at all -- a save that fails mid-way leaves the
previous checkpoints and no partial set, keep_last prunes, and a process SIGKILLed in the middle of saves never
leaves a listed checkpoint that does not load.

This file is imported by the SIGKILL test's child process (`from test_checkpoint import _save`): it imports
nothing from conftest."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardtrain.train import checkpoint as ckpt
from shardtrain.world import World


def _save(root: Path, step: int, numel: int = 1 << 20, keep_last: int = 2, val_loss: float | None = None) -> None:
    parts = ckpt.CheckpointParts(step=step, rank_state={"loader_state": "{}"}, main_state={"step": step},
                                 model_state={"w": torch.full((numel,), float(step))}, meta={"val_loss": val_loss})
    ckpt.save_checkpoint(root, parts, world=World(), keep_last=keep_last)


def test_crash_during_save_leaves_previous_checkpoints(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    real = ckpt._save

    def failing(obj, path):
        if path.name == "model.pt":
            raise OSError("disk full (injected)")
        real(obj, path)

    monkeypatch.setattr(ckpt, "_save", failing)
    with pytest.raises(ckpt.CheckpointWriteError, match=r"step_000002 not written \(rank 0\): OSError: disk full "
                       r"\(injected\).*latest checkpoint is still step_000001"):
        _save(tmp_path, 2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1]
    assert not (tmp_path / ".tmp-step_000002").exists()  # the half-written set is removed
    monkeypatch.setattr(ckpt, "_save", real)
    _save(tmp_path, 3)
    _save(tmp_path, 4)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]  # keep_last=2
    assert not list(tmp_path.glob(".tmp-*"))



def test_a_save_after_falling_back_past_an_unreadable_checkpoint_is_the_one_kept(tmp_path):
    """The newest checkpoint is truncated, the resume falls back to an older one and saves an earlier step: that
    save stays (it was pruned as "not among the newest" while the unreadable later step was kept, so a run exited
    0 with only a checkpoint that does not load), and the abandoned later step is gone."""
    for step in (4, 8, 12):
        _save(tmp_path, step, numel=1000, keep_last=3)
    model = tmp_path / "step_000012" / "model.pt"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    path, _ = ckpt.load_newest_intact(tmp_path, rank=0, world_size=1)
    assert path.name == "step_000008"
    (tmp_path / "step_000004" / "meta.json").write_text("{not json")  # an old checkpoint's damaged meta.json
    _save(tmp_path, 10, numel=1000, keep_last=1)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [10]
    path, state = ckpt.load_newest_intact(tmp_path, rank=0, world_size=1)
    assert path.name == "step_000010" and state["main"]["step"] == 10


def test_prune_never_keeps_a_nan_val_loss_as_the_best(tmp_path):
    """A diverged validation (val_loss NaN) is no score: min() over (val_loss, step) tuples kept a leading NaN as
    "the best" and pruned the real best checkpoint."""
    for step, loss in ((2, float("nan")), (4, 0.5), (6, 0.9), (8, 1.2)):
        _save(tmp_path, step, numel=1000, keep_last=1, val_loss=loss)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 8]  # the best (0.5) and the newest


KILL_SCRIPT = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_checkpoint import _save
from shardtrain.train.checkpoint import latest_checkpoint, read_meta
root = Path({root!r})
last = latest_checkpoint(root)
step = read_meta(last)["step"] + 1 if last else 1
print("ready", flush=True)
while True:
    _save(root, step, numel=4 << 20)
    step += 1
"""


def test_sigkill_during_saves_never_leaves_a_visible_partial_checkpoint(tmp_path):
    script = KILL_SCRIPT.format(tests=str(Path(__file__).resolve().parent), root=str(tmp_path))
    for delay_s in (0.7, 1.3):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay_s)  # mid-way through some save of a 16 MB tensor
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        listed = ckpt.list_checkpoints(tmp_path)
        assert listed, "no checkpoint committed before the kill"
        for step, path in listed:
            state = ckpt.load_checkpoint(path, rank=0, world_size=1)
            assert state["main"]["step"] == step and torch.equal(state["model"]["w"], torch.full((4 << 20,), float(step)))
