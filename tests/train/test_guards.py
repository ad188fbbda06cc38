"""train/guards.py: what never reaches the weights. Real training (tiny_cpu on packed espeak-ng speech) with a NaN
injected at the loss (tests/train/nanmodel.py), and a dataset of clips far too short for their transcripts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import pack_subset
from pipelines import load_pipeline
from shardtrain.pack import PackConfig, pack
from shardtrain.train.guards import StepGuard, TrainingHalted, ctc_frames_needed
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


def test_nan_steps_in_a_row_stop_the_run_in_one_line_without_a_checkpoint(data, tmp_path, monkeypatch):
    monkeypatch.setenv("NAN_AT", ",".join(str(i) for i in range(2, 40)))
    with pytest.raises(TrainingHalted, match="3 steps in a row with a NaN/Inf loss or gradient"):
        run(data, tmp_path / "run", 30, "model.factory=nanmodel:build", "train.max_nonfinite_steps=3",
            "train.ckpt_every_steps=1")
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("*/model.pt"))
    for c in ckpts:  # written before the NaNs began, all finite
        assert all(torch.isfinite(t).all() for t in torch.load(c, weights_only=True).values() if t.is_floating_point())


def test_targets_ctc_cannot_align_are_dropped_and_a_dataset_of_them_stops_loudly(speech_corpus, tmp_path):
    """Every transcript repeated 40 times: far more labels than a 4x-subsampled output has frames."""
    rows = (speech_corpus / "manifest.tsv").read_text().splitlines()
    header, body = rows[0].split("\t"), [r.split("\t") for r in rows[1:9]]
    text_col = header.index("text")
    lines = ["\t".join(header)]
    for r in body:
        r[0] = str(speech_corpus / r[0])
        r[text_col] = " ".join([r[text_col]] * 40)
        lines.append("\t".join(r))
    (tmp_path / "long.tsv").write_text("\n".join(lines) + "\n")
    pack(PackConfig(input=str(tmp_path / "long.tsv"), output=str(tmp_path / "ds"), max_chars_per_s=0,
                    progress=False))
    with pytest.raises(TrainingHalted, match="transcripts too long for their audio"):
        run(str(tmp_path / "ds"), tmp_path / "run", 40)


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
