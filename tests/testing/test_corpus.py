"""testing/corpus.py: generated tone corpora and speech-like waves other tests rely on: lengths, levels, transcripts,
manifests, codecs, byte determinism."""
from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf

from conftest import TONE_DURATIONS_S, read_tsv
from shardtrain.testing.corpus import make_corpus, librispeech_text, synth_wave


def test_synth_wave_length_level_and_determinism():
    w = synth_wave(1.2345, 16000, seed=3)
    assert w.dtype == np.float32 and w.shape == (19752,)
    assert 0.2 < np.abs(w).max() < 0.4
    assert np.array_equal(w, synth_wave(1.2345, 16000, seed=3))
    assert not np.array_equal(w, synth_wave(1.2345, 16000, seed=4))
    assert synth_wave(0.0).shape == (0,)
    with pytest.raises(ValueError, match="duration_s"):
        synth_wave(-1.0)


def test_normalize_text_librispeech_style():
    assert librispeech_text("Don't stop -- it's 'quoted', OK?\n") == "DON'T STOP IT'S QUOTED OK"


def test_tone_corpus_durations_transcripts_manifests(tone_corpus):
    rows = read_tsv(tone_corpus / "manifest.tsv")
    assert [r["path"] for r in rows] == [f"utt-{i:05d}.flac" for i in range(len(TONE_DURATIONS_S))]
    for r, d in zip(rows, TONE_DURATIONS_S):
        info = sf.info(tone_corpus / r["path"])
        assert (info.samplerate, info.channels, info.frames) == (16000, 1, round(d * 16000))
        assert (tone_corpus / r["path"]).with_suffix(".txt").read_text().strip() == r["text"]
        assert r["text"] == librispeech_text(r["text"]) and len(r["text"].split()) >= 3
    jsonl = [json.loads(line) for line in (tone_corpus / "manifest.jsonl").read_text().splitlines()]
    assert jsonl == rows


def test_make_corpus_is_byte_deterministic(tmp_path, tone_corpus):
    again = make_corpus(tmp_path / "again", TONE_DURATIONS_S[:4], seed=0)
    for i in range(4):
        name = f"utt-{i:05d}.flac"
        assert (again / name).read_bytes() == (tone_corpus / name).read_bytes()
    other = make_corpus(tmp_path / "other", TONE_DURATIONS_S[:1], seed=1)
    assert (other / "utt-00000.flac").read_bytes() != (tone_corpus / "utt-00000.flac").read_bytes()


@pytest.mark.parametrize("fmt, ext", [("wav", "wav"), ("opus", "opus"), ("mp3", "mp3")])
def test_make_corpus_codecs_and_channels(tmp_path, fmt, ext):
    root = make_corpus(tmp_path, [0.5, 1.5], fmt=fmt, channels=2, text_fn=lambda i: f"WORD {i}")
    for i, d in enumerate([0.5, 1.5]):
        wave, rate = sf.read(root / f"utt-{i:05d}.{ext}", dtype="float32")
        assert rate == 16000 and wave.shape[1] == 2
        assert abs(len(wave) / rate - d) < 0.08  # lossy codecs add/strip a few ms of padding
        assert 0.1 < np.abs(wave).max() < 0.6
        assert (root / f"utt-{i:05d}.txt").read_text() == f"WORD {i}\n"


def test_make_corpus_rejects_bad_options(tmp_path):
    with pytest.raises(ValueError, match="fmt"):
        make_corpus(tmp_path, [1.0], fmt="aac")
    with pytest.raises(ValueError, match="sample_rate_hz"):
        make_corpus(tmp_path, [1.0], fmt="opus", sample_rate_hz=22050)
