"""Streaming loader: one Loader over any planner (load/planner.py), with exact and elastic resume.

    build_loader(url | [(url, weight), ...]) -> Planner: rows (plan_epoch, index in every rank), blocks
         (blockplan over a node-shared memory map, from block_plan_min_rows rows), or a weighted mixture of
         either (load/mixplan.py; a single dataset is the mixture of one: same seam, no selection step)
      -> schedule: this rank's RankChunks from the cursor on, epoch after epoch; the next epoch is planned in a
         background thread while this one is read, the very first chunk is split so one batch comes first
      -> ChunkStream: the schedule's reads, `prefetch_chunks` in flight in reader threads (plan order kept);
         read_chunk: ranged reads, checks, decode into batch rows in a thread pool (load/reader.py)
      -> Loader: Batch (float32 [B, T] or int16, pinned when CUDA exists; rows and sources of every utterance),
         the skip-share stop, counters (per-dataset seconds from the chunks' origins) -> state

Why threads and no worker processes: decoding in a thread pool inside one process reaches the decode-only limit
without the inter-process copy (stack.md); DataLoader workers measured 0.66-0.83x of it at twice the peak RSS
and were removed (StreamConfig.num_workers must stay 0). The state is a cursor (epoch, step, chain) kept by the
Loader, never by reader threads, so a checkpoint cannot run ahead of the trainer. After an epoch's last batch the
cursor moves to (next epoch, 0): a state saved there resumes under any bucket config.

A resume with a different world size re-plans only the rest of the epoch: what was consumed under the old world
size is recomputed from the (pure) planner and excluded (`chain` in the state), the same for every planner.
"""
from __future__ import annotations

import copy
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from typing import Callable, Generator, Iterator

import numpy as np
import torch

from shardtrain.format.arrownp import lean_memory_pool
from shardtrain.load import rowfilter
from shardtrain.load.batch import Batch
from shardtrain.load.config import StreamConfig
from shardtrain.load.plan import BucketConfig, Chunk
from shardtrain.load.mixplan import make_planner  # noqa: F401 (re-exported)
from shardtrain.load.planner import EpochView, Planner, RankChunk, open_planner  # noqa: F401
from shardtrain.load.reader import ChunkBatches, ChunkReader, StreamError
from shardtrain.world import World

log = logging.getLogger(__name__)

STATE_VERSION = 1
PLAN_AHEAD_AFTER = 2
"""Reads of an epoch scheduled before the next epoch is planned in the background (at the start it would slow
the first batch; later, the boundary would wait for the plan)."""
__all__ = ["Loader", "build_loader", "StreamConfig", "StreamError", "Batch"]


@dataclass(frozen=True, slots=True)
class _Cursor:
    epoch: int
    step: int
    chain: tuple = ()


@dataclass(frozen=True, slots=True)
class _Item:
    """One read of the schedule: a chunk's batches from `skip` on (the first item may be a one-batch piece)."""

    epoch: int
    first_step: int
    rc: RankChunk
    skip: int
    steps: int
    """Steps of this epoch (the cursor moves to the next epoch after the last)."""
    rows: int
    """Samples this epoch delivers over all ranks (the skip share's base)."""


@dataclass(slots=True)
class _Loaded:
    """What crosses from a reader thread to the Loader once a chunk's reads are done: one Future per batch
    (ChunkReader.start), and the chunk whose origin maps kept rows to their dataset row and dataset number."""

    batches: ChunkBatches
    rc: RankChunk
    steps: int
    rows: int
    planned: list[int]
    """Utterances the plan put in each batch: 0 is a batch empty by plan, not one whose samples failed."""


def _check_epoch(view: EpochView, epoch: int, chain: tuple) -> EpochView:
    if view.steps == 0 and not chain:  # a full epoch without a batch: every later one is the same
        raise StreamError(f"epoch {epoch} has no batch to plan (every sample excluded); stopping")
    return view


