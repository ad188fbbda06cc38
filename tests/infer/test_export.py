"""infer/export.py: ONNX export of what `train` wrote matches PyTorch (log-probs within 1e-3, the same transcripts
at any batch width), int8 quantisation stays within its stated CER margin, and a QAT-trained model exports to int8
within 2 points. The float model is conftest's overfit_run (CER ~0 on its 6 utterances), so an export that changed
the numerics would change the transcripts; every utterance is real espeak-ng audio."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import pad_waves as _batch, train_small
from shardtrain.cli import main
from shardtrain.infer.checkpoint_model import load_trained
from shardtrain.infer.export import OnnxRecognizer, export_onnx
from shardtrain.infer.score import Score

TRAIN_UTTS = 6


@pytest.mark.slow  # a long run (15-25 s on 2 busy cores): the full suite, not the fast tier
def test_onnx_export_matches_pytorch_and_int8_transcribes(overfit_dir, speech_utterances, tmp_path, capsys):
    tm = load_trained(overfit_dir)
    assert main(["export", str(overfit_dir), str(tmp_path / "m.onnx"), "--quantize", "int8"]) == 0
    assert "m.int8.onnx" in capsys.readouterr().out
    path, qpath = tmp_path / "m.onnx", tmp_path / "m.int8.onnx"
    fp32, int8 = OnnxRecognizer(path), OnnxRecognizer(qpath)
    waves, lengths = _batch([w for _, w, _ in speech_utterances])
    ref_lp, ref_len = tm.log_probs(waves, lengths, 16000)
    lp, ol = fp32.log_probs(waves, lengths, 16000)
    assert np.array_equal(ol, ref_len.numpy())
    valid = torch.arange(lp.shape[1])[None, :] < ref_len[:, None]
    diff = (torch.from_numpy(lp) - ref_lp).abs()[valid]
    assert float(diff.max()) < 1e-3  # stated tolerance: 1e-3 absolute on log-probs (typically ~1e-5)
    assert fp32.transcribe(waves, lengths, 16000) == tm.transcribe(waves, lengths, 16000)
    one = fp32.transcribe(*_batch([speech_utterances[3][1]]), 16000)  # batch 1 and another width: same answer
    assert one == [tm.transcribe(waves, lengths, 16000)[3]]
    # int8: on the 6 training utterances, CER stays within 0.05 absolute of the float model
    train_refs = [t for _, _, t in speech_utterances[:TRAIN_UTTS]]
    w6, l6 = _batch([w for _, w, _ in speech_utterances[:TRAIN_UTTS]])
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
def test_qat_model_exports_to_int8_within_margin(six_utts, speech_utterances, tmp_path):
    run = tmp_path / "qat"
    train_small(six_utts, run, 80, "train.log_every_steps=20", "train.qat=true")
    tm = load_trained(run)
    assert type(tm.model.head).__name__ == "QATLinear" and tm.config.train.qat
    res = export_onnx(tm, tmp_path / "q.onnx", quantize="int8")
    w6, l6 = _batch([w for _, w, _ in speech_utterances[:TRAIN_UTTS]])
    refs = [t for _, _, t in speech_utterances[:TRAIN_UTTS]]
    cer = {}
    for name, rec in (("torch_qat", tm), ("fp32", OnnxRecognizer(res.path)), ("int8", OnnxRecognizer(res.quantized_path))):
        s = Score(normalizer=tm.tokenizer.normalizer)  # the model's normaliser (pipeline: lower case)
        for ref, hyp in zip(refs, rec.transcribe(w6, l6, 16000)):
            s.add("u", ref, hyp)
        cer[name] = s.summary()["cer"]
    assert cer["fp32"] < 0.1, cer  # QAT still learns the utterances
    assert cer["int8"] <= cer["fp32"] + 0.02, cer  # stated margin: 2 points of CER
