"""Shared machines and crafted caches (issue 21): index copies keyed by the index bytes and re-checked when opened,
checkpoints that read only their own rank files, one taker of a stale lock. (Private per-user folders against a
real second user: test_private.py; the shard cache: test_cache.py.)"""
from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardtrain.format.manifest import open_dataset
from shardtrain.load.blockplan import Blocks
from shardtrain.load.mapped import mapped_blocks, open_mapped
from shardtrain.load.plan import BucketConfig
from shardtrain.train import checkpoint as ckpt
from shardtrain.world import World


def _edit_index(url: str, edit) -> None:
    p = Path(url) / "index.parquet"
    t = pq.read_table(p)
    pq.write_table(edit(t), p, row_group_size=1000, compression="zstd")


def test_index_copy_is_keyed_by_the_index_bytes_not_only_the_manifest(index_dataset, tmp_path):
    cache = tmp_path / "cache"
    first = open_mapped(open_dataset(index_dataset), str(cache), text=True)
    assert first.idx.string_at("text", 7) == "SOME WORDS"

    def retext(t):
        texts = t.column("text").to_pylist()
        texts[7] = "OTHER WORDS"
        return t.set_column(t.column_names.index("text"), "text", pa.array(texts))
    _edit_index(index_dataset, retext)  # manifest.json unchanged
    second = open_mapped(open_dataset(index_dataset), str(cache), text=True)
    assert second.folder != first.folder
    assert second.idx.string_at("text", 7) == "OTHER WORDS"
    assert second.meta["source"]["index_bytes"] == os.path.getsize(Path(index_dataset) / "index.parquet")


def test_a_copy_changed_after_it_was_built_is_rebuilt_not_used(index_dataset, tmp_path, caplog):
    """A crafted copy (every duration 0.01 s) would put ~100 rows of up to 15 s into a 20 s budget: it is caught
    by the check at open and rebuilt from the index; a crafted block table is caught against the durations."""
    cache = tmp_path / "cache"
    ds = open_dataset(index_dataset)
    mi = open_mapped(ds, str(cache), text=False)
    truth = pq.read_table(Path(index_dataset) / "index.parquet", columns=["duration_s"]).column(0).to_numpy()
    path = mi.folder / "duration_s.npy"
    arr = np.load(path)
    with open(path, "r+b") as f:  # same size, same header: only the values change
        f.seek(os.path.getsize(path) - arr.nbytes)
        f.write(np.full_like(arr, 0.01).tobytes())
    with caplog.at_level(logging.WARNING):
        again = open_mapped(ds, str(cache), text=False)
    assert "fails its check (duration_s.npy changed since it was built)" in caplog.text
    assert np.array_equal(np.asarray(again.idx.duration_s), truth)

    cfg = BucketConfig(max_batch_seconds=20.0)
    honest = mapped_blocks(again, cfg, 30.0, 64)
    blocks_file = next(again.folder.glob("blocks-*.npz"))
    crafted = {f: getattr(honest, f) for f in Blocks.__slots__}  # type: ignore[attr-defined]
    crafted["cost"] = crafted["cost"] / 100
    np.savez(blocks_file, **crafted)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        b = mapped_blocks(again, cfg, 30.0, 64)
    assert "disagree with the index's durations" in caplog.text
    assert np.array_equal(b.cost, honest.cost) and float(b.cost.max()) > 20.0 / 100


def test_open_check_costs_are_within_bounds(index_dataset, tmp_path):
    """The check reads the budget-critical columns in full and samples the rest: a changed byte in a sampled file
    far from the sampled pages is not seen (documented), one in a budget column always is."""
    mi = open_mapped(open_dataset(index_dataset), str(tmp_path / "c"), text=True)
    full = {n for n, (_, _, f) in mi.meta["files"].items() if f}
    assert full == {"duration_s.npy", "num_samples.npy", "channels.npy", "size.npy"}


def _rank_state(tag: str, rank: int) -> dict:
    return {"loader_state": json.dumps({"tag": tag, "rank": rank}), "rng_cpu": torch.get_rng_state(),
            "rng_cuda": None}


