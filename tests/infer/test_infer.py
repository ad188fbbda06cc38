"""Inference on what `train` wrote: edit distance, transcribe, evaluate, ONNX export + int8, QAT, BiLSTM.

Every model here is trained in the test by the real trainer (tiny_cpu preset made smaller, a few dozen steps on
6 espeak-ng utterances packed with the real packer), and every utterance is real audio encoded and decoded.
The float model overfits its 6 utterances (CER ~0 there), so transcripts are meaningful and an export that
changed the numerics would change them.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from pipelines import load_pipeline
from shardtrain.cli import main
from shardtrain.infer.checkpoint_model import CheckpointError, find_checkpoint, load_trained
from shardtrain.infer.export import OnnxRecognizer, export_onnx
from shardtrain.infer.score import Score
from shardtrain.infer.transcribe import TranscribeConfig, group_files, transcribe
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.train.loop import train
from shardtrain.train.model import CTCModel
from shardtrain.train.overrides import apply_overrides
from shardtrain.world import World
from conftest import pack_subset

SMALL = ["model.d_model=96", "model.num_layers=2", "model.dropout=0", "train.augment=false", "train.lr=3e-3",
         "train.warmup_steps=20", "stream.bucket.max_batch_seconds=30", "stream.bucket.num_buckets=1",
         "train.tensorboard=false", "train.progress=false", "train.cpu_threads=1", "train.val_every_steps=0",
         "train.log_every_steps=20"]
TRAIN_UTTS = 6


def _train(data: str, out: Path, steps: int, *overrides: str, pipeline: str = "tiny_cpu") -> Path:
    cfg = apply_overrides(load_pipeline(pipeline), SMALL + [f"train.data_url={data}", f"train.out_dir={out}",
                                                           f"train.max_steps={steps}", *overrides])
    train(cfg, World())
    return out


@pytest.fixture(scope="module")
def data(speech_corpus, tmp_path_factory) -> str:
    return pack_subset(speech_corpus, tmp_path_factory.mktemp("infer_data"), TRAIN_UTTS)


@pytest.fixture(scope="module")
def run_dir(data, tmp_path_factory) -> Path:
    return _train(data, tmp_path_factory.mktemp("infer_run"), 80, "train.ckpt_every_steps=40")


@pytest.fixture(scope="module")
def utterances(speech_corpus) -> list[tuple[str, np.ndarray, str]]:
    """(key, float32 wave, reference) of all 20 corpus files, decoded from FLAC."""
    out = []
    for line in (speech_corpus / "manifest.tsv").read_text().splitlines()[1:]:
        path, text, _ = line.split("\t")
        wave, rate = sf.read(speech_corpus / path, dtype="float32")
        assert rate == 16000
        out.append((Path(path).stem, wave, text))
    return out


def _batch(waves: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.nn.utils.rnn.pad_sequence([torch.from_numpy(w) for w in waves], batch_first=True),
            torch.tensor([len(w) for w in waves]))


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


def test_checkpoint_resolution(run_dir, tmp_path):
    assert find_checkpoint(run_dir).name == "step_000080"
    assert find_checkpoint(run_dir / "checkpoints" / "step_000040").name == "step_000040"
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        find_checkpoint(tmp_path)


def test_transcribe_cli_on_dataset_and_folder(run_dir, data, speech_corpus, tmp_path, capsys):
    out = tmp_path / "hyp.jsonl"
    folder = tmp_path / "files"  # a folder of plain audio files with LibriSpeech .trans.txt references
    shutil.copytree(speech_corpus, folder, ignore=shutil.ignore_patterns("manifest.*"))
    (folder / "broken.flac").write_bytes(b"fLaC not really")
    rc = main(["transcribe", str(run_dir), data, str(folder), "--out", str(out), "--device", "cpu",
               "--max-batch-seconds", "20", "--no-progress"])
    assert rc == 1  # the broken file is skipped, named, and makes the exit code non-zero
    err = capsys.readouterr().err
    assert "broken.flac" in err and "1 inputs skipped" in err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    failed = [r for r in rows if "error" in r]  # the failure is a row of the output too
    assert [r["key"] for r in failed] == ["broken"] and failed[0]["error"].startswith("unreadable_audio")
    rows = [r for r in rows if "error" not in r]
    from_data = [r for r in rows if r["source"] == data]
    from_files = [r for r in rows if r["source"] == str(folder)]
    assert len(from_data) == TRAIN_UTTS and len(from_files) == 20
    assert all(r["reference"] and r["duration_s"] > 0.5 for r in rows)
    assert sum(r["cer"] for r in from_data) / TRAIN_UTTS < 0.05  # the utterances it was trained on
    by_key = {r["key"]: r for r in from_files}  # the same audio through the file path gives the same text
    for r in from_data:
        assert by_key[r["key"].rsplit("_", 1)[-1]]["text"] == r["text"]


def test_evaluate_cli_json_and_markdown(run_dir, data, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["evaluate", str(run_dir), "--data", data, "--out", str(out), "--worst", "3",
                 "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| dataset | utterances | CER %") and data in table
    res = json.loads(out.read_text())["datasets"][data]
    assert res["utterances"] == TRAIN_UTTS and res["cer"] < 0.05
    c = res["chars"]
    assert c["errors"] == c["sub"] + c["ins"] + c["del"] and res["cer"] == pytest.approx(c["errors"] / c["ref"])
    assert main(["evaluate", str(tmp_path), "--data", data]) == 2  # not a run dir: a clear error, not a traceback
    empty = tmp_path / "not_a_dataset"
    empty.mkdir()
    assert main(["transcribe", str(run_dir), str(empty), "--no-progress"]) == 2  # nothing to read: refused
    assert "no manifest.json" in capsys.readouterr().err


@pytest.mark.slow  # a long run (15-25 s on 2 busy cores): the full suite, not the fast tier
def test_onnx_export_matches_pytorch_and_int8_transcribes(run_dir, utterances, tmp_path, capsys):
    tm = load_trained(run_dir)
    assert main(["export", str(run_dir), str(tmp_path / "m.onnx"), "--quantize", "int8"]) == 0
    assert "m.int8.onnx" in capsys.readouterr().out
    path, qpath = tmp_path / "m.onnx", tmp_path / "m.int8.onnx"
    fp32, int8 = OnnxRecognizer(path), OnnxRecognizer(qpath)
    waves, lengths = _batch([w for _, w, _ in utterances])
    ref_lp, ref_len = tm.log_probs(waves, lengths, 16000)
    lp, ol = fp32.log_probs(waves, lengths, 16000)
    assert np.array_equal(ol, ref_len.numpy())
    valid = torch.arange(lp.shape[1])[None, :] < ref_len[:, None]
    diff = (torch.from_numpy(lp) - ref_lp).abs()[valid]
    assert float(diff.max()) < 1e-3  # stated tolerance: 1e-3 absolute on log-probs (typically ~1e-5)
    assert fp32.transcribe(waves, lengths, 16000) == tm.transcribe(waves, lengths, 16000)
    one = fp32.transcribe(*_batch([utterances[3][1]]), 16000)  # batch 1 and another width: same answer
    assert one == [tm.transcribe(waves, lengths, 16000)[3]]
    # int8: on the 6 training utterances, CER stays within 0.05 absolute of the float model
    train_refs = [t for _, _, t in utterances[:TRAIN_UTTS]]
    w6, l6 = _batch([w for _, w, _ in utterances[:TRAIN_UTTS]])
    cer = {}
    for name, rec in (("fp32", fp32), ("int8", int8)):
        s = Score(normalizer=tm.tokenizer.normalizer)  # the model's normaliser (pipeline: lower case)
        for ref, hyp in zip(train_refs, rec.transcribe(w6, l6, 16000)):
            s.add("u", ref, hyp)
        cer[name] = s.summary()["cer"]
    assert cer["int8"] <= cer["fp32"] + 0.05, cer
    assert qpath.stat().st_size < 0.6 * path.stat().st_size
    assert not Path(str(path) + ".data").exists()  # one self-contained file


@pytest.mark.slow
def test_qat_model_exports_to_int8_within_margin(data, utterances, tmp_path):
    run = _train(data, tmp_path / "qat", 80, "train.qat=true")
    tm = load_trained(run)
    assert type(tm.model.head).__name__ == "QATLinear" and tm.config.train.qat
    res = export_onnx(tm, tmp_path / "q.onnx", quantize="int8")
    w6, l6 = _batch([w for _, w, _ in utterances[:TRAIN_UTTS]])
    refs = [t for _, _, t in utterances[:TRAIN_UTTS]]
    cer = {}
    for name, rec in (("torch_qat", tm), ("fp32", OnnxRecognizer(res.path)), ("int8", OnnxRecognizer(res.quantized_path))):
        s = Score(normalizer=tm.tokenizer.normalizer)  # the model's normaliser (pipeline: lower case)
        for ref, hyp in zip(refs, rec.transcribe(w6, l6, 16000)):
            s.add("u", ref, hyp)
        cer[name] = s.summary()["cer"]
    assert cer["fp32"] < 0.1, cer  # QAT still learns the utterances
    assert cer["int8"] <= cer["fp32"] + 0.02, cer  # stated margin: 2 points of CER


def test_bilstm_preset_trains_and_is_batch_independent(data, utterances, tmp_path):
    run = _train(data, tmp_path / "lstm", 4, "model.d_model=64", "model.num_layers=1", pipeline="tiny_bilstm")
    tm = load_trained(run)
    assert tm.config.model.encoder == "bilstm" and isinstance(tm.model, CTCModel)
    waves, lengths = _batch([w for _, w, _ in utterances[:4]])
    lp, ol = tm.log_probs(waves, lengths, 16000)
    alone, ol1 = tm.log_probs(*_batch([utterances[2][1]]), 16000)  # shorter than the batch: padding never leaks
    assert ol1[0] == ol[2]
    assert torch.allclose(lp[2, : ol[2]], alone[0, : ol1[0]], atol=1e-5)
    rows, errors = transcribe(tm, [data], TranscribeConfig(progress=False))
    assert len(rows) == TRAIN_UTTS and not errors


@pytest.mark.s3
def test_transcribe_reads_a_dataset_on_s3(run_dir, speech_corpus, s3, s3_bucket, tmp_path):
    rows = (speech_corpus / "manifest.tsv").read_text().splitlines()
    tsv = tmp_path / "subset.tsv"
    tsv.write_text("\n".join([rows[0]] + [str(speech_corpus / r.split("\t")[0]) + "\t" + r.split("\t", 1)[1]
                                          for r in rows[1 : TRAIN_UTTS + 1]]) + "\n")
    url = f"{s3_bucket}/val"
    pack(PackConfig(input=str(tsv), output=url, storage_options=s3.storage_options, progress=False))
    tm = load_trained(run_dir)
    got, errors = transcribe(tm, [url], TranscribeConfig(progress=False, storage_options=s3.storage_options))
    assert not errors and len(got) == TRAIN_UTTS and all(r["source"] == url for r in got)
    assert sum(r["cer"] for r in got) / TRAIN_UTTS < 0.05
