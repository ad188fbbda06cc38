"""format/validate.py on a real packed dataset's manifest.json and index.parquet, then each edited the way a hostile
or broken producer would: every violation is one DatasetError naming the file, the field and the value (whole
datasets opened and read this way: tests/format/test_untrusted.py)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from shardtrain.format.validate import (MAX_MANIFEST_BYTES, DatasetError, check_index, check_manifest,
                                        parse_manifest, show)

from conftest import pack_tones


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    ds = Path(pack_tones(tmp_path_factory.mktemp("validate"), [0.5 + 0.1 * i for i in range(10)], seed=4,
                         max_samples_per_shard=4))
    manifest = json.loads((ds / "manifest.json").read_bytes())
    return manifest, pq.read_table(ds / "index.parquet")


def test_parse_manifest_refusals():
    assert parse_manifest(b'{"a": 1}', "m") == {"a": 1}
    for raw, msg in [(b"[1]", "a manifest is a JSON object, found list"), (b"{", "not valid JSON"),
                     (b"[" * 100_000 + b"]" * 100_000, "nested too deeply")]:
        with pytest.raises(DatasetError, match=msg):
            parse_manifest(raw, "s3://b/manifest.json")
    with pytest.raises(DatasetError, match=f"{MAX_MANIFEST_BYTES + 1} bytes, more than the {MAX_MANIFEST_BYTES}"):
        parse_manifest(memoryview(bytearray(MAX_MANIFEST_BYTES + 1)), "m")  # refused before parsing
    assert show("x" * 100, 10) == "'xxxxxx..." and show("\x1b") == "'\\x1b'"


def test_real_manifest_passes_and_edits_are_named(dataset):
    manifest, _ = dataset
    entries = check_manifest(manifest, "manifest.json")
    assert [e["name"] for e in entries] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    edits = [
        (lambda m: m["shards"][1].update(name="../../etc/passwd"),
         r"shards\[1\]\.name = '\.\./\.\./etc/passwd' must match"),
        (lambda m: m["shards"][2].update(name="shard-000000.tar"),
         r"shards\[2\]\.name 'shard-000000.tar' repeats shards\[0\]"),
        (lambda m: m["shards"][0].update(samples=True), r"shards\[0\]\.samples = True must be an integer"),
        (lambda m: m["shards"][0].update(sha256="AB" * 32), "must be 64 lowercase hex digits"),
        (lambda m: m["totals"].update(samples=11), "totals say 3 shards / 11 samples, the shard list has 3 / 10"),
        (lambda m: m.update(index="s3://other/index.parquet"), "index = 's3://other/index.parquet' must match"),
    ]
    for edit, msg in edits:
        m = copy.deepcopy(manifest)
        edit(m)
        with pytest.raises(DatasetError, match=msg):
            check_manifest(m, "manifest.json")


def test_real_index_passes_and_edits_are_named(dataset):
    manifest, table = dataset
    sizes = [s["bytes"] for s in manifest["shards"]]
    samples = [s["samples"] for s in manifest["shards"]]
    check_index(table, sizes, samples)

    def edited(col: str, values) -> pa.Table:
        i = table.column_names.index(col)
        return table.set_column(i, col, pa.array(values, table.schema.field(col).type))

    keys = table.column("key").to_pylist()
    with pytest.raises(DatasetError, match="key must match"):
        check_index(edited("key", ["../x"] + keys[1:]), sizes, samples)
    with pytest.raises(DatasetError, match="column key holds duplicate keys"):
        check_index(edited("key", [keys[1]] + keys[1:]), sizes, samples)
    shard = table.column("shard").to_pylist()
    with pytest.raises(DatasetError, match="rows for shard 0, the manifest says 4"):
        check_index(edited("shard", [1] + shard[1:]), sizes, samples)
    n = pc.multiply(table.column("num_samples"), 2).to_pylist()
    with pytest.raises(DatasetError, match="num_samples"):
        check_index(edited("num_samples", n), sizes, samples)
    with pytest.raises(DatasetError):  # an offset past the end of its shard
        check_index(edited("offset", [10**9] + table.column("offset").to_pylist()[1:]), sizes, samples)
