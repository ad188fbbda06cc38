"""train/guards.py: what never reaches the weights. Real training (tiny_cpu on packed espeak-ng speech) with a NaN
injected at the loss (tests/train/nanmodel.py), and a dataset of clips far too short for their transcripts."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import pack_subset
from pipelines import load_pipeline
from shardtrain import cli
from shardtrain.format.manifest import open_dataset
from shardtrain.infer.checkpoint_model import CheckpointError, find_checkpoint
from shardtrain.pack import PackConfig, pack
from shardtrain.train.guards import StepGuard, TrainingHalted, ctc_frames_needed
from shardtrain.train.ledger import read_history
from shardtrain.train.loop import train
from shardtrain.train.overrides import apply_overrides
from shardtrain.world import World

SMALL = ["model.d_model=64", "model.num_layers=1", "model.dropout=0", "train.augment=false", "train.lr=3e-3",
         "train.warmup_steps=2", "stream.bucket.max_batch_seconds=12", "train.tensorboard=false",
         "train.progress=false", "train.cpu_threads=1", "train.log_every_steps=1", "train.val_every_steps=0"]


def run(data: str, out: Path, steps: int, *extra: str) -> dict:
    cfg = apply_overrides(load_pipeline("tiny_cpu"), SMALL + [
        f"train.data_url={data}", f"train.out_dir={out}", f"train.max_steps={steps}", *extra])
    return train(cfg, World())


def weight_log(path: Path) -> list[dict]:
    return [json.loads(x) for x in Path(f"{path}.rank0").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(speech_corpus, tmp_path_factory) -> str:
    return pack_subset(speech_corpus, tmp_path_factory.mktemp("guards"), 12)


def test_ctc_frames_needed_counts_adjacent_repeats_per_utterance():
    targets = torch.tensor([1, 1, 2, 3, 3, 3, 3, 4])  # "aab" | "ccc" | "" | "cd": a repeat across utterances is none
    lengths = torch.tensor([3, 3, 0, 2])
    assert ctc_frames_needed(targets, lengths).tolist() == [4, 5, 0, 2]


def test_one_nan_step_is_skipped_counted_and_leaves_the_weights_alone(data, tmp_path, monkeypatch):
    monkeypatch.setenv("NAN_AT", "3")
    monkeypatch.setenv("NAN_LOG", str(tmp_path / "w"))
    res = run(data, tmp_path / "run", 6, "model.factory=nanmodel:build")
    assert res["step"] == 6 and res["nonfinite_steps"] == 1
    calls = weight_log(tmp_path / "w")
    assert calls[2]["weights"] == calls[3]["weights"]  # step 3's update was not applied
    assert calls[1]["weights"] != calls[2]["weights"] and calls[3]["weights"] != calls[4]["weights"]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert all(x == x and abs(x) < float("inf") for x in losses)  # the NaN never reached a logged loss
    state = torch.load(sorted((tmp_path / "run" / "checkpoints").glob("*/model.pt"))[-1], weights_only=True)
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())
    h = read_history(str(tmp_path / "run"))  # the ledger: step 3's utterances reached no weight
    untrained = {int(h.step[i]) for i in range(len(h.step)) if not h.trained[h.offsets[i]:h.offsets[i + 1]].any()}
    assert untrained == {3} and h.trained[h.step.repeat(np.diff(h.offsets)) != 3].all()


def test_nan_steps_in_a_row_stop_the_run_in_one_line_without_a_checkpoint(data, tmp_path, monkeypatch):
    monkeypatch.setenv("NAN_AT", ",".join(str(i) for i in range(2, 40)))
    with pytest.raises(TrainingHalted, match="3 steps in a row with a NaN/Inf loss or gradient"):
        run(data, tmp_path / "run", 30, "model.factory=nanmodel:build", "train.max_nonfinite_steps=3",
            "train.ckpt_every_steps=1")
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("*/model.pt"))
    for c in ckpts:  # written before the NaNs began, all finite
        assert all(torch.isfinite(t).all() for t in torch.load(c, weights_only=True).values() if t.is_floating_point())


def _long_targets(speech_corpus: Path, out: Path, n: int, long: int) -> str:
    """A dataset of `n` corpus clips whose first `long` transcripts are repeated 40 times: far more labels than a
    4x-subsampled output has frames."""
    rows = (speech_corpus / "manifest.tsv").read_text().splitlines()
    header, body = rows[0].split("\t"), [r.split("\t") for r in rows[1:n + 1]]
    text_col = header.index("text")
    lines = ["\t".join(header)]
    for i, r in enumerate(body):
        r[0] = str(speech_corpus / r[0])
        r[text_col] = " ".join([r[text_col]] * (40 if i < long else 1))
        lines.append("\t".join(r))
    (out / "long.tsv").write_text("\n".join(lines) + "\n")
    pack(PackConfig(input=str(out / "long.tsv"), output=str(out / "ds"), max_chars_per_s=0, progress=False))
    return str(out / "ds")


def test_targets_ctc_cannot_align_are_dropped_and_a_dataset_of_them_stops_loudly(speech_corpus, tmp_path):
    with pytest.raises(TrainingHalted, match="transcripts too long for their audio"):
        run(_long_targets(speech_corpus, tmp_path, 8, 8), tmp_path / "run", 40)


def test_the_ledger_counts_dropped_targets_as_delivered_not_trained(speech_corpus, tmp_path, capsys):
    """2 of 8 utterances CTC cannot align: trained on is 6 an epoch; the 2 are `dropped`, neither once nor never."""
    ds = _long_targets(speech_corpus, tmp_path, 8, 2)
    index = open_dataset(ds).read_index().to_pylist()
    long_key = next(r["key"] for r in index if len(r["text"]) > 300)
    res = run(ds, tmp_path / "run", 12, "train.max_impossible_share=1.0", "stream.bucket.max_batch_seconds=6")
    assert res["impossible_targets"] >= 2
    assert cli.main(["ledger", str(tmp_path / "run"), "--json", "--key", long_key]) == 0
    report = json.loads(capsys.readouterr().out)
    (d,) = report["epochs"][0]["datasets"]
    assert (d["trained"], d["once"], d["not_trained"], d["never"], d["over_plan_count"]) == (6, 6, 2, 0, 0), d
    assert report["epochs"][0]["complete"]
    assert report["keys"][long_key] and not any(h["trained"] for h in report["keys"][long_key])


def test_step_guard_judges_the_window_not_one_bad_batch():
    g = StepGuard(max_nonfinite_steps=2, max_impossible_share=0.5)
    for step in range(1, 25):  # one bad batch in 24 steps: fine
        g.after_step(step, nonfinite=False, overflow=step == 5, impossible=8 if step == 3 else 0, samples=8)
    assert g.counters() == {"nonfinite_steps": 0, "overflow_steps": 1, "impossible_targets": 8}
    g.after_step(25, nonfinite=True, overflow=False, impossible=0, samples=8)
    g.after_step(26, nonfinite=False, overflow=False, impossible=0, samples=8)  # the run resets the row
    g.after_step(27, nonfinite=True, overflow=False, impossible=0, samples=8)
    with pytest.raises(TrainingHalted):
        g.after_step(28, nonfinite=True, overflow=False, impossible=0, samples=8)


def test_validation_leaves_utterances_ctc_cannot_align_out_of_val_loss(data, speech_corpus, tmp_path):
    """Their loss is zero_infinity's 0 while their tokens were counted: val_loss read lower, and a set of only such
    utterances read 0.0, the best checkpoint for good. Now: per token of the alignable ones, `unalignable` counted,
    NaN for a set of none (never the best)."""
    for name in ("mixed", "hopeless"):
        (tmp_path / name).mkdir()
    mixed, hopeless = _long_targets(speech_corpus, tmp_path / "mixed", 8, 2), \
        _long_targets(speech_corpus, tmp_path / "hopeless", 8, 8)
    for ds, want in ((mixed, 2), (hopeless, 8)):
        out = tmp_path / f"run-{want}"
        run(data, out, 2, f"train.val_data_url={ds}", "train.val_every_steps=2")
        (row,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
        unalignable = [v for k, v in row.items() if k.endswith("/unalignable")]
        assert unalignable == [want], row
        if want < 8:
            assert 0 < row["val_loss"] < float("inf")
        else:
            assert row["val_loss"] != row["val_loss"]  # NaN
            with pytest.raises(CheckpointError, match="non-NaN"):
                find_checkpoint(out, "best")
