"""train/runfiles.py: one trainer per --out. A second trainer is refused naming the lease's holder (pid, host,
since when); a lease left by a dead holder on another node is honoured until it expires, then taken over; the
lease is released when the run exits. Real runs of the trainer on conftest's six_utts."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from conftest import train_small
from shardtrain.storage.lock import LEASE_NAME, LockHeld
from shardtrain.train import runfiles


def run(data: str, out: Path, steps: int) -> dict:
    return train_small(data, out, steps, "train.log_every_steps=1", "train.ckpt_every_steps=2",
                       "train.val_data_url=")


def test_second_trainer_is_refused_naming_the_holder_and_an_expired_lease_is_taken_over(six_utts, tmp_path, caplog):
    out = tmp_path / "run"
    holder = runfiles.RunLease(str(out), 60.0, None)
    try:
        with pytest.raises(LockHeld, match=rf"pid {os.getpid()} on host '{socket.gethostname()}', since '20"):
            run(six_utts, out, 2)
    finally:
        holder.release()
    assert not (out / LEASE_NAME).exists()
    # a holder on another node that died without releasing: refused until its lease expires, then taken over
    dead = {"host": "node-b", "pid": 1, "purpose": "trainer", "token": "f" * 32, "time_utc": "2026-01-01T00:00:00Z",
            "ttl_s": 60.0, "expires_unix": time.time() + 60}
    (out / LEASE_NAME).write_text(json.dumps(dead))
    with pytest.raises(LockHeld, match="node-b.*lease expires in"):
        run(six_utts, out, 2)
    (out / LEASE_NAME).write_text(json.dumps({**dead, "expires_unix": time.time() - 1}))
    assert run(six_utts, out, 2)["step"] == 2
    assert "lease expired" in caplog.text and not (out / LEASE_NAME).exists()  # released at exit


@pytest.mark.parametrize("how", ["file-url", "tilde"])
def test_out_as_file_url_or_tilde_writes_and_resumes_where_it_names(six_utts, tmp_path, monkeypatch, how):
    """`--out file:///x/run` and `--out '~/run'` wrote metrics, vocab and the ledger to `./file:/x/run` and `./~/run`
    (pathlib) while the lease and the checkpoint's fsync went to the folder named (fsspec), so every checkpoint
    failed with "No such file or directory". Both now name one folder, and a resume finds its checkpoints there."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    where = home / "run é+1" if how == "tilde" else tmp_path / "run é+1"
    out = "~/run é+1" if how == "tilde" else f"file://{where}"
    flags = ("train.ckpt_every_steps=2", "train.val_data_url=")
    first = train_small(six_utts, out, 2, *flags)  # type: ignore[arg-type]
    assert first["checkpoint"] == str(where / "checkpoints" / "step_000002")
    assert train_small(six_utts, out, 4, *flags, resume=True)["step"] == 4  # type: ignore[arg-type]
    assert sorted(p.name for p in (where / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert (where / "metrics.jsonl").is_file() and (where / "vocab.json").is_file()
    assert [p.name for p in cwd.iterdir()] == []  # nothing under the working directory
