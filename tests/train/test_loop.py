"""Trainer: overrides, overfitting real speech, bit-exact resume, empty batches, atomic checkpoints.

Everything runs in one process on the CPU against a real packed dataset (espeak-ng speech packed with the real
packer). Multi-process (torchrun) checks live in tests/integration/test_train_torchrun.py.
"""
from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from pipelines import load_pipeline
from shardtrain import faults
from shardtrain.train import checkpoint as ckpt
from shardtrain.train.overrides import apply_overrides
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.load.reader import StreamError
from shardtrain.train.loop import train
from shardtrain.world import World

# A 0.6M-parameter model, no augmentation/dropout unless a test turns them on, every batch = all utterances.
SMALL = ["model.d_model=96", "model.num_layers=2", "model.dropout=0", "train.augment=false", "train.lr=3e-3",
         "train.warmup_steps=20", "stream.bucket.max_batch_seconds=30", "stream.bucket.num_buckets=1",
         "train.tensorboard=false", "train.progress=false", "train.cpu_threads=1"]


def pack_subset(corpus: Path, out: Path, n: int) -> str:
    """The first `n` utterances of a synth corpus, packed with the real packer into 2-sample shards."""
    rows = (corpus / "manifest.tsv").read_text().splitlines()
    header, body = rows[0], rows[1 : n + 1]
    out.mkdir(parents=True, exist_ok=True)
    tsv = out / "subset.tsv"
    tsv.write_text("\n".join([header] + [str(corpus / r.split("\t")[0]) + "\t" + r.split("\t", 1)[1]
                                         for r in body]) + "\n")
    pack(PackConfig(input=str(tsv), output=str(out / "shards"), max_samples_per_shard=2, progress=False))
    return str(out / "shards")


@pytest.fixture(scope="module")
def six_utts(speech_corpus, tmp_path_factory) -> str:
    return pack_subset(speech_corpus, tmp_path_factory.mktemp("six"), 6)


def run(data: str, out: Path, steps: int, *overrides: str, resume: bool = False, val: bool = True) -> dict:
    cfg = apply_overrides(load_pipeline("tiny_cpu"), SMALL + [
        f"train.data_url={data}", f"train.val_data_url={data if val else ''}", f"train.out_dir={out}",
        f"train.max_steps={steps}", *overrides])
    return train(cfg, World(), resume=resume)


def read_metrics(out: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


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


def test_tiny_model_overfits_a_handful_of_utterances(six_utts, tmp_path):
    res = run(six_utts, tmp_path, 100, "train.log_every_steps=5", "train.val_every_steps=0")
    losses, vals = read_metrics(tmp_path)
    first, final = losses[0]["loss"], losses[-1]["loss"]
    assert final < first / 20, (first, final)  # stated factor: 20x (typically ~3.0 -> <0.05)
    assert vals[-1]["cer"] <= 0.02 and res["cer"] == vals[-1]["cer"]
    exact = [ref == hyp for ref, hyp in res["val_examples"]]
    assert sum(exact) >= len(exact) - 1, res["val_examples"]  # greedy decoding recovers the transcripts
    assert (tmp_path / "config.json").is_file() and (tmp_path / "checkpoints" / "step_000100").is_dir()
    assert json.loads((tmp_path / "config.json").read_text())["model"]["d_model"] == 96


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


def _save(root: Path, step: int, numel: int = 1 << 20) -> None:
    ckpt.save_checkpoint(root, step=step, rank=0, world_size=1, barrier=lambda: None,
                         rank_state={"loader_state": "{}"}, main_state={"step": step},
                         model_state={"w": torch.full((numel,), float(step))}, meta={"val_loss": None},
                         keep_last=2)


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


KILL_SCRIPT = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_loop import _save
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
