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
import soundfile as sf

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
