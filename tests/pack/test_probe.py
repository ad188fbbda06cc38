"""Valid MP3s with ID3v2 tags pack without libmpg123's "error:" lines (a COMM or TXXX frame without a description
makes libmpg123 print them from inside libsndfile); the audio is the same as the untagged file's, and a broken
MP3 is still rejected with its reason. Real MP3s (encoded by libsndfile/LAME), the real CLI in a subprocess (the
lines go to fd 2, below Python)."""
from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from shardtrain.format.audio import AudioError
from shardtrain.pack.probe import id3v2_bytes, open_audio, probe

ROOT = Path(__file__).resolve().parents[2]


def _id3v2(*frames: tuple[bytes, bytes]) -> bytes:
    body = b"".join(fid + struct.pack(">I", len(data)) + b"\x00\x00" + data for fid, data in frames)
    n = len(body)
    return b"ID3\x03\x00\x00" + bytes([(n >> 21) & 0x7F, (n >> 14) & 0x7F, (n >> 7) & 0x7F, n & 0x7F]) + body


def _mp3(seconds: float, seed: int) -> bytes:
    b = io.BytesIO()
    x = 0.2 * np.sin(np.arange(int(16000 * seconds)) * (0.05 + seed / 100)).astype("float32")
    sf.write(b, x, 16000, format="MP3")
    return b.getvalue()


def test_tagged_mp3s_pack_quietly_and_a_broken_one_is_still_named(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    tag = _id3v2((b"COMM", b"\x00eng\x00"), (b"TXXX", b"\x00"), (b"TIT2", b"\x00Title"))
    plain = _mp3(1.0, 0)
    for i in range(2):
        (src / f"t{i}.mp3").write_bytes(tag + _mp3(1.0 + i / 2, i))
        (src / f"t{i}.txt").write_text("hello world")
    (src / "bad.mp3").write_bytes(tag + os.urandom(4000))  # a tag, then no MPEG frame at all
    (src / "bad.txt").write_text("broken")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "shardtrain", "pack", str(src), str(tmp_path / "ds"), "--workers", "1",
                        "--no-progress"], capture_output=True, text=True, env=env, timeout=300)
    assert "error:" not in p.stderr, p.stderr[-3000:]
    manifest = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest["totals"]["samples"] == 2, manifest["totals"]
    rejects = (tmp_path / "ds" / "rejects.jsonl").read_text()
    assert "bad.mp3" in rejects and "t0.mp3" not in rejects, rejects

    (tmp_path / "tagged.mp3").write_bytes(tag + plain)
    (tmp_path / "plain.mp3").write_bytes(plain)
    assert id3v2_bytes(tag) == len(tag) and id3v2_bytes(plain) == 0
    with open_audio(str(tmp_path / "tagged.mp3"), None) as f:
        tagged_pcm = sf.read(f, dtype="int16")[0]
    assert np.array_equal(tagged_pcm, sf.read(tmp_path / "plain.mp3", dtype="int16")[0])  # the same samples
    assert probe(str(tmp_path / "tagged.mp3")).num_samples == probe(str(tmp_path / "plain.mp3")).num_samples


def _wav(subtype: str, frames: int = 8000, channels: int = 1) -> bytes:
    b = io.BytesIO()
    x = 0.3 * np.sin(np.arange(frames * channels) * 0.01).reshape(frames, channels)
    sf.write(b, x, 16000, format="WAV", subtype=subtype)
    return b.getvalue()


def test_a_wav_cut_short_is_truncated_not_a_shorter_file(tmp_path):
    """libsndfile opens a WAV missing the end of its data chunk as a shorter valid file (its frames = the bytes
    present): packed, half the audio would carry the whole transcript. The data chunk's declared size exposes it,
    for a local file and for a byte range (a Kaldi ark entry, Arrow bytes); a whole file, a data size a few bytes
    off (a writer's miscount) and a streaming writer's placeholder size (0xFFFFFFFF) pass."""
    for subtype, channels in (("PCM_16", 1), ("PCM_24", 2), ("FLOAT", 1), ("PCM_U8", 1)):
        whole = _wav(subtype, channels=channels)
        (tmp_path / "whole.wav").write_bytes(whole)
        assert probe(str(tmp_path / "whole.wav")).num_samples == 8000
        (tmp_path / "cut.wav").write_bytes(whole[:len(whole) // 2])
        with pytest.raises(AudioError) as e:
            probe(str(tmp_path / "cut.wav"))
        assert e.value.reason == "truncated_audio" and "declares 8000 samples" in str(e.value), (subtype, e.value)
        (tmp_path / "ark").write_bytes(b"pad" + whole[:len(whole) - 2048])
        with pytest.raises(AudioError):
            probe(f"{tmp_path / 'ark'}#bytes=3-{3 + len(whole) - 2048}")
    miscounted = bytearray(_wav("PCM_16"))  # a writer that counted the 44-byte header into the data size
    miscounted[40:44] = (int.from_bytes(miscounted[40:44], "little") + 44).to_bytes(4, "little")
    (tmp_path / "miscounted.wav").write_bytes(bytes(miscounted))
    assert probe(str(tmp_path / "miscounted.wav")).num_samples == 8000
    streamed = bytearray(_wav("PCM_16"))
    streamed[4:8] = streamed[40:44] = b"\xff\xff\xff\xff"  # RIFF and data sizes as ffmpeg writes them to a pipe
    assert streamed[36:40] == b"data"
    (tmp_path / "streamed.wav").write_bytes(bytes(streamed))
    assert probe(str(tmp_path / "streamed.wav")).num_samples == 8000
