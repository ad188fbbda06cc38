"""Every sample format reaches the batch at its true level; non-finite audio, CTC-impossible targets and rows a
reader would refuse are per-item rejects (issue 29, design invariant 14).

Real files written with soundfile (WAV float32/float64/PCM_U8/16/24/32, FLAC 16/24, AIFF float), packed by the real
packer, checked by `inspect --verify` and read by the real loader in int16 and float32. Levels are compared as RMS
in dB against the source file's own samples, within 0.1 dB (16-bit quantisation of a -20 dBFS signal is ~0.001 dB;
the bug this guards against was 91-93 dB).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from shardtrain import cli
from shardtrain.format import indexread, limits
from shardtrain.format.manifest import open_dataset
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.pack.packer import AudioTarget, PackConfig, pack
from shardtrain.pack.verify import verify
from shardtrain.world import World

RATE = 16000
FORMATS = [  # (id, container, subtype, extension)
    ("wav_f32", "WAV", "FLOAT", "wav"), ("wav_f64", "WAV", "DOUBLE", "wav"), ("wav_u8", "WAV", "PCM_U8", "wav"),
    ("wav_16", "WAV", "PCM_16", "wav"), ("wav_24", "WAV", "PCM_24", "wav"), ("wav_32", "WAV", "PCM_32", "wav"),
    ("flac_16", "FLAC", "PCM_16", "flac"), ("flac_24", "FLAC", "PCM_24", "flac"), ("aiff_f32", "AIFF", "FLOAT", "aiff"),
]


def _signal(seconds: float, rate: int = RATE, channels: int = 1, seed: int = 0) -> np.ndarray:
    """Speech-like test signal around -20 dBFS: two tones under a slow envelope plus a little noise."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2
    x = env * (0.08 * np.sin(2 * np.pi * 220 * t) + 0.05 * np.sin(2 * np.pi * 1330 * t)) + 0.005 * rng.standard_normal(len(t))
    return x if channels == 1 else np.stack([x] * channels, axis=1)


def _db(x) -> float:
    x = np.asarray(x, np.float64)
    return 10 * math.log10(float(np.mean(x * x)))


def _write(root: Path, key: str, x: np.ndarray, fmt: str, subtype: str, ext: str, rate: int = RATE,
           text: str = "a short sentence") -> Path:
    path = root / f"{key}.{ext}"
    sf.write(path, x, rate, format=fmt, subtype=subtype)
    (root / f"{key}.txt").write_text(text)
    return path


def _pack(src: Path, out: Path, **kw):
    return pack(PackConfig(input=str(src), output=str(out), progress=False, workers=1, **kw))


def _rejects(out: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (out / "rejects.jsonl").read_text().splitlines())}


def _load(url: Path, dtype: str) -> tuple[dict[str, np.ndarray], object]:
    ld = build_loader(str(url), world=World(), seed=0, cfg=StreamConfig(epochs=1, pcm_dtype=dtype))
    got = {k: w[:n].numpy().copy() for b, _ in ld for k, w, n in zip(b.keys, b.waves, b.lengths.tolist())}
    return got, ld


def _level_corpus(root: Path, resampled: bool) -> dict[str, float]:
    """One file per format (plus a stereo float, downmixed by pack or, kept, by the loader, and with `resampled` a
    44.1 kHz float): key -> source RMS in dB (of the samples soundfile reads back, i.e. the file's own level)."""
    root.mkdir()
    levels = {}
    for key, fmt, subtype, ext in FORMATS:
        p = _write(root, key, _signal(1.5), fmt, subtype, ext)
        levels[key] = _db(sf.read(p, dtype="float64")[0])
    if resampled:  # a dataset holds one rate: kept, a 44.1 kHz file would make it unreadable by the loader
        p = _write(root, "wav_f32_44k", _signal(1.5, rate=44100), "WAV", "FLOAT", "wav", rate=44100)
        levels["wav_f32_44k"] = _db(sf.read(p, dtype="float64")[0])
    p = _write(root, "wav_f64_stereo", _signal(1.5, channels=2), "WAV", "DOUBLE", "wav")
    levels["wav_f64_stereo"] = _db(sf.read(p, dtype="float64")[0].mean(axis=1))
    (root / "manifest.tsv").write_text("path\ttext\n" + "".join(  # a manifest lists any container (AIFF too)
        f"{p.name}\tsome words\n" for p in sorted(root.iterdir()) if p.suffix != ".txt"))
    return levels