def _schedule(planner: Planner, world: World, cfg: StreamConfig, start: _Cursor) -> Iterator[_Item]:
    """This rank's reads from `start`, in plan order. The next epoch is planned in a thread once this one's first
    reads are scheduled, so an epoch boundary waits for nothing a steady step does not; the first chunk of the
    stream (at a start or a resume) is read one batch at a time, so the first batches wait for one batch's read
    and decode each, not a whole chunk's. The reads are the plan's batches whatever their grouping, so resume agrees."""
    epoch, step, chain = start.epoch, start.step, start.chain
    ahead = ThreadPoolExecutor(1, thread_name_prefix="plan")
    nxt: Future | None = None
    first = True
    try:
        while cfg.epochs is None or epoch < cfg.epochs:
            view = (nxt.result() if nxt is not None else planner.epoch(epoch, world.world_size, chain))
            view = _check_epoch(view, epoch, chain)
            nxt = None
            more = cfg.epochs is None or epoch + 1 < cfg.epochs
            for n, rc in enumerate(view.chunks(world.rank, step)):
                if n == PLAN_AHEAD_AFTER and more:  # not sooner: it would compete with the first batch's decode
                    nxt = ahead.submit(planner.epoch, epoch + 1, world.world_size)
                skip = max(0, step - rc.first_step)
                at = rc.first_step + skip
                batches = rc.chunk.batches
                if first:  # small first reads: the first chunk one batch at a time
                    for i in range(skip, len(batches)):
                        one = replace(rc, chunk=Chunk(rows=rc.chunk.rows, batches=batches[i:i + 1]))
                        yield _Item(epoch, at + i - skip, one, 0, view.steps, view.rows)
                    first = False
                    continue
                yield _Item(epoch, at, rc, skip, view.steps, view.rows)
            if nxt is None and more:  # a short epoch: plan the next one now
                nxt = ahead.submit(planner.epoch, epoch + 1, world.world_size)
            epoch, step, chain = epoch + 1, 0, ()
    finally:
        ahead.shutdown(wait=False, cancel_futures=True)


def _load(reader: ChunkReader, item: _Item, seq: int) -> _Loaded:
    """Read `item` and queue its rows; `seq`: the number of its first batch in this stream (decode priority)."""
    rd = copy.copy(reader)  # a view over this chunk's index, sharing the reader's pools and cache
    rd.idx = item.rc.index
    cb = rd.start(item.rc.chunk, item.epoch, item.first_step, item.skip, seq)
    planned = [len(b) for b in item.rc.chunk.batches[item.skip:]]
    return _Loaded(cb, item.rc, item.steps, item.rows, planned)


class ChunkStream:
    """This rank's schedule read ahead; each item is one read's batches (`_Loaded`), in schedule order."""

    def __init__(self, planner: Planner, world: World, cfg: StreamConfig, start: _Cursor):
        self.planner, self.world, self.cfg, self.start = planner, world, cfg, start
        self.advance: Callable[[int], None] = lambda n: None
        """The decode gate's `advance` once iterating (load/pool.py)."""

    def __iter__(self) -> Iterator[_Loaded]:
        """Chunks in schedule order; batches are numbered from 0 in the order they are yielded, and `advance(n)`
        (the Loader, before it waits for batch n) lets the decode threads work up to `decode_ahead` past it."""
        reader = ChunkReader(self.planner.data, None, self.cfg)  # type: ignore[arg-type]
        reader.decode_pool.gate(self.cfg.decode_ahead)
        self.advance = reader.decode_pool.advance
        pending: list[Future] = []
        seq = 0
        try:
            for j, item in enumerate(_schedule(self.planner, self.world, self.cfg, self.start)):
                pending.append(reader.io_pool.submit(_load, reader, item, seq))
                seq += len(item.rc.chunk.batches) - item.skip
                if j == 0:  # the first read runs alone: its batch waits for no other read (first batch 0.18 -> 0.13 s)
                    wait(pending[:1])
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
def _cfg_fingerprint(cfg: StreamConfig) -> str:
    """The bucket config, and the load-time filters when set (a state without filters keeps its old form)."""
    filters = rowfilter.fingerprint(cfg)
    return json.dumps(asdict(cfg.bucket) if filters is None else {**asdict(cfg.bucket), "filters": filters},
                      sort_keys=True)


