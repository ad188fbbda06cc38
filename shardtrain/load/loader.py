"""Streaming loader: planned batches read from shards on disk or S3, with exact resume.

    manifest.json + index.parquet (numeric columns only)            -> PlanIndex (~40 B/row, shared by workers)
      -> plan_epoch(seed, epoch, world_size, BucketConfig)          -> groups of chunks, batches fixed per chunk
      -> this rank's chunks; DataLoader worker w takes chunk j when (j + chunks before) % num_workers == w
      -> read_chunk: one ranged read per byte run (retry + resume at byte reached; optional local shard cache)
      -> decode: libsndfile in a thread pool straight into batch rows (no GIL: audio.decode_into)
      -> ChunkBatches: per batch int16 [B, T] + lengths + keys/texts (half the bytes of float32 across IPC)
      -> Loader (main process): float32 [B, T] zero-padded (pinned when CUDA exists) -> (Batch, state)

Why threads, and why whole chunks per worker item: decoding in a thread pool inside one process reaches the
decode-only limit without the inter-process copy (stack.md), so `num_workers=0` with `decode_threads=3` is the
default; with worker processes, each DataLoader item is one chunk's batches, so DataLoader's round-robin over
workers yields chunks in plan order whatever `num_workers` is. The state is a cursor (epoch, step) kept by the
main process, never by workers, so a checkpoint cannot run ahead of the trainer.

A resume with a different world size re-plans only the rest of the epoch: rows consumed under the old world
size are recomputed from the (pure) plan and excluded (`chain` in the state).

Two planners (StreamConfig.planner): `plan_epoch` over the whole index held by every rank (~70 B a row), or,
from `block_plan_min_rows` rows, `blockplan` over a node-shared memory map of the index (load/mapped.py): every
rank plans the same block table and deals only its own groups, one at a time, so memory and start-up per rank do
not grow with the corpus (benchmarks/bench_block_loader.py).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Callable, Generator, Iterator

import numpy as np
import torch

from shardtrain import storage
from shardtrain.format.manifest import Dataset, open_dataset
from shardtrain.load.blockplan import Blocks, block_epoch, block_shape, chunks_from, plan_blocks
from shardtrain.load.mapped import default_root, mapped_blocks, open_mapped
from shardtrain.load.plan import PLAN_COLUMNS, BucketConfig, Chunk, EpochPlan, PlanIndex, consumed_rows, cost_s, plan_epoch
from shardtrain.load.reader import CHECK_COLUMNS, ChunkBatches, ChunkReader, StreamError
from shardtrain.world import World
from shardtrain.load.batch import Batch
from shardtrain.load.config import StreamConfig

log = logging.getLogger(__name__)

STATE_VERSION = 1
PRESIGN_AHEAD = 1024
"""Shards signed in the main process before DataLoader workers fork (~0.25 ms each), so a worker needs no S3
client of its own to start; later shards are signed in the worker when first read."""


# ---------------------------------------------------------------------------------------------- planning
def epoch_plan(idx: PlanIndex, seed: int, epoch: int, world_size: int, cfg: BucketConfig,
               chain: list[list[int]] | tuple = ()) -> EpochPlan:
    """The plan for `epoch`, after excluding rows consumed under earlier world sizes (`chain` of [ws, steps])."""
    exclude = None
    for ws, steps in chain:
        prev = plan_epoch(idx, seed=seed, epoch=epoch, world_size=ws, cfg=cfg, exclude=exclude)
        mask = np.zeros(len(idx), bool) if exclude is None else exclude.copy()
        mask[consumed_rows(prev, steps)] = True
        exclude = mask
    return plan_epoch(idx, seed=seed, epoch=epoch, world_size=world_size, cfg=cfg, exclude=exclude)


def _refuse_empty_plan(url: str, rows: int, too_long: int, world: World, cfg: BucketConfig) -> None:
    """Raise StreamError at build time when no epoch can hold a batch (an empty index, or every utterance over
    the budget): iterating would otherwise plan empty epochs forever and a trainer would never step."""
    usable = rows - too_long
    if usable == 0:
        why = "its index has no rows" if rows == 0 else \
            f"all {rows} utterances are longer than stream.bucket.max_batch_seconds={cfg.max_batch_seconds:g}"
        raise StreamError(f"{url}: no batch can be planned: {why}; raise max_batch_seconds or use another dataset")
    if usable < world.world_size:
        raise StreamError(f"{url}: {usable} usable samples for {world.world_size} ranks: every rank needs at least "
                          "one; use fewer ranks or a larger dataset")


@dataclass(frozen=True, slots=True)
class _Cursor:
    epoch: int
    step: int
    chain: tuple = ()


IndexSource = PlanIndex | Callable[[int], PlanIndex]
"""One index for every epoch, or one per epoch (a mixture's virtual rows: load/mixloader.py)."""


def index_at(idx: IndexSource, epoch: int) -> PlanIndex:
    return idx(epoch) if callable(idx) else idx


def _rank_chunks(idx: PlanIndex, blocks: Blocks | None, seed: int, epoch: int, world: World, cfg: BucketConfig,
                 chain: tuple, step: int) -> Iterator[tuple[int, Chunk]]:
    """(first step, chunk) of this rank's chunks in `epoch` that end after `step`, from either planner."""
    if blocks is not None:
        cost_of = lambda rows: cost_s(np.asarray(idx.duration_s[rows]), cfg)  # noqa: E731
        bplan, gone = block_epoch(blocks, cost_of, seed=seed, epoch=epoch, world_size=world.world_size, cfg=cfg,
                                  chain=chain)
        if bplan.steps == 0 and not chain:
            raise StreamError(f"epoch {epoch} has no batch to plan (every sample excluded); stopping")
        yield from chunks_from(bplan, blocks, cost_of, world.rank, seed, gone, step)
        return
    plan = epoch_plan(idx, seed, epoch, world.world_size, cfg, chain)
    if plan.steps == 0 and not chain:  # a full epoch without a batch: every later one is the same
        raise StreamError(f"epoch {epoch} has no batch to plan (every sample excluded); stopping")
    first = 0
    for chunk in plan.rank_chunks(world.rank):
        if first + len(chunk.batches) > step:
            yield first, chunk
        first += len(chunk.batches)


def _chunk_schedule(idx: IndexSource, seed: int, world: World, cfg: StreamConfig, start: _Cursor,
                    blocks: Blocks | None = None) -> Iterator[tuple[int, int, Chunk, int]]:
    """(epoch, first step of chunk, chunk, batches to skip) for this rank from `start`, in plan order."""
    epoch, step, chain = start.epoch, start.step, start.chain
    while cfg.epochs is None or epoch < cfg.epochs:
        for first, chunk in _rank_chunks(index_at(idx, epoch), blocks, seed, epoch, world, cfg.bucket, chain, step):
            yield epoch, max(first, step), chunk, max(0, step - first)
        epoch, step, chain = epoch + 1, 0, ()


class ChunkStream(torch.utils.data.IterableDataset):
    """IterableDataset over this rank's chunks; each item is one chunk's batches (`ChunkBatches`).

    Use with `DataLoader(ds, batch_size=None, num_workers=N)`; worker w loads the chunks at positions
    w, w+N, ... of the schedule, so DataLoader's round-robin yields them in schedule order.
    """

    def __init__(self, ds: Dataset, idx: IndexSource, seed: int, world: World, cfg: StreamConfig, start: _Cursor,
                 blocks: Blocks | None = None):
        self.ds, self.idx, self.seed, self.world, self.cfg, self.start = ds, idx, seed, world, cfg, start
        self.blocks = blocks

    def __iter__(self) -> Iterator[ChunkBatches]:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        reader = ChunkReader(self.ds, index_at(self.idx, self.start.epoch), self.cfg)
        pending: list[Future] = []
        sched = _chunk_schedule(self.idx, self.seed, self.world, self.cfg, self.start, self.blocks)
        mine = ((j, item) for j, item in enumerate(sched) if j % nw == wid)
        try:
            for j, (epoch, first, chunk, skip) in mine:
                as_float = info is None and self.cfg.pcm_dtype == "float32"
                rd = reader
                if callable(self.idx):  # a per-epoch index: a view of the reader (same pools) over this epoch's
                    rd = copy.copy(reader)
                    rd.idx = self.idx(epoch)
                pending.append(reader.io_pool.submit(rd.load, chunk, epoch, first, skip, as_float, j))
                if len(pending) >= self.cfg.prefetch_chunks:
                    yield pending.pop(0).result()
            while pending:
                yield pending.pop(0).result()
        finally:
            for f in pending:
                f.cancel()
            reader.io_pool.shutdown(wait=False, cancel_futures=True)
            reader.decode_pool.shutdown()


# ---------------------------------------------------------------------------------------------- loader
def _cfg_fingerprint(cfg: BucketConfig) -> str:
    return json.dumps(asdict(cfg), sort_keys=True)


class Loader:
    """Iterate `(Batch, state)`; `build_loader(..., state=state)` resumes at the batch after `state`'s.

    The state is a small JSON-able cursor: {version, dataset, bucket config, seed, world_size, epoch, step,
    chain, counters}. It is the same on every rank (counters aside), so any rank's copy resumes all of them.
    """

    blocks: Blocks | None = None
    """The block table when planning by blocks (StreamConfig.planner); None plans rows (plan_epoch)."""

    def __init__(self, url: str, *, world: World, seed: int, cfg: StreamConfig, state: dict | None = None,
                 storage_options: dict | None = None):
        self.world, self.seed, self.cfg = world, seed, cfg
        self.ds = open_dataset(url, storage_options, direct_http=cfg.s3_direct_http, budget_s=cfg.retry_budget_s)
        rows = sum(s.samples for s in self.ds.shards)
        if cfg.planner == "blocks" or (cfg.planner == "auto" and rows >= cfg.block_plan_min_rows):
            mi = open_mapped(self.ds, cfg.index_cache_dir or default_root(), text=cfg.check_transcripts)
            self.idx, self.fingerprint, rates = mi.idx, mi.meta["fingerprint"], np.asarray(mi.meta["sample_rates"])
            block_s, block_rows = block_shape(float(self.ds.totals.get("seconds", 0.0)), rows,
                                              cfg.bucket.batches_per_chunk, cfg.block_s)
            self.blocks = mapped_blocks(mi, cfg.bucket, block_s, block_rows)
            log.info("%s: %d rows, planned by %d blocks of <= %.0f s and %d rows (index memory-mapped in %s)", url,
                     rows, len(self.blocks), block_s, block_rows, mi.folder)
        else:
            checks = [c for c in CHECK_COLUMNS if cfg.check_transcripts or c != "text"]
            table = self.ds.read_index(columns=list(PLAN_COLUMNS) + ["sample_rate_hz", *checks])
            rates = np.unique(table.column("sample_rate_hz").to_numpy())
            self.idx = PlanIndex.from_table(table)
            self.fingerprint = self.idx.fingerprint()
        if len(rates) > 1:
            raise StreamError(f"{url} mixes sample rates {rates.tolist()}; repack with `shardtrain pack --sample-rate`")
        self.sample_rate_hz = int(rates[0]) if len(rates) else 16000
        self.counters = {"samples": 0, "audio_seconds": 0.0, "batches": 0, "skipped": 0, "too_long": 0}
        self.stage_s: dict[str, float] = {"read": 0.0, "parse": 0.0, "decode": 0.0, "batch": 0.0, "collate": 0.0}
        """Seconds per stage, summed over threads and workers (not part of the state: not reproducible)."""
        self.skipped_keys: list[dict] = []
        self._epoch_skips = (0, 0)
        """(epoch, samples skipped in it) for the max_skipped_share stop."""
        self.cursor = _Cursor(0, 0)
        self._bucket_fingerprint = _cfg_fingerprint(cfg.bucket)
        if state is not None:
            self._load_state(state)
        # the plan leaves out the same utterances every epoch (alone over budget): count them, no re-planning
        self.too_long_per_epoch = (int(self.blocks.rows[self.blocks.too_long].sum()) if self.blocks is not None else
                                   int((cost_s(self.idx.duration_s, cfg.bucket) > cfg.bucket.max_batch_seconds).sum()))
        _refuse_empty_plan(url, len(self.idx), self.too_long_per_epoch, world, cfg.bucket)
        if self.too_long_per_epoch:
            log.warning("%d utterances are longer than max_batch_seconds=%g and are left out of every epoch",
                        self.too_long_per_epoch, cfg.bucket.max_batch_seconds)

    # -- state
    def _load_state(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise StreamError(f"loader state version {state.get('version')!r} != {STATE_VERSION}; cannot resume")
        if state.get("dataset") != self.fingerprint:
            raise StreamError("loader state belongs to a different dataset (index fingerprint differs); "
                              "resume with the dataset the run started on")
        if state.get("bucket") != _cfg_fingerprint(self.cfg.bucket):
            raise StreamError("loader state was saved with a different stream.bucket config; "
                              f"saved {state.get('bucket')}, now {_cfg_fingerprint(self.cfg.bucket)}")
        if state.get("planner", "rows") != self.planner:
            raise StreamError(f"loader state was planned by {state.get('planner', 'rows')}, this run plans by "
                              f"{self.planner}; set stream.planner={state.get('planner', 'rows')} to resume it")
        if state.get("seed") != self.seed:
            raise StreamError(f"loader state has seed {state.get('seed')}, this run {self.seed}; use the same seed")
        chain = tuple(tuple(x) for x in state.get("chain", ()))
        epoch, step = int(state["epoch"]), int(state["step"])
        if state["world_size"] != self.world.world_size and step > 0:
            log.info("re-striping epoch %d: %d steps done with world size %d, continuing with %d",
                     epoch, step, state["world_size"], self.world.world_size)
            chain, step = chain + ((int(state["world_size"]), step),), 0
        self.cursor = _Cursor(epoch, step, chain)
        self.counters.update(state.get("counters", {}))
        self.skipped_keys = list(state.get("skipped_keys", []))

    def state_dict(self) -> dict:
        """State after the last yielded batch (resuming from it yields the next batch)."""
        c = self.cursor
        return {"version": STATE_VERSION, "dataset": self.fingerprint, "bucket": self._bucket_fingerprint,
                "seed": self.seed, "planner": self.planner, "world_size": self.world.world_size, "epoch": c.epoch,
                "step": c.step,
                "chain": [list(x) for x in c.chain], "counters": dict(self.counters),
                "skipped_keys": list(self.skipped_keys)}

    @property
    def planner(self) -> str:
        return "rows" if self.blocks is None else "blocks"

    def load_state_dict(self, state: dict) -> None:
        """torchdata/`Stateful` convention: the next iteration starts at the batch after `state`'s (same checks as
        `build_loader(..., state=state)`). Call it between iterations, not while one is running."""
        self.counters = {k: type(v)(0) for k, v in self.counters.items()}
        self.skipped_keys, self.cursor = [], _Cursor(0, 0)
        self._load_state(state)

    def batches(self) -> Iterator[Batch]:
        """Plain iterator of batches; `state_dict()` after each one is the state that resumes at the next."""
        for batch, _ in self:
            yield batch

    def stats(self) -> dict:
        return {**self.counters, "skipped_keys": list(self.skipped_keys)}

    def steps_per_epoch(self, epoch: int = 0) -> int:
        """Batches every rank yields in `epoch` (a full epoch; a re-striped one differs)."""
        if self.blocks is not None:
            return plan_blocks(self.blocks, seed=self.seed, epoch=epoch, world_size=self.world.world_size,
                               cfg=self.cfg.bucket).steps
        return epoch_plan(self.idx, self.seed, epoch, self.world.world_size, self.cfg.bucket).steps

    # -- iteration
    def dataloader(self) -> torch.utils.data.DataLoader:
        """The DataLoader settings that keep plan order: whole chunks per item, no batching, no sampler."""
        ds = self._chunk_stream()
        nw = self.cfg.num_workers
        if nw and self.cfg.s3_direct_http and not self.cfg.cache_dir and not storage.is_local(self.ds.url):
            storage.presign([self.ds.shard_url(s) for s in self._shards_ahead(PRESIGN_AHEAD)], self.ds.storage_options)
        return torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=nw, prefetch_factor=2 if nw else None, persistent_workers=False,
            multiprocessing_context="fork" if nw and os.name == "posix" else None)

    def _chunk_stream(self) -> ChunkStream:
        """This rank's chunks from the cursor on (read in this process, or by DataLoader workers)."""
        return ChunkStream(self.ds, self.idx, self.seed, self.world, self.cfg, self.cursor, self.blocks)

    def _shards_ahead(self, limit: int) -> list[int]:
        """Up to `limit` distinct shards in the order this rank reads them, from the cursor to the epoch's end."""
        seen: dict[int, None] = {}
        for epoch, _, chunk, _ in _chunk_schedule(self.idx, self.seed, self.world, self.cfg, self.cursor, self.blocks):
            if epoch != self.cursor.epoch or len(seen) >= limit:
                break
            for b in chunk.batches:
                seen.update(dict.fromkeys(np.unique(self.idx.shard[b]).tolist()))
        return list(seen)[:limit]

    def __iter__(self) -> Generator[tuple[Batch, dict], None, None]:
        pin = torch.cuda.is_available()
        # without worker processes the DataLoader only adds per-item overhead (~4% of a 2-core epoch, measured)
        items = self.dataloader() if self.cfg.num_workers else self._chunk_stream()
        for item in items:
            for k, v in item.timings.items():
                self.stage_s[k] += v
            for e in item.errors:
                self.counters["skipped"] += 1
                if len(self.skipped_keys) < self.cfg.max_error_keys:
                    self.skipped_keys.append(e)
                log.warning("skipped %s in %s: %s", e["key"], e["shard"], e["reason"])
            _skip_limit(self, item)
            for i, (pcm, lengths, keys, texts, durs) in enumerate(item.batches):
                t0 = time.perf_counter()
                if isinstance(pcm, torch.Tensor):
                    if self.cfg.pcm_dtype == "float32":  # int16 from a worker (numpy: ~10x faster than torch here)
                        pcm = np.multiply(pcm.numpy(), np.float32(1.0 / 32768.0), dtype=np.float32)
                waves = pcm if isinstance(pcm, torch.Tensor) else torch.from_numpy(pcm)
                if pin:
                    waves = waves.pin_memory()
                self.stage_s["collate"] += time.perf_counter() - t0
                step = item.first_step + i
                batch = Batch(waves=waves, lengths=torch.from_numpy(lengths), keys=keys, texts=texts,
                              durations_s=torch.from_numpy(durs), sample_rate_hz=self.sample_rate_hz,
                              epoch=item.epoch, step=step)
                self.counters["samples"] += len(keys)
                self.counters["audio_seconds"] += float(durs.sum())
                self.counters["batches"] += 1
                chain = self.cursor.chain if item.epoch == self.cursor.epoch else ()
                if step == 0 and not chain:  # once per epoch (a re-striped epoch counted it before)
                    self.counters["too_long"] += self.too_long_per_epoch
                self.cursor = _Cursor(item.epoch, step + 1, chain)
                yield batch, self.state_dict()


def _skip_limit(loader: Loader, item: ChunkBatches) -> None:
    """Raise StreamError once more than `max_skipped_share` of this rank's epoch was skipped as bad data.

    The epoch size is this rank's share of the index (rows over world size, too-long ones excluded); the count
    restarts each epoch (and on resume, so a resumed epoch may skip up to the share again)."""
    if not item.errors:
        return
    epoch, n = loader._epoch_skips
    n = (n if epoch == item.epoch else 0) + len(item.errors)
    loader._epoch_skips = (item.epoch, n)
    rows = max(1.0, (len(loader.idx) - loader.too_long_per_epoch) / loader.world.world_size)
    if n > loader.cfg.max_skipped_share * rows:
        last = item.errors[-1]
        raise StreamError(
            f"{loader.ds.url}: {n} of ~{rows:.0f} samples of epoch {item.epoch} skipped as bad data (over "
            f"stream.max_skipped_share={loader.cfg.max_skipped_share:g}); last: {last['key']} in {last['shard']}: "
            f"{last['reason']}; check the dataset with `shardtrain inspect --verify`, or raise the share")


def build_loader(url: str | list | tuple, *, world: World, seed: int, cfg: StreamConfig, state: dict | None = None,
                 storage_options: dict | None = None) -> Loader:
    """The loader for one rank. Reads manifest.json and index.parquet (numeric columns) once; no audio yet.

    `url` may be a list of datasets, each a URL or (URL, weight): a weighted mixture (load/mixloader.py)."""
    if isinstance(url, (list, tuple)):
        from shardtrain.load.mixloader import build_mixture

        return build_mixture(url, world=world, seed=seed, cfg=cfg, state=state, storage_options=storage_options)
    return Loader(url, world=world, seed=seed, cfg=cfg, state=state, storage_options=storage_options)