def _save_all(url: str, step: int, world: int, tag: str, so: dict) -> None:
    barrier = threading.Barrier(world)
    errors: list[BaseException] = []

    def agree(bad: bool) -> bool:  # threads standing in for ranks: the barrier orders the stages, each its own flag
        barrier.wait()
        return bad

    def rank(r: int) -> None:
        try:
            parts = ckpt.CheckpointParts(step=step, rank_state=_rank_state(tag, r),
                                         main_state={"step": step} if r == 0 else None,
                                         model_state={"w": torch.zeros(2)} if r == 0 else None, meta={"val_loss": None})
            ckpt.save_checkpoint(url, parts, world=World(rank=r, world_size=world), keep_last=3, storage_options=so,
                                 agree=agree)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.s3
def test_s3_checkpoint_reads_only_the_rank_files_its_meta_names(s3, s3_bucket):
    """World 4 dies writing step 20 (its rank files are up, meta.json is not); the job shrinks to 2, resumes and
    commits step 20 again; then it regrows to 4. Ranks 2 and 3 must not load the dead attempt's files."""
    from shardtrain import storage

    so = s3.storage_options
    url = f"{s3_bucket}/run/checkpoints"
    step = storage.join(url, ckpt.step_dir_name(20))
    for r in range(4):  # the dead attempt's uploads
        buf = io.BytesIO()
        torch.save(_rank_state("dead", r), buf)
        storage.atomic_write_bytes(storage.join(step, f"rank{r:05d}.pt"), buf.getvalue(), so)
    _save_all(url, 20, 2, "committed", so)

    latest = ckpt.latest_checkpoint(url, so)
    meta = ckpt.read_meta(latest, so)
    assert meta["rank_files"] == ["rank00000.pt", "rank00001.pt"]
    assert "rank00003.pt" not in storage.ls_names(step, so)  # the stray is removed on commit
    storage.atomic_write_bytes(storage.join(step, "rank00003.pt"), b"stray again", so)  # and ignored if it is back
    for r in range(4):
        state = ckpt.load_checkpoint(latest, rank=r, world_size=4, storage_options=so)["rank"]
        assert json.loads(state["loader_state"]) == {"tag": "committed", "rank": r if r < 2 else 0}
        assert (state["rng_cpu"] is None) == (r >= 2)


def _thread_race(url: str, so: dict | None, plant, rounds: int, n: int = 6) -> list[int]:
    """`rounds` times: plant a stale lock (a dead process of this host), let `n` threads released by one barrier
    take it over; returns the number of winners per round (each winner holds the lock until all have tried)."""
    import socket

    from shardtrain.storage.lock import LockHeld, acquire_lock

    p = subprocess.Popen(["true"])
    p.wait()
    winners = []
    for i in range(rounds):
        plant(json.dumps({"host": socket.gethostname(), "pid": p.pid, "purpose": "pack", "token": f"{i:032x}",
                          "time_utc": "2026-01-01T00:00:00Z"}).encode())
        start, done = threading.Barrier(n), threading.Barrier(n)
        won: list = []

        def take() -> None:
            start.wait()
            try:
                won.append(acquire_lock(url, so))
            except LockHeld:
                pass
            done.wait()

        threads = [threading.Thread(target=take) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners.append(len(won))
        for lock in won:
            lock.release()
    return winners


def test_exactly_one_thread_takes_over_a_stale_local_lock(tmp_path):
    url = str(tmp_path / "out")
    os.makedirs(url)
    got = _thread_race(url, None, lambda data: Path(url, "_pack.lock").write_bytes(data), rounds=30)
    assert got == [1] * 30, got
    assert [p.name for p in Path(url).iterdir()] == []  # no claim or lock left once released


@pytest.mark.s3
def test_exactly_one_thread_takes_over_a_stale_s3_lock(s3, s3_bucket):
    from shardtrain import storage

    url, so = f"{s3_bucket}/out", s3.storage_options
    got = _thread_race(url, so, lambda data: storage.atomic_write_bytes(f"{url}/_pack.lock", data, so), rounds=3)
    assert got == [1] * 3, got
