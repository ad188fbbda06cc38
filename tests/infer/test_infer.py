"""Inference on what `train` wrote: scoring, transcribe, evaluate, checkpoint resolution, BiLSTM.

The model is conftest's overfit_run (the real trainer, tiny_cpu made smaller, 100 steps on the 6 espeak-ng
utterances of six_utts packed with the real packer); every utterance is real audio encoded and decoded. It
overfits its 6 utterances (CER ~0 there), so transcripts are meaningful. (ONNX export and int8: test_export.py.)
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import pad_waves as _batch, train_small
from shardtrain.cli import main
from shardtrain.infer.checkpoint_model import CheckpointError, find_checkpoint, load_trained
from shardtrain.infer.score import Score
from shardtrain.infer.transcribe import TranscribeConfig, group_files, transcribe
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.train.model import CTCModel

TRAIN_UTTS = 6


def test_score_sums_edits_and_ranks_worst():
    s = Score(worst_n=1)
    s.add("a", "AB CD", "AB CD")
    s.add("b", "AB CD", "AX CD E")  # 1 sub + 2 ins chars; 1 sub + 1 ins words
    s.add("c", None, "whatever")
    out = s.summary()
    assert out["chars"] == {"sub": 1, "ins": 2, "del": 0, "ref": 10, "errors": 3} and out["cer"] == 0.3
    assert out["words"]["errors"] == 2 and out["wer"] == 0.5 and out["unscored"] == 1
    assert [w["key"] for w in out["worst"]] == ["b"]


def test_file_batches_are_cut_by_padded_duration():
    from shardtrain.infer.transcribe import _File

    files = [_File(path=Path(f"{i}.flac"), duration_s=d, rate_hz=16000) for i, d in enumerate([5, 1, 2, 9, 3])]
    files.append(_File(path=Path("x.wav"), duration_s=1.0, rate_hz=8000))
    groups = group_files(files, 6.0)
    # padded cost = longest x count: [1, 2] costs 4, adding 3 would cost 9 > 6
    assert [[f.duration_s for f in b] for b in groups] == [[1.0], [1, 2], [3], [5], [9]]  # 8 kHz first, alone


def test_checkpoint_resolution(overfit_dir, tmp_path):
    assert find_checkpoint(overfit_dir).name == "step_000100"  # the newest of checkpoints 50 and 100
    assert find_checkpoint(overfit_dir / "checkpoints" / "step_000050").name == "step_000050"
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        find_checkpoint(tmp_path)


def test_transcribe_cli_on_dataset_and_folder(overfit_dir, six_utts, speech_corpus, tmp_path, capsys):
    out = tmp_path / "hyp.jsonl"
    folder = tmp_path / "files"  # a folder of plain audio files with LibriSpeech .trans.txt references
    shutil.copytree(speech_corpus, folder, ignore=shutil.ignore_patterns("manifest.*"))
    (folder / "broken.flac").write_bytes(b"fLaC not really")
    rc = main(["transcribe", str(overfit_dir), six_utts, str(folder), "--out", str(out), "--device", "cpu",
               "--max-batch-seconds", "20", "--no-progress"])
    assert rc == 1  # the broken file is skipped, named, and makes the exit code non-zero
    err = capsys.readouterr().err
    assert "broken.flac" in err and "1 inputs skipped" in err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    failed = [r for r in rows if "error" in r]  # the failure is a row of the output too
    assert [r["key"] for r in failed] == ["broken"] and failed[0]["error"].startswith("unreadable_audio")
    rows = [r for r in rows if "error" not in r]
    from_data = [r for r in rows if r["source"] == six_utts]
    from_files = [r for r in rows if r["source"] == str(folder)]
    assert len(from_data) == TRAIN_UTTS and len(from_files) == 20
    assert all(r["reference"] and r["duration_s"] > 0.5 for r in rows)
    assert sum(r["cer"] for r in from_data) / TRAIN_UTTS < 0.05  # the utterances it was trained on
    by_key = {r["key"]: r for r in from_files}  # the same audio through the file path gives the same text
    for r in from_data:
        assert by_key[r["key"].rsplit("_", 1)[-1]]["text"] == r["text"]


def test_evaluate_cli_json_and_markdown(overfit_dir, six_utts, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["evaluate", str(overfit_dir), "--data", six_utts, "--out", str(out), "--worst", "3",
                 "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| dataset | utterances | CER %") and six_utts in table
    res = json.loads(out.read_text())["datasets"][six_utts]
    assert res["utterances"] == TRAIN_UTTS and res["cer"] < 0.05
    c = res["chars"]
    assert c["errors"] == c["sub"] + c["ins"] + c["del"] and res["cer"] == pytest.approx(c["errors"] / c["ref"])
    assert main(["evaluate", str(tmp_path), "--data", six_utts]) == 2  # not a run dir: a clear error, not a traceback
    empty = tmp_path / "not_a_dataset"
    empty.mkdir()
    assert main(["transcribe", str(overfit_dir), str(empty), "--no-progress"]) == 2  # nothing to read: refused
    assert "no manifest.json" in capsys.readouterr().err


def test_bilstm_preset_trains_and_is_batch_independent(six_utts, speech_utterances, tmp_path):
    run = tmp_path / "lstm"
    train_small(six_utts, run, 4, "train.log_every_steps=20", "model.d_model=64", "model.num_layers=1",
                pipeline="tiny_bilstm")
    tm = load_trained(run)
    assert tm.config.model.encoder == "bilstm" and isinstance(tm.model, CTCModel)
    waves, lengths = _batch([w for _, w, _ in speech_utterances[:4]])
    lp, ol = tm.log_probs(waves, lengths, 16000)
    alone, ol1 = tm.log_probs(*_batch([speech_utterances[2][1]]), 16000)  # shorter than the batch: padding never leaks
    assert ol1[0] == ol[2]
    assert torch.allclose(lp[2, : ol[2]], alone[0, : ol1[0]], atol=1e-5)
    rows, errors = transcribe(tm, [six_utts], TranscribeConfig(progress=False))
    assert len(rows) == TRAIN_UTTS and not errors


@pytest.mark.s3
def test_transcribe_reads_a_dataset_on_s3(overfit_dir, speech_corpus, s3, s3_bucket, tmp_path):
    rows = (speech_corpus / "manifest.tsv").read_text().splitlines()
    tsv = tmp_path / "subset.tsv"
    tsv.write_text("\n".join([rows[0]] + [str(speech_corpus / r.split("\t")[0]) + "\t" + r.split("\t", 1)[1]
                                          for r in rows[1 : TRAIN_UTTS + 1]]) + "\n")
    url = f"{s3_bucket}/val"
    pack(PackConfig(input=str(tsv), output=url, storage_options=s3.storage_options, progress=False))
    tm = load_trained(overfit_dir)
    got, errors = transcribe(tm, [url], TranscribeConfig(progress=False, storage_options=s3.storage_options))
    assert not errors and len(got) == TRAIN_UTTS and all(r["source"] == url for r in got)
    assert sum(r["cer"] for r in got) / TRAIN_UTTS < 0.05
