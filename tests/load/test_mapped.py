"""The Loader planning by blocks over a memory-mapped index (issue 11.4), on real packed audio."""
import json
import os
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest

from shardtrain.format.manifest import open_dataset
from shardtrain.format.validate import DatasetError
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.mapped import open_mapped
from shardtrain.load.plan import BucketConfig
from shardtrain.load.reader import StreamError
from shardtrain.world import World

from conftest import pack_tones

DURS = [0.3 + 0.17 * ((i * 7) % 23) for i in range(90)]
BUDGET = 8.0


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return pack_tones(tmp_path_factory.mktemp("blockloader"), DURS, seed=1)


def cfg(cache, **kw) -> StreamConfig:
    kw.setdefault("planner", "blocks")
    return StreamConfig(bucket=BucketConfig(max_batch_seconds=BUDGET, chunk_mb=0.05, num_buckets=4),
                        epochs=kw.pop("epochs", 1), block_s=6.0, index_cache_dir=str(cache), **kw)


def epoch_keys(url, cache, ws, state=None, stop=None, **kw):
    """Per rank: the list of batches (keys) it yields, and its last state."""
    out, states = [], []
    for r in range(ws):
        loader = build_loader(url, world=World(rank=r, world_size=ws), seed=3, cfg=cfg(cache, **kw), state=state)
        assert loader.planner.name == "blocks"
        got, st = [], state
        for batch, st in loader:
            assert float(batch.durations_s.sum()) <= BUDGET + 1e-9
            got.append(list(batch.keys))
            if stop is not None and len(got) == stop:
                break
        assert loader.stats()["skipped"] == 0
        out.append(got)
        states.append(st)
    return out, states


def all_keys(url):
    return sorted(open_dataset(url).read_index(columns=["key"]).column("key").to_pylist())


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_blocks_planner_exactly_once_equal_steps_budget(dataset, tmp_path, ws):
    per_rank, _ = epoch_keys(dataset, tmp_path, ws)
    assert len({len(r) for r in per_rank}) == 1  # equal steps on every rank
    keys = [k for r in per_rank for b in r for k in b]
    assert sorted(keys) == all_keys(dataset)


def test_blocks_batches_change_between_epochs_and_resume_exactly(dataset, tmp_path):
    (full,), _ = epoch_keys(dataset, tmp_path, 1, epochs=2)
    steps = len(full) // 2
    pairs = [{frozenset((a, b)) for batch in half for i, a in enumerate(batch) for b in batch[i + 1:]}
             for half in (full[:steps], full[steps:])]
    assert len(pairs[0] & pairs[1]) < 0.6 * len(pairs[0])  # composition is re-dealt every epoch
    (head,), (state,) = epoch_keys(dataset, tmp_path, 1, epochs=2, stop=steps + 3)
    (tail,), _ = epoch_keys(dataset, tmp_path, 1, epochs=2, state=json.loads(json.dumps(state)))
    assert head + tail == full  # exact resume mid-epoch, through a JSON round trip


def test_blocks_elastic_resume_sees_the_rest_of_the_epoch_once(dataset, tmp_path):
    first, states = epoch_keys(dataset, tmp_path, 2, stop=4)
    assert states[0]["planner"] == "blocks" and states[0]["step"] == 4
    second, _ = epoch_keys(dataset, tmp_path, 3, state=states[0])  # 2 ranks -> 3 ranks, mid-epoch
    assert len({len(r) for r in second}) == 1
    keys = [k for part in (first, second) for r in part for b in r for k in b]
    assert sorted(keys) == all_keys(dataset)


def test_resume_refuses_a_state_of_the_other_planner(dataset, tmp_path):
    _, (state,) = epoch_keys(dataset, tmp_path, 1, stop=2)
    with pytest.raises(StreamError, match="planned by blocks.*stream.planner=blocks"):
        build_loader(dataset, world=World(), seed=3, cfg=cfg(tmp_path, planner="rows"), state=state)


def test_auto_switches_to_blocks_at_the_row_threshold(dataset, tmp_path):
    small = build_loader(dataset, world=World(), seed=0, cfg=cfg(tmp_path, planner="auto", block_plan_min_rows=91))
    big = build_loader(dataset, world=World(), seed=0, cfg=cfg(tmp_path, planner="auto", block_plan_min_rows=90))
    assert (small.planner.name, big.planner.name) == ("rows", "blocks")
    assert small.fingerprint == big.fingerprint  # one dataset identity, whichever planner reads it