@pytest.mark.parametrize("keep", [False, True], ids=["transcoded", "keep_original"])
def test_every_format_at_its_true_level_through_pack_verify_and_loader(tmp_path, keep):
    levels = _level_corpus(tmp_path / "src", resampled=not keep)
    out = tmp_path / "ds"
    r = _pack(tmp_path / "src" / "manifest.tsv", out, audio=AudioTarget(keep_original=keep))
    assert r.samples == len(levels) and r.rejects == 0, r.rejects_by_reason
    assert verify(open_dataset(str(out)), progress=False) == []
    int16, _ = _load(out, "int16")
    float32, _ = _load(out, "float32")
    assert set(int16) == set(float32) == set(levels)
    for key, want in levels.items():
        assert int16[key].dtype == np.int16 and float32[key].dtype == np.float32
        got16, got32 = _db(int16[key] / 32768.0), _db(float32[key])
        assert abs(got16 - want) < 0.1, f"{key}: int16 batch at {got16:.2f} dB, source {want:.2f} dB"
        assert abs(got32 - want) < 0.1, f"{key}: float32 batch at {got32:.2f} dB, source {want:.2f} dB"


def _float_wav(root: Path, key: str, x: np.ndarray, subtype: str = "FLOAT") -> Path:
    return _write(root, key, x.astype(np.float64), "WAV", subtype, "wav")


def test_non_finite_and_mis_scaled_float_audio_are_rejected_with_their_key(tmp_path, caplog):
    src = tmp_path / "src"
    src.mkdir()
    x = _signal(1.0)
    nan, inf = x.copy(), x.copy()
    nan[5000] = np.nan
    inf[100:110] = -np.inf
    over = x.copy()
    over[2000:2010] = 1.3  # 10 overs of 16000: clipped with a warning, kept
    _float_wav(src, "nan32", nan)
    _float_wav(src, "inf64", inf, "DOUBLE")
    _float_wav(src, "intscaled", x * 32767)  # integer values stored as floats: nearly every sample over full scale
    _float_wav(src, "over", over)
    _float_wav(src, "good", x)
    for keep in (False, True):  # transcoded, and kept byte for byte (even without --decode-check)
        out = tmp_path / f"ds{keep}"
        caplog.clear()
        with caplog.at_level("WARNING", logger="shardtrain.pack.transcode"):
            r = _pack(src, out, audio=AudioTarget(keep_original=keep, verify_decode=not keep))
        assert any("past full scale" in m and "over.wav" in m for m in caplog.messages), caplog.messages
        rej = _rejects(out)
        assert rej["nan32"]["reason"] == rej["inf64"]["reason"] == "non_finite_audio"
        assert rej["nan32"]["key"] == "nan32" and "NaN or infinite" in rej["nan32"]["detail"]
        assert rej["intscaled"]["reason"] == "clipped_audio" and "rescale" in rej["intscaled"]["detail"]
        assert r.samples == 2 and set(rej) == {"nan32", "inf64", "intscaled"} and r.clipped == 1
        waves, _ = _load(out, "float32")
        assert np.isfinite(waves["over"]).all() and np.abs(waves["over"]).max() <= 1.0  # clipped at full scale
        assert abs(_db(waves["good"]) - _db(x)) < 0.1