def _refuse_empty_plan(what: str, rows: int, too_long: int, filtered: int, world: World, cfg: BucketConfig) -> None:
    """Raise StreamError at build time when no epoch can hold a batch (an empty index, every utterance over
    the budget or filtered out): iterating would otherwise plan empty epochs forever and a trainer would never step."""
    usable = rows - too_long - filtered
    if usable == 0:
        why = "its index has no rows" if rows == 0 else \
            f"all {rows} utterances are left out by the load-time filters (stream.min_duration_s/max_duration_s/" \
            "speakers/exclude_speakers)" if filtered == rows else \
            f"all {rows - filtered} utterances{' the filters keep' if filtered else ''} are longer than " \
            f"stream.bucket.max_batch_seconds={cfg.max_batch_seconds:g}"
        raise StreamError(f"{what}: no batch can be planned: {why}; raise max_batch_seconds or use another dataset")
    if usable < world.world_size:
        raise StreamError(f"{what}: {usable} usable samples for {world.world_size} ranks: every rank needs at least "
                          "one; use fewer ranks or a larger dataset")


class Loader:
    """Iterate `(Batch, state)`; `build_loader(..., state=state)` resumes at the batch after `state`'s.

    The state is a small JSON-able cursor: {version, dataset, bucket config, seed, planner, world_size, epoch,
    step, chain, counters}. It is the same on every rank (counters aside), so any rank's copy resumes all of them.
    """

    source: tuple = ()
    """(url, storage_options, epoch_hours) the planner was made from, set by build_loader: what `restart` re-plans."""

    def __init__(self, planner: Planner, *, world: World, seed: int, cfg: StreamConfig, state: dict | None = None,
                 rows: int | None = None):
        self.planner, self.world, self.seed, self.cfg = planner, world, seed, cfg
        self.fingerprint = planner.fingerprint
        self.sample_rate_hz = planner.sample_rate_hz
        self.too_long_per_epoch = planner.too_long
        self.filtered_per_epoch = planner.filtered
        self.counters: dict = {"samples": 0, "audio_seconds": 0.0, "batches": 0, "skipped": 0, "too_long": 0,
                               "filtered": 0, "empty_by_plan": 0}
        if len(planner.datasets) > 1:
            self.counters["dataset_seconds"] = [0.0] * len(planner.datasets)
        self.stage_s: dict[str, float] = {"read": 0.0, "parse": 0.0, "decode": 0.0, "batch": 0.0, "collate": 0.0}
        """Seconds per stage, summed over threads (not part of the state: not reproducible)."""
        self.skipped_keys: list[dict] = []
        self._epoch_skips = (0, 0)
        """(epoch, samples skipped in it) for the max_skipped_share stop."""
        self.cursor = _Cursor(0, 0)
        self._bucket_fingerprint = _cfg_fingerprint(cfg)
        if state is not None:
            self._load_state(state)
        what = planner.datasets[0] if len(planner.datasets) == 1 else f"the mixture {planner.datasets}"
        if rows is not None:
            _refuse_empty_plan(what, rows, self.too_long_per_epoch, self.filtered_per_epoch, world, cfg.bucket)
        if self.too_long_per_epoch and len(planner.datasets) == 1:
            log.warning("%d utterances are longer than max_batch_seconds=%g and are left out of every epoch",
                        self.too_long_per_epoch, cfg.bucket.max_batch_seconds)

    @property
    def ds(self):
        """Where the shards live (planner.data: shard id -> URL, name, size)."""
        return self.planner.data

    @property
    def dataset_names(self) -> list[str]:
        return list(self.planner.datasets)

    @property
    def content_ids(self) -> list[str]:
        """Dataset.content_id of each dataset, in dataset_names' order, from the manifests the planner opened."""
        return [d.content_id for d in self.planner.data.parts]

    # -- state
    def _load_state(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise StreamError(f"loader state version {state.get('version')!r} != {STATE_VERSION}; cannot resume")
        if state.get("dataset") != self.fingerprint:
            raise StreamError("loader state belongs to a different dataset (index fingerprint differs); "
                              "resume with the dataset the run started on")
        if "content" in state and state["content"] != self.planner.content:  # states before content ids: skipped
            raise StreamError(f"the content of {', '.join(self.planner.datasets)} changed since this state was saved "
                              "(shard sha256 differ: re-packed with other audio or text); resuming would mix old "
                              "and new data. Resume on the dataset the run started on, or start a new run (--out)")
        at_boundary = int(state["step"]) == 0 and not state.get("chain")
        if state.get("bucket") != self._bucket_fingerprint:
            if not at_boundary:  # mid-epoch the rest of the epoch is the old plan's: only it can continue
                raise StreamError("loader state was saved mid-epoch with a different stream.bucket config or "
                                  "load-time filters (stream.min_duration_s/max_duration_s/speakers/exclude_speakers;"
                                  " resume with the same ones, or change them at an epoch boundary); "
                                  f"saved {state.get('bucket')}, now {self._bucket_fingerprint}")
            log.info("resuming at the start of epoch %s with a new stream.bucket config or filters",
                     state.get("epoch"))
        if state.get("planner", "rows") != self.planner.name and not at_boundary:
            raise StreamError(f"loader state was planned by {state.get('planner', 'rows')}, this run plans by "
                              f"{self.planner.name}; set stream.planner={state.get('planner', 'rows')} to resume it")
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
        return {"version": STATE_VERSION, "dataset": self.fingerprint, "content": self.planner.content,
                "bucket": self._bucket_fingerprint,
                "seed": self.seed, "planner": self.planner.name, "world_size": self.world.world_size,
                "epoch": c.epoch, "step": c.step, "chain": [list(x) for x in c.chain],
                "counters": {k: list(v) if isinstance(v, list) else v for k, v in self.counters.items()},
                "skipped_keys": list(self.skipped_keys)}

    def load_state_dict(self, state: dict) -> None:
        """torchdata/`Stateful` convention: the next iteration starts at the batch after `state`'s (same checks as
        `build_loader(..., state=state)`). Call it between iterations, not while one is running."""
        self.counters = {k: [0.0] * len(v) if isinstance(v, list) else type(v)(0) for k, v in self.counters.items()}
        self.skipped_keys, self.cursor = [], _Cursor(0, 0)
        self._load_state(state)

    def restart(self, cfg: StreamConfig, state: dict) -> None:
        """Plan again with `cfg` (e.g. the closed loop's new budget table) from `state`, which must sit at an epoch
        boundary when the bucket config changes. Costs what `build_loader` does: the manifest and index are read
        again, no audio. Call between iterations (close the running one first); the next `iter()` reads the new plan.
        Only for a loader made by `build_loader` (it records the datasets)."""
        if not self.source:
            raise ValueError("Loader.restart needs a loader made by build_loader (it records the datasets)")
        url, storage_options, epoch_hours = self.source
        self.planner = make_planner(url, seed=self.seed, cfg=cfg, storage_options=storage_options,
                                    epoch_hours=epoch_hours)
        self.cfg, self._bucket_fingerprint, self._epoch_skips = cfg, _cfg_fingerprint(cfg), (0, 0)
        self.too_long_per_epoch, self.filtered_per_epoch = self.planner.too_long, self.planner.filtered
        self.load_state_dict(state)

    def batches(self) -> Iterator[Batch]:
        """Plain iterator of batches; `state_dict()` after each one is the state that resumes at the next."""
        for batch, _ in self:
            yield batch

    def stats(self) -> dict:
        return {**self.counters, "skipped_keys": list(self.skipped_keys)}

    def steps_per_epoch(self, epoch: int = 0) -> int:
        """Batches every rank yields in `epoch` (a full epoch; a re-striped one differs)."""
        return self.planner.epoch(epoch, self.world.world_size).steps

    # -- iteration
    def _chunk_stream(self) -> ChunkStream:
        """This rank's reads from the cursor on, read ahead in this process's threads."""
        return ChunkStream(self.planner, self.world, self.cfg, self.cursor)

    def __iter__(self) -> Generator[tuple[Batch, dict], None, None]:
        pin = torch.cuda.is_available()
        per_dataset = self.counters.get("dataset_seconds")
        stream, seq = self._chunk_stream(), 0
        for loaded in stream:
            head = loaded.batches
            for k, v in head.timings.items():
                self.stage_s[k] += v
            for i, fut in enumerate(head.batches):
                stream.advance(seq)
                seq += 1
                item = fut.result()  # this batch's rows are decoded (the chunk's later batches may not be)
                head.batches[i] = ()  # the trainer holds the batch now; its buffer is recycled when it drops it
                for k, v in item.timings.items():
                    self.stage_s[k] += v
                self._count_skips(item, loaded.rows)
                pcm, lengths, keys, texts, durs, kept = item.batches[0]
                item.batches[0] = ()
                t0 = time.perf_counter()
                waves = pcm
                if pin:
                    waves = waves.pin_memory()
                self.stage_s["collate"] += time.perf_counter() - t0
                step = item.first_step
                rows, sources = loaded.rc.origin(kept)
                batch = Batch(waves=waves, lengths=torch.from_numpy(lengths), keys=keys, texts=texts,
                              durations_s=torch.from_numpy(durs), sample_rate_hz=self.sample_rate_hz,
                              epoch=item.epoch, step=step, rows=rows, sources=sources, planned=loaded.planned[i])
                if loaded.planned[i] == 0:  # equal steps: a chunk with fewer rows than its group's batches
                    self.counters["empty_by_plan"] += 1
                    log.info("rank %d: batch %d of epoch %d is empty by plan (its chunk holds fewer utterances than "
                             "the group's batches); not a decode failure", self.world.rank, step, item.epoch)
                self.counters["samples"] += len(keys)
                self.counters["audio_seconds"] += float(durs.sum())
                self.counters["batches"] += 1
                if per_dataset is not None:
                    for d, s in enumerate(np.bincount(sources, weights=durs, minlength=len(per_dataset)).tolist()):
                        per_dataset[d] += s
                chain = self.cursor.chain if item.epoch == self.cursor.epoch else ()
                if step == 0 and not chain:  # once per epoch (a re-striped epoch counted it before)
                    self.counters["too_long"] += self.too_long_per_epoch
                    self.counters["filtered"] += self.filtered_per_epoch
                self.cursor = (_Cursor(item.epoch, step + 1, chain) if step + 1 < loaded.steps else
                               _Cursor(item.epoch + 1, 0))
                yield batch, self.state_dict()

    def _count_skips(self, item: ChunkBatches, epoch_rows: int) -> None:
        """Record a read's skipped samples; StreamError once more than `max_skipped_share` of this rank's epoch
        was skipped as bad data. The epoch size is this rank's share of the epoch's samples; the count restarts
        each epoch (and on resume, so a resumed epoch may skip up to the share again)."""
        if not item.errors:
            return
        for e in item.errors:
            self.counters["skipped"] += 1
            if len(self.skipped_keys) < self.cfg.max_error_keys:
                self.skipped_keys.append(e)
            log.warning("skipped %s in %s: %s", e["key"], e["shard"], e["reason"])
        epoch, n = self._epoch_skips
        n = (n if epoch == item.epoch else 0) + len(item.errors)
        self._epoch_skips = (item.epoch, n)
        rows = max(1.0, epoch_rows / self.world.world_size)
        if n > self.cfg.max_skipped_share * rows:
            last = item.errors[-1]
            raise StreamError(
                f"{self.ds.url}: {n} of ~{rows:.0f} samples of epoch {item.epoch} skipped as bad data (over "
                f"stream.max_skipped_share={self.cfg.max_skipped_share:g}); last: {last['key']} in {last['shard']}: "
                f"{last['reason']}; check the dataset with `shardtrain inspect --verify`, or raise the share")


def build_loader(url: str | list | tuple, *, world: World, seed: int, cfg: StreamConfig, state: dict | None = None,
                 storage_options: dict | None = None, epoch_hours: float | None = None) -> Loader:
    """The loader for one rank. Reads manifest.json and the index (or its node-shared memory map) once; no audio.

    `url` may be a list of datasets, each a URL or (URL, weight): a weighted mixture (load/mixplan.py): per epoch
    each dataset contributes weight / sum(weights) of the audio (of all datasets together, or `epoch_hours`),
    every sample of a dataset once before any repeats. Makes pyarrow's default pool glibc's unless chosen
    (format.arrownp.lean_memory_pool: ~20 MB less per process)."""
    lean_memory_pool()
    planner = make_planner(url, seed=seed, cfg=cfg, storage_options=storage_options, epoch_hours=epoch_hours)
    rows = sum(s.samples for s in planner.data.shards)
    loader = Loader(planner, world=world, seed=seed, cfg=cfg, state=state, rows=rows)
    loader.source = (url, storage_options, epoch_hours)
    return loader
