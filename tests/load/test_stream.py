"""Loader invariants (design.md 1-8) on a real packed dataset: real FLAC encoded by the packer, decoded here."""
import hashlib
import json
import os
import shutil
import time

import numpy as np
import psutil
import pytest
import torch

from shardtrain.format.manifest import open_dataset
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.load.plan import BucketConfig
from shardtrain.load.config import StreamConfig
from shardtrain.load.reader import StreamError
from shardtrain.load.loader import build_loader
from shardtrain.testing.corpus import make_corpus
from shardtrain.world import World

from conftest import pack_tones

DURS = [0.3 + 0.17 * ((i * 7) % 23) for i in range(90)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return pack_tones(tmp_path_factory.mktemp("stream"), DURS, seed=1)


def cfg(**kw) -> StreamConfig:
    bucket = kw.pop("bucket", BucketConfig(max_batch_seconds=8.0, chunk_mb=0.05, num_buckets=4))
    kw.setdefault("max_skipped_share", 1.0)  # corruption tests count their skips; the share stop has its own test
    return StreamConfig(bucket=bucket, epochs=kw.pop("epochs", 1), **kw)


def run(url, world=World(), seed=0, state=None, n=None, **kw):
    """[(keys, waves sha1, lengths)] per batch, and the states after each batch."""
    loader = build_loader(url, world=world, seed=seed, cfg=cfg(**kw), state=state)
    out, states = [], []
    for batch, st in loader:
        digest = hashlib.sha1(batch.waves.numpy().tobytes()).hexdigest()
        out.append((tuple(batch.keys), digest, tuple(batch.lengths.tolist()), tuple(batch.texts)))
        states.append(st)
        if n is not None and len(out) == n:
            break
    return out, states, loader


def all_keys(url):
    return open_dataset(url).read_index(columns=["key"]).column("key").to_pylist()


def test_one_epoch_exactly_once_budget_and_padding(dataset):
    batches, _, loader = run(dataset)
    keys = [k for b in batches for k in b[0]]
    assert sorted(keys) == sorted(all_keys(dataset))
    durs = dict(zip(all_keys(dataset), open_dataset(dataset).read_index(columns=["duration_s"]).column(0).to_pylist()))
    for b in batches:
        assert sum(durs[k] for k in b[0]) <= 8.0 + 1e-9
    assert loader.stats()["skipped"] == 0
    assert loader.stats()["samples"] == len(DURS)
    # texts come from the shard's json members and match the index
    idx = open_dataset(dataset).read_index(columns=["key", "text"]).to_pylist()
    text_of = {r["key"]: r["text"] for r in idx}
    assert all(t == text_of[k] for b in batches for k, t in zip(b[0], b[3]))


def test_waves_match_source_audio(dataset, tmp_path):
    import soundfile as sf
    batch, _ = next(iter(build_loader(dataset, world=World(), seed=0, cfg=cfg())))
    src = open_dataset(dataset).read_index(columns=["key", "source"]).to_pylist()
    path_of = {r["key"]: r["source"] for r in src}
    for i, key in enumerate(batch.keys):
        ref, _ = sf.read(path_of[key], dtype="int16")
        got = (batch.waves[i, : batch.lengths[i]].numpy() * 32768).round().astype(np.int16)
        assert np.array_equal(got, ref)
        assert float(batch.waves[i, batch.lengths[i]:].abs().sum()) == 0.0  # zero padding


def test_int16_batches_are_the_same_pcm(dataset):
    ref = next(iter(build_loader(dataset, world=World(), seed=0, cfg=cfg())))[0]
    got = next(iter(build_loader(dataset, world=World(), seed=0, cfg=cfg(pcm_dtype="int16"))))[0]
    assert got.waves.dtype == torch.int16 and got.keys == ref.keys
    assert torch.equal(got.waves.float() / 32768.0, ref.waves)


@pytest.mark.parametrize("threads", [1, 3])
def test_deterministic_across_runs_and_threads(dataset, threads):
    ref, _, _ = run(dataset, seed=3, epochs=2)
    got, _, _ = run(dataset, seed=3, epochs=2, decode_threads=threads, prefetch_chunks=1)
    assert got == ref
    other, _, _ = run(dataset, seed=4, epochs=2)
    assert [b[0] for b in other] != [b[0] for b in ref]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_disjoint_complete_equal_steps(dataset, world_size):
    per_rank = [run(dataset, world=World(rank=r, world_size=world_size))[0] for r in range(world_size)]
    assert len({len(b) for b in per_rank}) == 1, "ranks yield different numbers of batches"
    keys = [k for batches in per_rank for b in batches for k in b[0]]
    assert len(keys) == len(set(keys)) and sorted(keys) == sorted(all_keys(dataset))


def test_resume_is_bit_exact(dataset):
    full, states, _ = run(dataset, seed=1, epochs=2, decode_threads=1)
    for k in (1, len(full) // 2 - 1, len(full) // 2):  # start, middle of epoch 0, epoch boundary region
        state = json.loads(json.dumps(states[k - 1]))  # a checkpoint round trip
        rest, _, _ = run(dataset, seed=1, epochs=2, decode_threads=1, state=state)
        assert rest == full[k:], f"resume after batch {k} differs"


def test_too_long_counted_once_per_epoch_across_resume(dataset):
    bucket = BucketConfig(max_batch_seconds=3.0, chunk_mb=0.05, num_buckets=4)
    n_long = sum(d > 3.0 for d in DURS)
    assert n_long > 0
    full, states, loader = run(dataset, epochs=2, bucket=bucket)
    assert loader.stats()["too_long"] == 2 * n_long
    keys = {k for b in full for k in b[0]}
    assert len(keys) == len(DURS) - n_long
    _, _, resumed = run(dataset, epochs=2, bucket=bucket, state=states[2])
    assert resumed.stats()["too_long"] == 2 * n_long, "a resume must not count an epoch's long utterances twice"


def test_resume_refuses_foreign_state(dataset):
    _, states, _ = run(dataset, n=2)
    bad = dict(states[-1], dataset="0" * 16)
    with pytest.raises(StreamError, match="different dataset"):
        build_loader(dataset, world=World(), seed=0, cfg=cfg(), state=bad)
    with pytest.raises(StreamError, match="stream.bucket"):
        build_loader(dataset, world=World(), seed=0, state=states[-1],
                     cfg=cfg(bucket=BucketConfig(max_batch_seconds=9.0, chunk_mb=0.05, num_buckets=4)))
    with pytest.raises(StreamError, match="seed"):
        build_loader(dataset, world=World(), seed=1, cfg=cfg(), state=states[-1])


def test_elastic_resume_restripes_rest_of_epoch(dataset):
    two = [run(dataset, world=World(rank=r, world_size=2), n=3) for r in range(2)]
    done = [k for batches, _, _ in two for b in batches for k in b[0]]
    state = two[0][1][-1]
    rest = [run(dataset, world=World(rank=r, world_size=3), state=state)[0] for r in range(3)]
    assert len({len(b) for b in rest}) == 1
    later = [k for batches in rest for b in batches for k in b[0]]
    assert len(done) + len(later) == len(set(done + later)) == len(DURS)


def _corrupt_member(dataset, tmp_path, *, truncate=False):
    out = tmp_path / "ds"
    shutil.copytree(dataset, out)
    idx = open_dataset(str(out)).read_index().to_pylist()
    if truncate:
        last = max(r["shard"] for r in idx)
        name = f"shard-{last:06d}.tar"
        victims = [r for r in idx if r["shard"] == last]
        cut = victims[len(victims) // 2]["offset"] + 700
        with open(out / name, "r+b") as f:
            f.truncate(cut)
        lost = {r["key"] for r in victims if r["offset"] + r["size"] > cut}
        return str(out), lost
    row = idx[len(idx) // 2]
    with open(out / f"shard-{row['shard']:06d}.tar", "r+b") as f:
        f.seek(row["audio_offset"] + 100)  # past the FLAC header: garble frames
        f.write(os.urandom(min(4000, row["audio_size"] - 120)))
        f.seek(row["audio_offset"])
        f.write(b"XXXX")  # and the magic, so libsndfile refuses it outright
    return str(out), {row["key"]}


def test_corrupt_flac_member_skipped_and_recorded(dataset, tmp_path):
    url, bad = _corrupt_member(dataset, tmp_path)
    batches, _, loader = run(url)
    keys = {k for b in batches for k in b[0]}
    assert keys == set(all_keys(url)) - bad
    stats = loader.stats()
    assert stats["skipped"] == 1 and stats["skipped_keys"][0]["key"] in bad
    assert stats["skipped_keys"][0]["reason"].startswith("decode_error")
    with pytest.raises(StreamError, match=next(iter(bad))):
        run(url, strict=True)


def test_truncated_shard_skipped_and_recorded(dataset, tmp_path):
    url, lost = _corrupt_member(dataset, tmp_path, truncate=True)
    assert lost
    batches, _, loader = run(url)
    keys = {k for b in batches for k in b[0]}
    assert keys == set(all_keys(url)) - lost
    reasons = {e["reason"].split(":")[0] for e in loader.stats()["skipped_keys"]}
    assert loader.stats()["skipped"] == len(lost) and reasons <= {"truncated_shard", "decode_error"}
    with pytest.raises(StreamError):
        run(url, strict=True)


@pytest.mark.parametrize("truncate", [False, True])
def test_mapped_and_read_shards_give_the_same_batches_and_skips(dataset, tmp_path, truncate):
    """map_local (the decoder reads a memory map of the shard) and reads into a buffer are one path with two
    sources: bit-identical batches, the same skipped keys with the same reasons, on a clean, a corrupt and a
    truncated dataset; and the mapped path really maps (a read of the shard file would go through fill_range)."""
    from unittest import mock

    from shardtrain import storage

    runs = {}
    for url in (dataset, _corrupt_member(dataset, tmp_path / str(truncate), truncate=truncate)[0]):
        for mapped in (True, False):
            with mock.patch.object(storage, "fill_range", wraps=storage.fill_range) as reads:
                batches, _, loader = run(url, map_local=mapped)
            assert reads.called != mapped
            skips = sorted((e["key"], e["reason"]) for e in loader.stats()["skipped_keys"])
            runs[(url, mapped)] = (batches, skips)
        assert runs[(url, True)] == runs[(url, False)]
    assert runs[(dataset, True)][1] == [] and len({u for u, _ in runs}) == 2
    assert any(skips for (u, _), (_, skips) in runs.items() if u != dataset)


def test_missing_shard_stops_loudly_naming_the_url(dataset, tmp_path):
    """A missing shard is not bad data: the loader raises at once (no retries, no skipped rows) and names it."""
    out = tmp_path / "ds"
    shutil.copytree(dataset, out)
    os.remove(out / "shard-000002.tar")
    t0 = time.monotonic()
    with pytest.raises(StreamError, match=r"shard-000002\.tar: shard missing") as err:
        run(str(out), retry_backoff_s=5.0)
    assert time.monotonic() - t0 < 4.0, "a hopeless error was retried"
    assert str(out / "shard-000002.tar") in str(err.value)


def test_stops_when_over_max_skipped_share(dataset, tmp_path):
    """One corrupt member of ~90 is tolerated at a 2% share, but stops the epoch at the 1% default; a dataset
    whose every shard is corrupt stops long before its epoch ends."""
    url, bad = _corrupt_member(dataset, tmp_path)
    got, _, loader = run(url, max_skipped_share=0.02)
    assert loader.stats()["skipped"] == 1
    with pytest.raises(StreamError, match=r"1 of ~\d+ samples of epoch 0 skipped as bad data.*max_skipped_share"):
        run(url, max_skipped_share=0.01)
    garbled = tmp_path / "garbled"
    shutil.copytree(dataset, garbled)
    for tar in garbled.glob("*.tar"):
        tar.write_bytes(b"\xff" * tar.stat().st_size)
    batches = []
    with pytest.raises(StreamError, match="skipped as bad data"):
        for b, _ in build_loader(str(garbled), world=World(), seed=0, cfg=StreamConfig(
                bucket=BucketConfig(max_batch_seconds=8.0, chunk_mb=0.05, num_buckets=4), epochs=1)):
            batches.append(b)
    assert sum(len(b) for b in batches) == 0


def test_memory_bounded_over_epochs(dataset):
    loader = build_loader(dataset, world=World(), seed=0, cfg=cfg(epochs=12))
    proc = psutil.Process()
    rss, steps = [], loader.steps_per_epoch()
    for i, (batch, state) in enumerate(loader):
        if (i + 1) % steps == 0:
            rss.append(proc.memory_info().rss)
    assert len(rss) >= 11
    growth_mb = (rss[-1] - rss[1]) / 2**20
    assert growth_mb < 40, f"RSS grew {growth_mb:.1f} MB over 10 epochs"


def test_shard_content_is_data_not_code(tmp_path):
    """Transcripts that look like code come back verbatim and are never evaluated (invariant 8)."""
    canary = tmp_path / "canary"
    canary.write_text("alive")
    evil = f"__import__('os').remove({str(canary)!r})"
    corpus = make_corpus(tmp_path / "c", [3.0, 3.1, 3.2], text_fn=lambda i: evil)  # ~3 s: a path-long transcript is speakable
    pack(PackConfig(input=str(corpus), output=str(tmp_path / "ds"), workers=1, progress=False))
    batches, _, _ = run(str(tmp_path / "ds"))
    assert [t for b in batches for t in b[3]] == [evil] * 3
    assert canary.exists()


def test_abandoned_loader_stops_its_threads(dataset):
    """Leaving an epoch early (a resume test, a trainer hitting max_steps) must not leave a reader thread waiting
    forever on a decode the shut-down pool will never run: that hung interpreter exit."""
    import threading
    import time

    for _ in range(5):  # the race needs the pool to shut down while a prefetched chunk is still being read
        it = iter(build_loader(dataset, world=World(), seed=0, cfg=cfg(prefetch_chunks=4, decode_threads=1)))
        next(it)
        it.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        alive = [t.name for t in threading.enumerate() if t.name.startswith(("read", "decode"))]
        if not alive:
            break
        time.sleep(0.05)
    assert not alive, f"loader threads still running after close: {alive}"

