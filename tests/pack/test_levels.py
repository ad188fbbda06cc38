"""Every sample format reaches the batch at its true level, and non-finite audio never reaches it.

Real files written with soundfile in each sample format (float32/float64, 8/16/24/32-bit PCM WAV, 16/24-bit FLAC)
holding one sine at -9 dBFS RMS, packed by the real packer (transcoded, and kept as they are with
--keep-original), read back by the real loader in float32 and int16: the RMS of what arrives must match the
source's within 0.1 dB. A float WAV once arrived ~92 dB quieter (libsndfile reads floats as integers by rounding).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from shardtrain.format.manifest import open_dataset
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.world import World

RATE = 16000
FORMATS = [("wav", "FLOAT"), ("wav", "DOUBLE"), ("wav", "PCM_U8"), ("wav", "PCM_16"), ("wav", "PCM_24"),
           ("wav", "PCM_32"), ("flac", "PCM_16"), ("flac", "PCM_24")]


def sine(seconds: float = 1.0, amplitude: float = 0.5, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float64)


def rms_db(x: np.ndarray) -> float:
    return 20 * np.log10(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


def write_corpus(root: Path, waves: dict[str, tuple[np.ndarray, str, str]]) -> Path:
    """A folder corpus: <key>.<ext> + <key>.txt per item; returns the folder."""
    root.mkdir(parents=True, exist_ok=True)
    for key, (x, ext, subtype) in waves.items():
        sf.write(root / f"{key}.{ext}", x, RATE, subtype=subtype, format=ext.upper())
        (root / f"{key}.txt").write_text("a tone")
    return root


def loaded_levels(url: str, dtype: str) -> dict[str, float]:
    cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=4.0), pcm_dtype=dtype, max_skipped_share=1.0)
    out = {}
    for batch, _ in build_loader(url, world=World(), seed=0, cfg=cfg):
        for i, key in enumerate(batch.keys):
            x = batch.waves[i, : int(batch.lengths[i])].double().numpy()
            out[key] = rms_db(x / 32768.0 if dtype == "int16" else x)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    x = sine()
    return write_corpus(tmp_path_factory.mktemp("levels") / "corpus",
                        {f"{ext}_{sub.lower()}": (x, ext, sub) for ext, sub in FORMATS})


@pytest.mark.parametrize("keep", [False, True], ids=["transcoded", "kept"])
def test_every_sample_format_arrives_at_its_true_level(corpus, tmp_path, keep):
    out = tmp_path / "ds"
    r = pack(PackConfig(input=str(corpus), output=str(out), keep_original=keep, workers=1, progress=False))
    assert r.samples == len(FORMATS) and not r.rejects_by_reason
    want = rms_db(sine())
    for dtype in ("float32", "int16"):
        got = loaded_levels(str(out), dtype)
        assert sorted(got) == sorted(f"{e}_{s.lower()}" for e, s in FORMATS)
        for key, level in got.items():
            tol = 0.3 if key.endswith("pcm_u8") else 0.1  # 8 bits: quantisation noise at -9 dBFS is ~0.01 dB
            assert abs(level - want) < tol, f"{key} ({dtype}, {'kept' if keep else 'transcoded'}): " \
                                            f"{level:.2f} dB against {want:.2f} dB"


def test_float_audio_past_full_scale_clips_and_says_so(tmp_path, caplog):
    corpus = write_corpus(tmp_path / "c", {"loud": (sine(amplitude=1.5), "wav", "FLOAT")})
    with caplog.at_level("WARNING", logger="shardtrain.pack.transcode"):
        r = pack(PackConfig(input=str(corpus), output=str(tmp_path / "ds"), workers=1, progress=False))
    assert r.samples == 1
    assert any("past full scale" in m and "loud" in m for m in caplog.messages), caplog.messages
    got = loaded_levels(str(tmp_path / "ds"), "float32")["loud"]
    assert got < rms_db(sine(amplitude=1.5)) and got > rms_db(sine(amplitude=1.0)) - 0.1


@pytest.mark.parametrize("keep", [False, True], ids=["transcoded", "kept"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_audio_is_a_reject_with_its_key(tmp_path, keep, bad):
    x = sine()
    x[100:110] = bad
    corpus = write_corpus(tmp_path / "c", {"good": (sine(), "wav", "FLOAT"), "broken": (x, "wav", "FLOAT")})
    out = tmp_path / "ds"
    r = pack(PackConfig(input=str(corpus), output=str(out), keep_original=keep, workers=1, progress=False))
    assert r.samples == 1 and r.rejects_by_reason == {"non_finite_audio": 1}
    keys = open_dataset(str(out)).read_index(columns=["key"]).column("key").to_pylist()
    assert keys == ["good"]


@pytest.mark.parametrize("dtype", ["float32", "int16"])
def test_loader_skips_and_counts_a_stored_float_member_holding_nan(tmp_path, dtype):
    """A shard written elsewhere (or before this check) with a NaN float WAV: a counted skip with its key."""
    corpus = write_corpus(tmp_path / "c", {"a": (sine(), "wav", "FLOAT"), "b": (sine(0.9), "wav", "FLOAT")})
    out = tmp_path / "ds"
    pack(PackConfig(input=str(corpus), output=str(out), keep_original=True, workers=1, progress=False))
    ds = open_dataset(str(out))
    t = ds.read_index(columns=["key", "shard", "audio_offset", "audio_size"]).to_pylist()
    row = next(r for r in t if r["key"] == "b")
    shard = next(p for p in sorted(out.glob("shard-*.tar")))
    data = bytearray(shard.read_bytes())
    member = bytes(data[row["audio_offset"]: row["audio_offset"] + row["audio_size"]])
    x, _ = sf.read(__import__("io").BytesIO(member), dtype="float32")
    head = len(member) - x.nbytes  # the WAV header; samples follow as little-endian float32
    x[50] = np.nan
    data[row["audio_offset"] + head: row["audio_offset"] + row["audio_size"]] = x.astype("<f4").tobytes()
    shard.write_bytes(bytes(data))
    cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=4.0), pcm_dtype=dtype, max_skipped_share=1.0)
    loader = build_loader(str(out), world=World(), seed=0, cfg=cfg)
    keys = [k for batch, _ in loader for k in batch.keys]
    assert keys == ["a"]
    assert loader.counters["skipped"] == 1
    assert loader.skipped_keys[0]["key"] == "b" and "non_finite_audio" in json.dumps(loader.skipped_keys[0])
