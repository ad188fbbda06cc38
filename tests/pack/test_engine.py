"""engine: the local pool splits shards into slices (issue 32) without changing a byte of the dataset.

A corpus of one shard (the default 256 MiB target) with kept FLAC, transcoded stereo 22.05 kHz WAV (stored
durations differ from the probed ones, so the shard's sort happens after encoding) and files that fail only when
decoded (rejects recorded in the shard's marker, in layout order) packs to the same shards, index, rejects and
manifest with 1 worker (no slicing), 2 and 3 workers, whole shards or slices of a sample or two, whichever parts
the driver scanned while the pool started.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from shardtrain.pack import engine
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.pack.shard_task import SampleSpec
from shardtrain.testing.corpus import make_corpus, synth_wave


def _mixed_corpus(root: Path) -> Path:
    flac = make_corpus(root / "flac", [0.25 * (1 + (i * 7) % 13) for i in range(16)], seed=3)
    audio = root / "audio"
    audio.mkdir()
    recs = [{"id": p.stem, "path": str(p), "text": f"kept {p.stem}"} for p in sorted(flac.glob("*.flac"))]
    for i in range(6):  # transcoded: 22.05 kHz stereo -> 16 kHz mono FLAC
        x = synth_wave(0.3 + 0.45 * i, 22050, seed=10 + i)
        sf.write(audio / f"st{i}.wav", np.stack([x, x // 2], axis=1), 22050)
        recs.append({"id": f"st{i}", "path": str(audio / f"st{i}.wav"), "text": f"stereo {i}"})
    for i, src in enumerate(("utt-00003.flac", "utt-00011.flac")):  # headers fine, audio cut: an encode reject
        full = (flac / src).read_bytes()
        (audio / f"trunc{i}.flac").write_bytes(full[: len(full) * 2 // 3])
        recs.append({"id": f"trunc{i}", "path": str(audio / f"trunc{i}.flac"), "text": "truncated"})
    path = root / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _dataset(out: Path) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}
    m = json.loads(files.pop("manifest.json"))
    m.pop("created_utc")
    files["manifest.json"] = json.dumps(m, sort_keys=True).encode()
    return files


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    return _mixed_corpus(tmp_path_factory.mktemp("mixed"))


def test_one_shard_is_the_same_bytes_for_any_workers_and_slices(mixed, tmp_path, monkeypatch):
    def run(name: str, workers: int) -> dict[str, bytes]:  # parts of 3 items: scanned here and in the pool
        pack(PackConfig(input=str(mixed), output=str(tmp_path / name), workers=workers, progress=False,
                        part_items=256 if workers == 1 else 3))
        return _dataset(tmp_path / name)

    ref = run("w1", 1)
    assert [n for n in ref if n.startswith("shard-")] == ["shard-000000.tar"]  # the case: one shard
    rejects = [json.loads(x) for x in ref["rejects.jsonl"].splitlines()]
    assert [(r["id"], r["reason"]) for r in rejects] == [("trunc0", "truncated_audio"), ("trunc1", "truncated_audio")]
    assert json.loads(ref["manifest.json"])["totals"]["samples"] == 22
    seen: list[int] = []
    real = engine.LocalEngine._bounded

    def spy(self, fn, args, what):
        for res in real(self, fn, args, what):
            if what == "writing shards":
                seen.append(res[0])
            yield res

    monkeypatch.setattr(engine.LocalEngine, "_bounded", spy)
    default = engine.SLICE_BYTES
    for workers, slice_bytes, n_slices in ((2, default, 1), (2, 1, 24), (3, 40_000, None)):
        monkeypatch.setattr(engine, "SLICE_BYTES", slice_bytes)
        seen.clear()
        got = run(f"w{workers}-{slice_bytes}", workers)
        assert got.keys() == ref.keys()
        for name in ref:
            assert got[name] == ref[name], (workers, slice_bytes, name)
        assert set(seen) == {0}  # every slice came from the one shard: one, one per sample, a few samples each
        assert len(seen) == n_slices if n_slices else 1 < len(seen) < 24, (slice_bytes, len(seen))


def _samples(est: list[int]) -> list[SampleSpec]:
    return [SampleSpec(key=str(i), item=None, info=None, duration_s=1.0, est_bytes=b)  # type: ignore[arg-type]
            for i, b in enumerate(est)]


@pytest.mark.parametrize("est,target,want", [
    ([10] * 10, 30, [(0, 3), (3, 6), (6, 9), (9, 10)]),
    ([10] * 9, 30, [(0, 3), (3, 6), (6, 9)]),
    ([100, 1, 1, 100], 50, [(0, 1), (1, 4)]),
    ([5], 1 << 20, [(0, 1)]),
    ([], 10, [(0, 0)]),
])
def test_slices_cover_the_shard_in_order(est, target, want):
    got = engine.slices(_samples(est), target)
    assert got == want
    assert [a for a, _ in got[1:]] == [b for _, b in got[:-1]] and got[-1][1] == len(est)


def test_whole_shards_then_a_sliced_tail_are_the_same_bytes(mixed, tmp_path, monkeypatch):
    """5 shards, 2 workers: shard 0 goes to a worker whole, the last TAIL_SHARDS x 2 = 4 are cut into slices of
    one sample; the dataset is the one 1 worker writes."""
    def run(name: str, workers: int) -> dict[str, bytes]:
        pack(PackConfig(input=str(mixed), output=str(tmp_path / name), workers=workers, progress=False,
                        max_samples_per_shard=5))
        return _dataset(tmp_path / name)

    ref = run("w1", 1)
    assert len([n for n in ref if n.startswith("shard-")]) == 5
    monkeypatch.setattr(engine, "SLICE_BYTES", 1)
    kinds: list[tuple[int, bool]] = []
    real = engine.LocalEngine._bounded

    def spy(self, fn, args, what):
        for res in real(self, fn, args, what):
            if what == "writing shards":
                kinds.append((res[0], res[1] is None))
            yield res

    monkeypatch.setattr(engine.LocalEngine, "_bounded", spy)
    got = run("w2", 2)
    assert got == ref
    assert sorted(s for s, whole in kinds if whole) == [0]
    assert sorted({s for s, whole in kinds if not whole}) == [1, 2, 3, 4] and len(kinds) == 1 + 19


def test_forked_and_forkserver_pools_write_the_same_bytes(mixed, tmp_path, monkeypatch):
    """A local INPUT and OUTPUT on Linux get a forked pool (started at once: every part is scanned in it); any
    other pack a forkserver pool (the driver scans parts while it starts); both write the dataset 1 worker does."""
    import sys

    from shardtrain.pack import packer

    def run(name: str, workers: int, fork: bool) -> dict[str, bytes]:
        monkeypatch.setattr(packer, "_engine", lambda cfg: engine.LocalEngine(cfg.workers, fork=fork))
        pack(PackConfig(input=str(mixed), output=str(tmp_path / name), workers=workers, progress=False,
                        part_items=3, max_samples_per_shard=7))
        return _dataset(tmp_path / name)

    real = packer._engine
    linux = sys.platform.startswith("linux")
    monkeypatch.setattr(packer.threading, "active_count", lambda: 1)  # as in `shardtrain pack` (the suite has threads)
    assert real(PackConfig(input=str(mixed), output=str(tmp_path / "x"), workers=2)).fork is linux
    assert real(PackConfig(input=str(mixed), output="s3://bucket/x", workers=2)).fork is False
    assert real(PackConfig(input="s3://bucket/in.jsonl", output=str(tmp_path / "x"), workers=2)).fork is False
    monkeypatch.setattr(packer.threading, "active_count", lambda: 2)  # a caller's thread alive: no fork
    assert real(PackConfig(input=str(mixed), output=str(tmp_path / "x"), workers=2)).fork is False
    monkeypatch.undo()
    ref = run("w1", 1, False)
    assert len([n for n in ref if n.startswith("shard-")]) == 4
    assert run("fork", 2, True) == ref
    assert run("forkserver", 2, False) == ref


def test_a_forked_pool_freezes_the_callers_objects_until_close():
    """Before forking its pool LocalEngine moves every existing object out of the collector's passes (gc.freeze:
    the workers' collections would otherwise copy the caller's whole heap), and close gives them back, so a
    library caller's cycles are collected again after the pack; a forkserver pool freezes nothing, and a caller
    that froze objects itself keeps them frozen."""
    import gc

    assert gc.get_freeze_count() == 0
    for fork in (True, False):
        eng = engine.LocalEngine(2, fork=fork)
        try:
            eng.start_workers()
            assert (gc.get_freeze_count() > 0) is fork
        finally:
            eng.close()
        assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        eng = engine.LocalEngine(2, fork=True)
        eng.start_workers()
        eng.close()
        assert gc.get_freeze_count() > frozen // 2  # still frozen (the count drops as frozen objects are freed)
    finally:
        gc.unfreeze()


def test_close_unfreezes_the_callers_objects_even_when_the_pool_shutdown_is_interrupted(monkeypatch):
    """A Ctrl-C while close waits for the pool must not leave the caller's objects frozen for the rest of the
    process (later engines see a frozen heap and never unfreeze it). Fault injected: shutdown interrupted."""
    import gc

    assert gc.get_freeze_count() == 0
    eng = engine.LocalEngine(2, fork=True)
    eng.start_workers()
    pool = eng._pool
    real = pool.shutdown

    def interrupted(*a, **kw):
        real(*a, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(pool, "shutdown", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.close()
    assert gc.get_freeze_count() == 0