def _poison_float_member(out: Path, key: str) -> None:
    """Overwrite samples of a kept float32 WAV member inside its shard with NaN/Inf (same size), and record the
    shard's new sha256/size in the manifest: a dataset someone else wrote (or indexed in place) holding NaN."""
    import hashlib

    import pyarrow.parquet as pq

    rows = pq.read_table(out / "index.parquet").to_pylist()
    row = next(r for r in rows if r["key"] == key)
    assert row["codec"] == "wav"
    shard = out / f"shard-{row['shard']:06d}.tar"
    data = bytearray(shard.read_bytes())
    at = row["audio_offset"] + row["audio_size"] - 4 * 64  # the last 64 samples, inside the data chunk
    data[at:at + 8] = np.array([np.nan, np.inf], np.float32).tobytes()
    shard.write_bytes(bytes(data))
    manifest = json.loads((out / "manifest.json").read_text())
    for s in manifest["shards"]:
        if s["name"] == shard.name:
            s["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_loader_skips_non_finite_float_member_with_its_key(tmp_path, dtype):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        _float_wav(src, f"f{i}", _signal(1.0 + 0.1 * i, seed=i))
    out = tmp_path / "ds"
    assert _pack(src, out, audio=AudioTarget(keep_original=True)).samples == 4
    _poison_float_member(out, "f2")
    problems = verify(open_dataset(str(out)), progress=False)
    assert [(p.key, p.kind) for p in problems] == [("f2", "non_finite_audio")]
    ld = build_loader(str(out), world=World(), seed=0,
                      cfg=StreamConfig(epochs=1, pcm_dtype=dtype, max_skipped_share=0.5))
    waves = {k: w[:n] for b, _ in ld for k, w, n in zip(b.keys, b.waves, b.lengths.tolist())}
    assert set(waves) == {"f0", "f1", "f3"}
    assert all(bool(np.isfinite(w.float().numpy()).all()) for w in waves.values())
    stats = ld.stats()
    assert stats["skipped"] == 1
    (skip,) = stats["skipped_keys"]
    assert skip["key"] == "f2" and skip["reason"].startswith("non_finite_audio: ")


def test_ctc_impossible_target_is_rejected_at_pack_time_and_the_bound_can_be_turned_off(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _write(src, "short_long_text", _signal(0.3), "FLAC", "PCM_16", "flac", text="x" * 200)
    _write(src, "fast_speech", _signal(1.0), "FLAC", "PCM_16", "flac", text="y" * 35)  # 35 chars/s: kept
    _write(src, "okay", _signal(0.3), "FLAC", "PCM_16", "flac", text="okay thank you")  # short clip, short text
    r = _pack(src, tmp_path / "ds")
    rej = _rejects(tmp_path / "ds")
    assert r.samples == 2 and set(rej) == {"short_long_text"}
    assert rej["short_long_text"]["reason"] == "impossible_target"
    assert "200 characters in 0.30 s" in rej["short_long_text"]["detail"]
    assert _pack(src, tmp_path / "off", max_chars_per_s=0).samples == 3
    assert cli.main(["pack", str(src), str(tmp_path / "cli"), "--max-chars-per-s", "0", "--no-progress"]) == 0
    assert len(json.loads((tmp_path / "cli" / "manifest.json").read_text())["shards"]) >= 1
    assert (tmp_path / "cli" / "rejects.jsonl").read_text() == ""
    with pytest.raises(ValueError, match="--max-chars-per-s must be >= 0"):
        PackConfig(input=str(src), output=str(tmp_path / "x"), max_chars_per_s=-1)


def test_pack_refuses_per_item_what_the_reader_refuses_and_the_dataset_stays_readable(tmp_path):
    assert indexread.MAX_STRING_BYTES is limits.MAX_STRING_BYTES  # one set of limits for writer and reader
    src = tmp_path / "src"
    src.mkdir()
    cap = limits.MAX_STRING_BYTES["text"]
    _write(src, "over", _signal(2.0), "FLAC", "PCM_16", "flac", text="w " * (cap // 2 + 1000))  # ~66 KB
    _write(src, "long_ok", _signal(2.0), "FLAC", "PCM_16", "flac", text="é" * (cap // 2 - 10))  # 65,516 bytes
    _write(src, "short", _signal(1.0), "FLAC", "PCM_16", "flac", text="hello")
    out = tmp_path / "ds"
    r = _pack(src, out, max_chars_per_s=0)  # only the format limit decides here
    rej = _rejects(out)
    assert set(rej) == {"over"} and rej["over"]["reason"] == "text_too_long" and r.samples == 2
    ds = open_dataset(str(out))
    assert ds.read_index(["key", "text"]).num_rows == 2  # readable: the near-cap row is no aggregate problem
    assert verify(ds, progress=False) == []
    waves, ld = _load(out, "float32")
    assert set(waves) == {"long_ok", "short"} and ld.stats()["skipped"] == 0


def test_fields_a_reader_refuses_are_rejected_before_and_after_encoding(tmp_path):
    """A speaker name over its index bound is refused from metadata (scan); an extra field that makes `<key>.json`
    larger than a reader reads is refused after encoding (the shard task): both one reject, the rest readable."""
    src = tmp_path / "src"
    src.mkdir()
    for key in ("ok", "spk", "meta"):
        _write(src, key, _signal(1.0), "FLAC", "PCM_16", "flac")
    rows = [{"path": "ok.flac", "text": "fine"}, {"path": "spk.flac", "text": "fine", "speaker": "s" * 2000},
            {"path": "meta.flac", "text": "fine", "notes": "n" * (limits.MAX_JSON_BYTES + 10)}]
    (src / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ds"
    r = _pack(src / "m.jsonl", out)
    rej = _rejects(out)
    assert r.samples == 1 and {k: v["reason"] for k, v in rej.items()} == {"spk": "field_too_long",
                                                                           "meta": "field_too_long"}
    assert "speaker of 2000 bytes" in rej["spk"]["detail"] and "<key>.json of" in rej["meta"]["detail"]
    assert verify(open_dataset(str(out)), progress=False) == []
