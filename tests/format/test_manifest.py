"""format/manifest.py: open_dataset, column projection, an incomplete or future dataset refused. (inspect and
verify: tests/pack/test_verify.py.)"""
from __future__ import annotations

import json

import pytest

from conftest import copy_dataset as _copy
from shardtrain import cli
from shardtrain.format.manifest import INDEX_SCHEMA, DatasetError, open_dataset


def test_open_dataset_and_index(tones24):
    ds = open_dataset(str(tones24) + "/")
    assert ds.url == str(tones24) and len(ds.shards) == 5 and ds.shard_url(1).endswith("/shard-000001.tar")
    assert ds.manifest["totals"] == {"samples": 24, "seconds": pytest.approx(sum(s.seconds for s in ds.shards)),
                                     "bytes": sum(s.bytes for s in ds.shards), "shards": 5, "rejects": 0}
    full = ds.read_index()
    assert full.schema.remove_metadata() == INDEX_SCHEMA and full.num_rows == 24
    proj = ds.read_index(["key", "duration_s"])
    assert proj.column_names == ["key", "duration_s"]
    assert proj.column("key").to_pylist() == full.column("key").to_pylist()
    assert set(full.column("speaker").to_pylist()) == {"spk0", "spk1", "spk2"}


def test_missing_manifest_is_incomplete(tones24, tmp_path):
    d = _copy(tones24, tmp_path)
    (d / "manifest.json").unlink()
    with pytest.raises(DatasetError, match="incomplete dataset: no manifest.json at .*re-run `shardtrain pack INPUT .*` \\(it resumes\\)"):
        open_dataset(str(d))
    assert cli.main(["inspect", str(d)]) == 2
    m = json.loads((tones24 / "manifest.json").read_text())
    (d / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))
    with pytest.raises(DatasetError, match="format_version 99"):
        open_dataset(str(d))


def test_a_local_index_reaches_arrow_as_its_own_file_not_a_python_object(tones24, tmp_path):
    """Dataset.open_index: Arrow's IO threads never hold a Python file of a local index (a thread dropping one
    while the interpreter exits aborts the process); a missing index is still FileNotFoundError."""
    import pyarrow as pa

    ds = open_dataset(tones24)
    with ds.open_index() as f:
        assert isinstance(f, pa.NativeFile)
    assert ds.read_index(columns=["key"]).num_rows == sum(s.samples for s in ds.shards)
    out = _copy(tones24, tmp_path)
    (out / "index.parquet").unlink()
    with pytest.raises(FileNotFoundError):
        open_dataset(str(out)).read_index()
