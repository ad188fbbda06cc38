"""index: open_dataset, column projection, inspect, and verify catching damaged shards."""
from __future__ import annotations

import json
import shutil

import pytest

from shardtrain import cli
from shardtrain.format.manifest import INDEX_SCHEMA, DatasetError, open_dataset
from shardtrain.pack.verify import format_inspect, inspect, verify
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    corpus = make_corpus(root / "corpus", [0.3 + 0.2 * (i % 9) for i in range(24)], seed=7)
    pack(PackConfig(input=str(corpus / "manifest.tsv"), output=str(root / "out"), max_samples_per_shard=5,
                    progress=False))
    return root / "out"


def _copy(dataset, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(dataset, dst)
    return dst


def test_open_dataset_and_index(dataset):
    ds = open_dataset(str(dataset) + "/")
    assert ds.url == str(dataset) and len(ds.shards) == 5 and ds.shard_url(1).endswith("/shard-000001.tar")
    assert ds.manifest["totals"] == {"samples": 24, "seconds": pytest.approx(sum(s.seconds for s in ds.shards)),
                                     "bytes": sum(s.bytes for s in ds.shards), "shards": 5, "rejects": 0}
    full = ds.read_index()
    assert full.schema.remove_metadata() == INDEX_SCHEMA and full.num_rows == 24
    proj = ds.read_index(["key", "duration_s"])
    assert proj.column_names == ["key", "duration_s"]
    assert proj.column("key").to_pylist() == full.column("key").to_pylist()
    assert set(full.column("speaker").to_pylist()) == {"spk0", "spk1", "spk2"}


def test_missing_manifest_is_incomplete(dataset, tmp_path):
    d = _copy(dataset, tmp_path)
    (d / "manifest.json").unlink()
    with pytest.raises(DatasetError, match="incomplete dataset: no manifest.json at .*re-run `shardtrain pack INPUT .*` \\(it resumes\\)"):
        open_dataset(str(d))
    assert cli.main(["inspect", str(d)]) == 2
    m = json.loads((dataset / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))
    with pytest.raises(DatasetError, match="format_version 99"):
        open_dataset(str(d))


def test_inspect_summary(dataset):
    d = inspect(open_dataset(str(dataset)))
    assert d["totals"]["samples"] == 24 and d["codecs"] == {"flac": 24} and d["sample_rates_hz"] == {"16000": 24}
    assert sum(d["duration_histogram"]["counts"]) == 24 and d["speakers"] == 3
    assert d["duration_s"]["min"] == pytest.approx(0.3) and d["duration_s"]["max"] == pytest.approx(1.9)
    text = format_inspect(d)
    assert "24 samples" in text and "shard-000004.tar" in text and "#" in text


def test_verify_clean(dataset):
    assert verify(open_dataset(str(dataset)), progress=False) == []


def test_verify_catches_flipped_byte(dataset, tmp_path, capsys):
    d = _copy(dataset, tmp_path)
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


def test_verify_catches_truncated_shard_and_bad_header(dataset, tmp_path):
    d = _copy(dataset, tmp_path)
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
