"""load.reader.read_members: members by index row through the loader's own read path (checks, decoder)."""
import os
import shutil

import numpy as np
import torch
import pytest
import soundfile

from shardtrain.format.manifest import open_dataset
from shardtrain.load.config import StreamConfig
from shardtrain.load.errors import StreamError
from shardtrain.load.reader import read_members
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus

DURS = [0.4 + 0.3 * i for i in range(10)]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("members")
    corpus = make_corpus(root / "corpus", DURS, seed=3)
    out = root / "ds"
    pack(PackConfig(input=str(corpus), output=str(out), max_samples_per_shard=3, workers=1, progress=False))
    return corpus, str(out)


def _source(corpus, key):
    """The corpus file of `key`, decoded by soundfile: what the packer was given."""
    (path,) = [p for p in corpus.rglob("*.flac") if p.stem == key]
    return soundfile.read(path, dtype="float32")


def test_members_in_the_order_asked_match_their_source(packed):
    corpus, url = packed
    index = open_dataset(url).read_index(columns=["key", "shard"]).to_pylist()
    order = [7, 0, 9, 3, 4, 1]  # across shards, not ascending
    got = list(read_members(open_dataset(url), order, group=4))
    assert [m.row for m in got] == order
    assert [m.key for m in got] == [index[r]["key"] for r in order]
    for m in got:
        want, rate = _source(corpus, m.key)
        assert m.error is None and m.sample_rate_hz == rate == 16000
        assert m.samples.dtype == np.float32 and m.samples.flags.owndata  # a private copy, not a pooled buffer
        np.testing.assert_array_equal(m.samples, want)


def test_corrupt_member_gets_the_loaders_reason(packed, tmp_path):
    """The same checks as a training batch: a garbled FLAC is a decode_error, a member renamed in the tar is an
    index_mismatch (the name check), each yielded in its place; strict raises; others still decode."""
    _, url = packed
    out = tmp_path / "ds"
    shutil.copytree(url, out)
    rows = open_dataset(str(out)).read_index().to_pylist()
    bad, renamed = rows[2], rows[5]
    with open(out / f"shard-{bad['shard']:06d}.tar", "r+b") as f:
        f.seek(bad["audio_offset"])
        f.write(b"XXXX" + os.urandom(min(2000, bad["audio_size"] - 8)))
    with open(out / f"shard-{renamed['shard']:06d}.tar", "r+b") as f:
        f.seek(renamed["audio_offset"] - 512)  # its ustar header: the name's first byte (the checksum then fails)
        f.write(b"Z")
    got = {m.row: m for m in read_members(open_dataset(str(out)), range(len(rows)))}
    assert got[2].samples is None and got[2].error.startswith("decode_error") and got[2].key == bad["key"]
    assert got[5].samples is None and got[5].error.split(":")[0] in ("bad_header", "index_mismatch")
    assert all(m.error is None and len(m.samples) > 0 for r, m in got.items() if r not in (2, 5))
    with pytest.raises(StreamError, match=bad["key"]):
        list(read_members(open_dataset(str(out)), [2], StreamConfig(strict=True)))


def test_rows_out_of_range_or_repeated_are_refused(packed):
    _, url = packed
    with pytest.raises(IndexError):
        list(read_members(open_dataset(url), [0, len(DURS)]))
    with pytest.raises(ValueError, match="at most once"):
        list(read_members(open_dataset(url), [1, 1]))


def test_first_batch_of_a_chunk_is_handed_over_before_the_others_decode(packed):
    """ChunkReader.start decodes batch by batch and resolves each batch's Future when its last row is in: with
    one decode thread, batch 0 is complete while no later batch has resolved; `load` gathers the same rows."""
    import threading

    from shardtrain.load.plan import CHECK_COLUMNS, PLAN_COLUMNS, Chunk, PlanIndex
    from shardtrain.load.reader import ChunkReader

    _, url = packed
    ds = open_dataset(url)
    idx = PlanIndex.from_table(ds.read_index(columns=list(PLAN_COLUMNS) + list(CHECK_COLUMNS)))
    reader = ChunkReader(ds, idx, StreamConfig(decode_threads=1))
    batches = (np.array([9, 0, 4]), np.array([1, 8]), np.array([2, 7, 3]), np.array([5, 6]))
    chunk = Chunk(rows=np.arange(10), batches=batches)
    gate = threading.Event()
    try:
        reader.decode_pool.submit(-1, gate.wait)  # holds the one decode thread until every row is queued
        head = reader.start(chunk, epoch=0, first_step=5, skip_batches=0)
        seen = []
        head.batches[0].add_done_callback(lambda f: seen.append([g.done() for g in head.batches]))
        gate.set()
        parts = [f.result() for f in head.batches]
        assert seen == [[True, False, False, False]]
        assert [p.first_step for p in parts] == [5, 6, 7, 8]
        whole = reader.load(chunk, epoch=0, first_step=5, skip_batches=0)
        for p, b, want in zip(parts, whole.batches, batches):
            assert [str(k) for k in p.batches[0][2]] == [idx.string_at("key", int(r)) for r in want]
            assert torch.equal(p.batches[0][0], b[0])
    finally:
        reader.io_pool.shutdown(wait=False)
        reader.decode_pool.shutdown()


