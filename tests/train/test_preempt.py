"""A run that survives its cluster, in one process: a real SIGTERM stops it with a checkpoint and the resume is
exact; checkpoint faults (full disk, truncated file, changed config) are one line each and leave the previous
checkpoint usable. (One trainer per --out, the lease: test_runfiles.py.) torchrun and S3 variants:
tests/integration/test_train_preempt.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from shardtrain.train import checkpoint as ckpt
from conftest import read_metrics, train_small

EXTRA = ["train.log_every_steps=1", "train.ckpt_every_steps=2", "train.val_data_url="]


def run(data: str, out: Path, steps: int, *overrides: str, resume: bool = False) -> dict:
    return train_small(data, out, steps, *EXTRA, *overrides, resume=resume)


def signal_at_step(out: Path, step: int, sig: int = signal.SIGTERM) -> threading.Thread:
    """Send `sig` to this process once metrics.jsonl shows `step` (a real signal, at a step the test knows)."""
    def watch() -> None:
        path = out / "metrics.jsonl"
        for _ in range(6000):
            if path.is_file() and any(json.loads(x).get("step", 0) >= step for x in path.read_text().splitlines()):
                os.kill(os.getpid(), sig)
                return
            time.sleep(0.01)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_sigterm_checkpoints_the_step_and_resume_is_exact(six_utts, tmp_path):
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or what another library in this process set (ray.init)
    run(six_utts, tmp_path / "a", 8)
    signal_at_step(tmp_path / "b", 3)
    res = run(six_utts, tmp_path / "b", 8)
    assert res["preempted"] and res["signal"] == "SIGTERM"
    stopped = res["step"]
    assert 3 <= stopped < 8
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "b/checkpoints")][-1] == stopped  # this step, saved
    row = [json.loads(x) for x in (tmp_path / "b/metrics.jsonl").read_text().splitlines()][-1]
    assert row["event"] == "preempted" and 0 < row["checkpoint_s"] <= row["preempt_s"] < 30
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handler gone, the previous one back
    run(six_utts, tmp_path / "b", 8, resume=True)
    (la, _), (lb, _) = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in lb] == list(range(1, 9))
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]  # bit-exact through the preemption


def test_preemption_off_switch_and_bad_signal_names(six_utts, tmp_path):
    with pytest.raises(ValueError, match="SIGKILL"):
        run(six_utts, tmp_path / "x", 2, "train.preempt_signals=SIGTERM,SIGKILL")
    before = signal.getsignal(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, lambda *a: None)  # the caller's handler stays when preemption is off
    try:
        res = run(six_utts, tmp_path / "y", 2, "train.preempt_signals=")
        assert not res.get("preempted") and signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_truncated_newest_checkpoint_is_named_and_the_previous_one_used(six_utts, tmp_path, caplog):
    out = tmp_path / "run"
    run(six_utts, out, 4)
    model = out / "checkpoints/step_000004/model.pt"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    res = run(six_utts, out, 6, resume=True)
    assert res["step"] == 6
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("step_000004 is corrupt or incomplete (RuntimeError: PytorchStreamReader" in m for m in warned)
    assert any("resuming from" in m and m.split()[2].rstrip(",").endswith("step_000002") for m in warned)


def test_changed_model_config_says_which_fields_differ(six_utts, tmp_path):
    out = tmp_path / "run"
    run(six_utts, out, 2)
    with pytest.raises(ValueError) as err:
        run(six_utts, out, 4, "model.d_model=64", resume=True)
    msg = str(err.value)
    assert "\n" not in msg and "model.d_model 96 -> 64" in msg and "differ in shape" in msg


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MB tmpfs (root only): room for one tiny checkpoint set, not two."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode}): full-disk test not run")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_keeps_the_previous_checkpoint_and_says_why(six_utts, small_disk, caplog):
    out = small_disk / "run"
    res = run(six_utts, out, 2, "train.ckpt_every_steps=1", "train.keep_last=5", "train.ledger=false")
    assert res["step"] == 2
    filler = small_disk / "filler"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler.write_bytes(b"\0" * max(0, free - 200_000))
    with pytest.raises(ckpt.CheckpointWriteError) as err:  # every save fails: 2 tolerated, the final one raises
        run(six_utts, out, 5, "train.ckpt_every_steps=1", "train.keep_last=5", "train.ledger=false", resume=True)
    msg = str(err.value)
    assert "\n" not in msg and "disk full" in msg and "latest checkpoint is still step_000002" in msg
    assert "training goes on" in caplog.text
    assert [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")] == [1, 2]
    assert not list((out / "checkpoints").glob(".tmp-*"))
    filler.unlink()
    state = ckpt.load_checkpoint(out / "checkpoints/step_000002", rank=0, world_size=1)
    assert int(state["main"]["step"]) == 2 and isinstance(state["model"], dict) and torch.is_tensor(
        next(iter(state["model"].values())))


def test_first_ctrl_c_sets_the_flag_and_a_second_raises_at_once():
    from shardtrain.train.preempt import Preemption, parse_signals

    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN in a job a shell started in the background
    pre = Preemption(parse_signals("TERM,USR1")).install()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # real signals: Python runs the handler at the next bytecode
        time.sleep(0.05)
        assert pre.signum == signal.SIGINT and pre.name() == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # a later signal keeps the first one's name and time
        time.sleep(0.05)
        assert pre.name() == "SIGINT"
    finally:
        pre.uninstall()
    assert signal.getsignal(signal.SIGINT) is before  # what was there before, restored


def test_a_signal_during_validation_checkpoints_that_step(six_utts, tmp_path, monkeypatch):
    """SIGTERM arriving while validation runs stops the run at the validated step, not after one more step: a dev
    set takes minutes, and a scheduler's grace period (torchrun: 30 s) is sized for one step plus the write."""
    from shardtrain.train import trainer

    real = trainer.evaluate

    def evaluate_then_signalled(*args, **kwargs):
        res = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # lands before validation returns
        return res

    monkeypatch.setattr(trainer, "evaluate", evaluate_then_signalled)
    res = run(six_utts, tmp_path / "b", 8, f"train.val_data_url={six_utts}", "train.val_every_steps=3")
    assert res["preempted"] and res["signal"] == "SIGTERM" and res["step"] == 3
    (path,) = [p for s, p in ckpt.list_checkpoints(tmp_path / "b/checkpoints") if s == 3]
    assert ckpt.read_meta(path)["val_loss"] == res["val_loss"]  # the step's validation kept for the best pick
