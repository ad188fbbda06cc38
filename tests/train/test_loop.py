"""train/loop.py, the training process: overrides, overfitting real speech, bit-exact resume after a crash, empty
batches. (Atomic checkpoints: test_checkpoint.py.)

Everything runs in one process on the CPU against a real packed dataset (espeak-ng speech packed with the real
packer; conftest's six_utts). Multi-process (torchrun) checks live in tests/integration/test_train_torchrun.py.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from conftest import OVERFIT_STEPS, read_metrics, train_small
from pipelines import load_pipeline
from shardtrain import faults
from shardtrain.train import checkpoint as ckpt
from shardtrain.train.overrides import apply_overrides
from shardtrain.load.reader import StreamError


def run(data: str, out: Path, steps: int, *overrides: str, resume: bool = False, val: bool = True) -> dict:
    return train_small(data, out, steps, f"train.val_data_url={data if val else ''}", *overrides, resume=resume)


def test_overrides_coerce_by_type_and_name_valid_keys():
    cfg = apply_overrides(load_pipeline("tiny_cpu"), ["train.betas=0.8,0.9", "train.val_max_batches=none",
                                                      "stream.bucket.max_batch_size=4", "train.augment=off"])
    assert cfg.train.betas == (0.8, 0.9) and cfg.train.val_max_batches is None
    assert cfg.stream.bucket.max_batch_size == 4 and cfg.train.augment is False
    with pytest.raises(ValueError, match="valid keys here: .*train.max_steps"):
        apply_overrides(cfg, ["train.max_step=3"])
    with pytest.raises(ValueError, match="train.max_steps: expected int"):
        apply_overrides(cfg, ["train.max_steps=ten"])
    with pytest.raises(ValueError, match="train.max_steps .*must be >= 1"):
        apply_overrides(cfg, ["train.max_steps=0"])


def test_tiny_model_overfits_a_handful_of_utterances(overfit_run):
    """The shared run (conftest's overfit_run): 100 steps on six_utts, validated on them, metrics every 5 steps."""
    out, res = overfit_run
    assert OVERFIT_STEPS == 100
    losses, vals = read_metrics(out)
    first, final = losses[0]["loss"], losses[-1]["loss"]
    assert final < first / 20, (first, final)  # stated factor: 20x (typically ~3.0 -> <0.05)
    assert vals[-1]["cer"] <= 0.02 and res["cer"] == vals[-1]["cer"]
    exact = [ref == hyp for ref, hyp in res["val_examples"]]
    assert sum(exact) >= len(exact) - 1, res["val_examples"]  # greedy decoding recovers the transcripts
    assert (out / "config.json").is_file() and (out / "checkpoints" / "step_000100").is_dir()
    assert json.loads((out / "config.json").read_text())["model"]["d_model"] == 96


def test_resume_reproduces_uninterrupted_losses_exactly(six_utts, tmp_path, monkeypatch):
    """Augmentation, dropout, grad accumulation and mid-epoch batches on; crash right after the step-3 save."""
    extra = ["train.augment=true", "model.dropout=0.1", "train.grad_accum_steps=2", "stream.bucket.max_batch_seconds=6",
             "stream.bucket.num_buckets=2", "train.log_every_steps=1", "train.ckpt_every_steps=3",
             "train.val_every_steps=3"]
    run(six_utts, tmp_path / "a", 6, *extra)
    monkeypatch.setenv(faults.ENV, "train.step.rank0=3")  # the documented fault seam, armed in this process
    with pytest.raises(faults.InjectedFault, match="train.step.rank0=3"):
        run(six_utts, tmp_path / "b", 6, *extra)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "b" / "checkpoints")] == [3]
    with pytest.raises(ValueError, match="--resume"):  # never silently train over an existing run
        run(six_utts, tmp_path / "b", 6, *extra)
    run(six_utts, tmp_path / "b", 6, *extra, resume=True)  # still armed: the marker makes it fire only once
    (la, va), (lb, vb) = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in lb] == [1, 2, 3, 4, 5, 6]  # steps logged before the crash are not duplicated
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]  # bit-exact, not approximately equal
    assert [(r["val_loss"], r["cer"]) for r in va] == [(r["val_loss"], r["cer"]) for r in vb]
    ma = torch.load(tmp_path / "a/checkpoints/step_000006/model.pt", weights_only=True)
    mb = torch.load(tmp_path / "b/checkpoints/step_000006/model.pt", weights_only=True)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_empty_steps_do_not_advance_and_all_empty_data_stops(six_utts, tmp_path, caplog):
    """A sample that fails to decode leaves an empty batch (max_batch_size=1); with one rank that is every rank:
    the step is not taken (step counter and LR schedule stay), training carries on to max_steps. The default 1%
    share stops the same run (1 of 6 samples skipped); with every sample garbled it stops for lack of data."""
    data = tmp_path / "corrupt"
    shutil.copytree(six_utts, data)
    index = pq.read_table(data / "index.parquet").to_pylist()
    row = index[0]
    with open(data / f"shard-{row['shard']:06d}.tar", "r+b") as f:
        f.seek(row["audio_offset"])
        f.write(b"\x00" * row["audio_size"])
    one = ["stream.bucket.max_batch_size=1", "train.log_every_steps=1"]
    caplog.set_level("WARNING", logger="shardtrain.train")
    run(str(data), tmp_path / "run", 8, *one, "stream.max_skipped_share=0.5", val=False)
    assert any("not taken" in r.getMessage() for r in caplog.records), "no empty step: the test proves nothing"
    losses, _ = read_metrics(tmp_path / "run")
    assert [r["step"] for r in losses] == list(range(1, 9)) and all(math.isfinite(r["loss"]) for r in losses)
    assert losses[-1]["skipped"] >= 1
    # linear warm-up over 20 steps: after k steps taken the LR is 3e-3 * (k + 1) / 20, empty batches or not
    assert [r["lr"] for r in losses] == pytest.approx([3e-3 * (r["step"] + 1) / 20 for r in losses])
    with pytest.raises(StreamError, match="skipped as bad data"):
        run(str(data), tmp_path / "run2", 8, *one, val=False)
    for tar in data.glob("*.tar"):
        tar.write_bytes(b"\xff" * tar.stat().st_size)
    with pytest.raises(StreamError, match="batches in a row with no sample"):
        run(str(data), tmp_path / "run3", 8, *one, "stream.max_skipped_share=1", val=False)
    assert not (tmp_path / "run3" / "checkpoints").exists() or not list((tmp_path / "run3/checkpoints").iterdir())
