"""pack/verify.py: inspect's summary, and verify catching damaged shards (a flipped byte, a truncated shard, a
bad tar header, a missing shard) in copies of a real packed dataset (conftest's tones24)."""
from __future__ import annotations

import pytest

from conftest import copy_dataset as _copy
from shardtrain import cli
from shardtrain.format.manifest import open_dataset
from shardtrain.pack.verify import format_inspect, inspect, verify


def test_inspect_summary(tones24):
    d = inspect(open_dataset(str(tones24)))
    assert d["totals"]["samples"] == 24 and d["codecs"] == {"flac": 24} and d["sample_rates_hz"] == {"16000": 24}
    assert sum(d["duration_histogram"]["counts"]) == 24 and d["speakers"] == 3
    assert d["duration_s"]["min"] == pytest.approx(0.3) and d["duration_s"]["max"] == pytest.approx(1.9)
    text = format_inspect(d)
    assert "24 samples" in text and "shard-000004.tar" in text and "#" in text


def test_verify_clean(tones24):
    assert verify(open_dataset(str(tones24)), progress=False) == []


def test_verify_catches_flipped_byte(tones24, tmp_path, capsys):
    d = _copy(tones24, tmp_path)
    ds = open_dataset(str(d))
    row = ds.read_index().to_pylist()[7]  # a sample in shard 1
    shard = d / ds.shards[row["shard"]].name
    data = bytearray(shard.read_bytes())
    data[row["audio_offset"] + row["audio_size"] // 2] ^= 0xFF  # inside FLAC frames: CRC mismatch on decode
    shard.write_bytes(bytes(data))
    problems = verify(ds, progress=False)
    kinds = {(p.shard, p.key, p.kind) for p in problems}
    assert (shard.name, None, "sha256_mismatch") in kinds
    assert any(p.key == row["key"] and p.kind in ("decode_failed", "num_samples_mismatch") for p in problems), kinds
    assert all(p.shard == shard.name for p in problems)
    assert cli.main(["inspect", str(d), "--verify", "--no-progress"]) == 1
    assert "sha256_mismatch" in capsys.readouterr().out


def test_verify_catches_truncated_shard_and_bad_header(tones24, tmp_path):
    d = _copy(tones24, tmp_path)
    ds = open_dataset(str(d))
    rows = [r for r in ds.read_index().to_pylist() if r["shard"] == 2]
    shard = d / ds.shards[2].name
    shard.write_bytes(shard.read_bytes()[: rows[3]["audio_offset"] + 100])  # cut inside the 4th sample's audio
    other = d / ds.shards[3].name
    data = bytearray(other.read_bytes())
    data[0] = ord("Z")  # first member's name (and header checksum) now wrong
    other.write_bytes(bytes(data))
    problems = verify(ds, progress=False)
    p2 = {(p.key, p.kind) for p in problems if p.shard == shard.name}
    assert (None, "size_mismatch") in p2 and (None, "tar_error") in p2
    assert {k for k, kind in p2 if kind == "truncated"} == {rows[3]["key"], rows[4]["key"]}
    p3 = [p for p in problems if p.shard == other.name]
    assert any(p.kind == "bad_header" for p in p3) and any(p.kind == "sha256_mismatch" for p in p3)
    (d / ds.shards[0].name).unlink()
    assert any(p.kind == "missing_shard" for p in verify(ds, progress=False))