def test_mapped_index_equals_the_parquet_and_is_built_once(dataset, tmp_path):
    ds = open_dataset(dataset)
    results = []
    threads = [threading.Thread(target=lambda: results.append(open_mapped(ds, str(tmp_path), text=True)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({str(m.folder) for m in results}) == 1
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [results[0].folder.name]  # no leftover temp copy
    stamp = os.stat(results[0].folder / "meta.json").st_mtime_ns
    mi = open_mapped(ds, str(tmp_path), text=True)
    assert os.stat(mi.folder / "meta.json").st_mtime_ns == stamp  # opened, not rebuilt
    table = ds.read_index()
    for col in ("shard", "offset", "size", "audio_offset", "duration_s", "num_samples"):
        assert np.array_equal(np.asarray(getattr(mi.idx, col)), table.column(col).to_numpy())
    assert [mi.idx.string_at("key", i) for i in range(len(mi.idx))] == table.column("key").to_pylist()
    assert [mi.idx.string_at("text", i) for i in range(len(mi.idx))] == table.column("text").to_pylist()


def _rewrite_index(url, tmp_path, edit):
    """A copy of the dataset whose index.parquet has one column edited (manifest and shards unchanged), written in
    row groups of 4 rows so the mapped build must check across row groups."""
    import shutil

    dst = tmp_path / "bad"
    shutil.copytree(url, dst)
    table = pq.read_table(dst / "index.parquet")
    col = table.column_names.index(edit[0])
    values = table.column(edit[0]).to_numpy().copy()
    edit[1](values)
    table = table.set_column(col, table.schema.field(col), [values])
    pq.write_table(table, dst / "index.parquet", row_group_size=4)
    return str(dst)


@pytest.mark.parametrize("edit, match", [
    (("offset", lambda v: v.__setitem__(5, 10**12)), "row 5.*past the end of its shard"),
    (("duration_s", lambda v: v.__setitem__(40, v[40] + 5.0)),  # num_samples no longer matches either (issue 21)
     "row 41 is out of duration order|row 40 .*num_samples must be duration_s x sample_rate_hz"),
    (("shard", lambda v: v.__setitem__(8, 0)), "row 8 is out of \\(shard, offset\\) order or overlaps"),
])
def test_mapped_build_refuses_a_hostile_index_naming_the_row(dataset, tmp_path, edit, match):
    bad = _rewrite_index(dataset, tmp_path, edit)
    with pytest.raises(DatasetError, match=match):
        build_loader(bad, world=World(), seed=0, cfg=cfg(tmp_path / "cache"))
    assert not any(p.is_dir() for p in (tmp_path / "cache").iterdir())  # nothing half-built left behind


def test_blocks_reader_still_checks_members_against_the_mapped_keys(dataset, tmp_path):
    """A sample whose tar member name differs from the index key is skipped and reported with the index's key."""
    import shutil

    dst = tmp_path / "renamed"
    shutil.copytree(dataset, dst)
    ds = open_dataset(str(dst))
    row = ds.read_index(columns=["key", "shard", "audio_offset"]).to_pylist()[7]
    shard = dst / ds.shards[row["shard"]].name
    data = bytearray(shard.read_bytes())
    hdr = row["audio_offset"] - 512
    data[hdr] = ord("X") if data[hdr] != ord("X") else ord("Y")  # first byte of the member name; checksum stale too
    shard.write_bytes(bytes(data))
    loader = build_loader(str(dst), world=World(), seed=0, cfg=cfg(tmp_path / "c", max_skipped_share=1.0))
    keys = [k for b, _ in loader for k in b.keys]
    assert loader.stats()["skipped"] == 1 and row["key"] not in keys
    assert loader.stats()["skipped_keys"][0]["key"] == row["key"]


@pytest.mark.s3
def test_blocks_planner_on_s3(dataset, tmp_path, s3, s3_bucket):
    url = f"{s3_bucket}/ds"
    so = s3.storage_options
    import fsspec

    fs = fsspec.filesystem("s3", **so)
    fs.put(dataset + "/", url.removeprefix("s3://") + "/", recursive=True)
    keys = []
    for r in range(2):
        loader = build_loader(url, world=World(rank=r, world_size=2), seed=1, cfg=cfg(tmp_path), storage_options=so)
        assert loader.planner.name == "blocks"
        keys += [k for b, _ in loader for k in b.keys]
    assert sorted(keys) == all_keys(dataset)