def test_a_sample_twice_in_one_chunk_decodes_twice(packed):
    """A mixture's gathered index can hold one sample twice (a dataset repeated to its weight): each copy is read
    into a run of its own and decoded into its own batch row (found by test_preflight's mixture epoch)."""
    import dataclasses

    from shardtrain.load.plan import CHECK_COLUMNS, PLAN_COLUMNS, Chunk, PlanIndex
    from shardtrain.load.reader import ChunkReader

    _, url = packed
    ds = open_dataset(url)
    table = ds.read_index(columns=list(PLAN_COLUMNS) + list(CHECK_COLUMNS))
    base = PlanIndex.from_table(table)
    take = np.array([0, 1, 2, 1, 3, 0])  # rows 3 and 5 repeat samples 1 and 0
    idx = PlanIndex(**{f.name: (getattr(base, f.name)[take] if isinstance(getattr(base, f.name), np.ndarray)
                                else getattr(base, f.name).take(take)) for f in dataclasses.fields(PlanIndex)})
    reader = ChunkReader(ds, idx, StreamConfig())
    try:
        got = reader.load(Chunk(rows=np.arange(6), batches=(np.array([0, 3, 4]), np.array([1, 2, 5]))), 0, 0, 0)
    finally:
        reader.io_pool.shutdown(wait=False)
        reader.decode_pool.shutdown()
    assert got.errors == []
    (pcm0, len0, keys0, *_), (pcm1, len1, keys1, *_) = got.batches
    assert keys0 == [idx.string_at("key", r) for r in (0, 3, 4)] and keys1 == [idx.string_at("key", r) for r in (1, 2, 5)]
    assert torch.equal(pcm0[1, :len0[1]], pcm1[0, :len1[0]])  # sample 1, both copies
    assert torch.equal(pcm0[0, :len0[0]], pcm1[2, :len1[2]])  # sample 0, both copies
    assert float(pcm0[1].abs().max()) > 0


@pytest.mark.parametrize("map_local", [True, False])
def test_shard_truncated_inside_a_run_skips_only_its_cut_rows(packed, tmp_path, map_local):
    """A shard cut short inside its last sample: the samples before the cut, read in the same byte run, decode as
    usual and the cut one is a counted `truncated_shard`, whether the run is memory-mapped (shorter than planned)
    or read into a buffer. The mapped run once passed the planned length to the row checks (a ValueError from
    numpy naming no shard, which stopped training)."""
    _, url = packed
    out = tmp_path / "ds"
    shutil.copytree(url, out)
    rows = open_dataset(str(out)).read_index().to_pylist()
    shard = rows[0]["shard"]  # a full shard (3 samples)
    mine = [i for i, r in enumerate(rows) if r["shard"] == shard]
    assert len(mine) >= 2
    last = rows[mine[-1]]
    with open(out / f"shard-{shard:06d}.tar", "r+b") as f:
        f.truncate(last["audio_offset"] + last["audio_size"] // 2)
    got = list(read_members(open_dataset(str(out)), mine, StreamConfig(map_local=map_local), group=len(mine)))
    assert [m.row for m in got] == mine
    assert all(m.error is None and len(m.samples) == rows[m.row]["num_samples"] for m in got[:-1])
    assert got[-1].samples is None and got[-1].error.startswith("truncated_shard")


def test_a_dataset_re_packed_in_place_during_a_read_is_refused_before_its_next_shard(packed, tmp_path):
    """Shards are pinned to the version a run first reads, so a shard first read after a same-layout re-pack in
    place would be pinned to the new bytes (WAV members of equal size pass every row check). Before a shard's first
    read the manifest must still be the one opened: a rewrite with the same shards passes, one listing other
    shards (sha256s) stops the read before the next shard with a StreamError."""
    import json

    _, url = packed
    out = tmp_path / "ds"
    shutil.copytree(url, out)
    ds = open_dataset(str(out))
    rows = ds.read_index().to_pylist()
    by_shard = {}
    for i, r in enumerate(rows):
        by_shard.setdefault(r["shard"], []).append(i)
    first, second, third = (by_shard[s] for s in sorted(by_shard)[:3])
    members = read_members(ds, first + second + third, group=len(first))
    assert all(next(members).error is None for _ in first)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json.new").write_text(json.dumps(manifest))  # the same shards, rewritten: a new inode
    os.replace(out / "manifest.json.new", out / "manifest.json")
    assert all(next(members).error is None for _ in second[:1])
    manifest["shards"][third and rows[third[0]]["shard"]]["sha256"] = "0" * 64  # a re-pack: other bytes
    (out / "manifest.json.new").write_text(json.dumps(manifest))
    os.replace(out / "manifest.json.new", out / "manifest.json")
    with pytest.raises(StreamError, match="re-packed or removed while this run reads it"):
        list(members)
    members = read_members(open_dataset(str(out)), first + second, group=len(first))
    assert all(next(members).error is None for _ in first)
    (out / "manifest.json").unlink()  # `pack --overwrite` removes the old dataset first
    with pytest.raises(StreamError, match="re-packed or removed"):
        list(members)
