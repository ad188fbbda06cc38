"""Streaming loader: planned batches read from shards on disk or S3, with exact resume.

    manifest.json + index.parquet (numeric columns only)            -> PlanIndex (~40 B/row, shared by workers)
      -> plan_epoch(seed, epoch, world_size, BucketConfig)          -> groups of chunks, batches fixed per chunk
      -> this rank's chunks; DataLoader worker w takes chunk j when (j + chunks before) % num_workers == w
      -> read_chunk: one ranged read per byte run (retry + resume at byte reached; optional local shard cache)
      -> decode: soundfile in a thread pool (releases the GIL), int16, downmix to mono
      -> ChunkBatches: per batch int16 [B, T] + lengths + keys/texts (half the bytes of float32 across IPC)
      -> Loader (main process): float32 [B, T] zero-padded (pinned when CUDA exists) -> (Batch, state)

Why threads, and why whole chunks per worker item: decoding in a thread pool inside one process reaches the
decode-only limit without the inter-process copy (stack.md), so `num_workers=0` with `decode_threads=2` is the
default; with worker processes, each DataLoader item is one chunk's batches, so DataLoader's round-robin over
workers yields chunks in plan order whatever `num_workers` is. The state is a cursor (epoch, step) kept by the
main process, never by workers, so a checkpoint cannot run ahead of the trainer.

A resume with a different world size re-plans only the rest of the epoch: rows consumed under the old world
size are recomputed from the (pure) plan and excluded (`chain` in the state).
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Iterator

import numpy as np
import soundfile as sf
import torch

from shardtrain import storage
from shardtrain.index import Dataset, open_dataset
from shardtrain.plan import PLAN_COLUMNS, BucketConfig, Chunk, EpochPlan, PlanIndex, consumed_rows, plan_epoch
from shardtrain.world import World

log = logging.getLogger(__name__)

STATE_VERSION = 1
RUN_GAP_BYTES = 1 << 20
"""Rows closer than this in one shard are read as one range (reading through the gap beats another request)."""


class StreamError(RuntimeError):
    """Raised in strict mode on the first bad sample or shard, and on invalid resume state."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamConfig:
    bucket: BucketConfig = field(default_factory=BucketConfig)
    """Batch budget and bucketing (see plan.BucketConfig)."""
    epochs: int | None = None
    """Stop after this many epochs; None repeats forever (the trainer stops on max_steps)."""
    num_workers: int = 0
    """DataLoader worker processes. 0 decodes in threads of the main process (fastest on few cores)."""
    decode_threads: int = 2
    """Decode threads per process (soundfile releases the GIL)."""
    prefetch_chunks: int = 2
    """Chunks read and decoded ahead per process; memory ~ prefetch_chunks x chunk_mb x 2 (int16 PCM)."""
    retries: int = 5
    """Retries of a failed read (exponential backoff, resumed at the byte reached) before the chunk is skipped."""
    retry_backoff_s: float = 0.2
    """First backoff delay; doubles per consecutive failure."""
    piece_mb: float = 8.0
    """Bytes per storage request inside a chunk read."""
    strict: bool = False
    """Raise on the first corrupt sample or failed shard instead of skipping and recording it."""
    cache_dir: str | None = None
    """Local folder caching whole remote shards across epochs (LRU); None disables."""
    cache_max_gb: float = 50.0
    """Size cap of `cache_dir`; least recently used shards are evicted past it."""
    max_error_keys: int = 1000
    """Skipped keys kept in stats/state (counts are always exact)."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError("stream.num_workers must be >= 0")
        if self.decode_threads < 1:
            raise ValueError("stream.decode_threads must be >= 1")
        if self.prefetch_chunks < 1:
            raise ValueError("stream.prefetch_chunks must be >= 1")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError("stream.epochs must be >= 1 or None")


@dataclass(slots=True)
class Batch:
    waves: torch.Tensor
    """float32 [B, T], zero-padded past each length."""
    lengths: torch.Tensor
    """int64 [B], samples."""
    keys: list[str]
    texts: list[str]
    durations_s: torch.Tensor
    """float64 [B]."""
    sample_rate_hz: int
    epoch: int
    step: int
    """Index of this batch within its epoch."""

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(slots=True)
class ChunkBatches:
    """What a worker hands over for one chunk: compact int16 batches plus the chunk's errors."""

    epoch: int
    first_step: int
    batches: list[tuple[np.ndarray, np.ndarray, list[str], list[str], np.ndarray]]
    errors: list[dict]
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent per stage on this chunk, summed over threads: read, parse, decode, batch."""


# ---------------------------------------------------------------------------------------------- reading
def _byte_runs(idx: PlanIndex, rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(shard, start, end) byte ranges covering `rows` (ascending), merging rows separated by small gaps."""
    runs: list[list[int]] = []
    for r in rows:
        s, a, b = int(idx.shard[r]), int(idx.offset[r]), int(idx.offset[r] + idx.size[r])
        if runs and runs[-1][0] == s and 0 <= a - runs[-1][2] <= RUN_GAP_BYTES:
            runs[-1][2] = max(runs[-1][2], b)
        else:
            runs.append([s, a, b])
    return [tuple(r) for r in runs]  # type: ignore[misc]


class ShardCache:
    """Whole remote shards kept on local disk across epochs; LRU by mtime, evicted past `max_bytes`."""

    def __init__(self, root: str, max_bytes: int):
        self.root, self.max_bytes = root, max_bytes
        os.makedirs(root, exist_ok=True)
        self._lock = threading.Lock()

    def path(self, ds: Dataset, shard: int, read_whole) -> str:
        info = ds.shards[shard]
        local = os.path.join(self.root, f"{info.sha256[:16]}-{info.name}")
        if os.path.exists(local) and os.path.getsize(local) == info.bytes:
            os.utime(local)
            return local
        data = read_whole()
        tmp = f"{local}.tmp{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, local)
        self._evict()
        return local

    def _evict(self) -> None:
        with self._lock:
            files = [os.path.join(self.root, n) for n in os.listdir(self.root) if n.endswith(".tar")]
            files.sort(key=lambda p: os.path.getmtime(p))
            total = sum(os.path.getsize(p) for p in files)
            while total > self.max_bytes and len(files) > 1:
                victim = files.pop(0)
                total -= os.path.getsize(victim)
                os.remove(victim)


class ChunkReader:
    """Reads and decodes chunks; one per process (built lazily inside each DataLoader worker)."""

    def __init__(self, ds: Dataset, idx: PlanIndex, cfg: StreamConfig):
        self.ds, self.idx, self.cfg = ds, idx, cfg
        self.decode_pool = ThreadPoolExecutor(cfg.decode_threads, thread_name_prefix="decode")
        self.io_pool = ThreadPoolExecutor(cfg.prefetch_chunks, thread_name_prefix="read")
        self.cache = (ShardCache(cfg.cache_dir, int(cfg.cache_max_gb * 1e9))
                      if cfg.cache_dir and not storage.is_local(ds.url) else None)

    def _read(self, shard: int, start: int, end: int) -> bytes:
        """Bytes [start, end) of a shard; short when the shard is truncated. Raises OSError after retries."""
        url = self.ds.shard_url(shard)
        so = self.ds.storage_options
        kw = dict(retries=self.cfg.retries, piece_bytes=int(self.cfg.piece_mb * (1 << 20)),
                  backoff_s=self.cfg.retry_backoff_s)
        if self.cache is not None:
            url = self.cache.path(self.ds, shard, lambda: storage.read_range(url, 0, None, so, **kw))
            so = None
        try:
            return storage.read_range(url, start, end, so, **kw)
        except EOFError:
            have = storage.size(url, so)
            return storage.read_range(url, start, min(end, have), so, **kw) if have > start else b""

    def _decode(self, buf: memoryview, base: int, row: int) -> tuple[str, str, np.ndarray | None, str | None, float, float]:
        """(key, text, int16 mono wave or None, error or None, parse s, decode s) of one row of a run's bytes.

        The key comes from the ustar header just before the audio data, which also checks that the index
        offsets match the shard (a stale or foreign index would otherwise feed wrong audio silently).
        """
        t0 = time.perf_counter()
        idx = self.idx
        a0, a_len = int(idx.audio_offset[row]) - base, int(idx.audio_size[row])
        j0, j_len = int(idx.json_offset[row]) - base, int(idx.json_size[row])
        key, text = f"row{row}", ""
        if a0 < 512 or a0 + a_len > len(buf) or j0 + j_len > len(buf):
            return key, text, None, "truncated_shard: sample bytes past the end of the shard", 0.0, 0.0
        name = bytes(buf[a0 - 512:a0 - 412]).split(b"\0", 1)[0].decode("utf-8", "replace")
        if "." not in name:
            return key, text, None, f"index_mismatch: no tar member header at byte {a0 + base - 512}", 0.0, 0.0
        key = name.rsplit(".", 1)[0]
        try:
            text = str(json.loads(bytes(buf[j0:j0 + j_len])).get("text", ""))
        except (ValueError, AttributeError) as e:
            return key, text, None, f"bad_json: {e}", 0.0, 0.0
        t1 = time.perf_counter()
        try:
            wave, _ = sf.read(io.BytesIO(buf[a0:a0 + a_len]), dtype="int16", always_2d=True)
        except Exception as e:  # noqa: BLE001 - libsndfile raises several types for corrupt audio
            return key, text, None, f"decode_error: {type(e).__name__}: {e}", t1 - t0, 0.0
        wave = wave[:, 0] if wave.shape[1] == 1 else wave.mean(axis=1).astype(np.int16)
        t2 = time.perf_counter()
        if len(wave) == 0:
            return key, text, None, "decode_error: no samples", t1 - t0, t2 - t1
        return key, text, wave, None, t1 - t0, t2 - t1

    def load(self, chunk: Chunk, epoch: int, first_step: int, skip_batches: int, as_float: bool) -> ChunkBatches:
        """Read and decode the rows of `chunk.batches[skip_batches:]` (skipped batches are never decoded).

        `as_float` pads straight into float32 (in-process loading: the main thread then only wraps the array);
        worker processes keep int16, half the bytes through the DataLoader pipe, converted by the main process.
        """
        idx, errors = self.idx, []
        timings = {"read": 0.0, "parse": 0.0, "decode": 0.0, "batch": 0.0}
        wanted = chunk.batches[skip_batches:]
        rows = np.sort(np.concatenate(wanted)) if sum(map(len, wanted)) else np.zeros(0, np.int64)
        decoded: dict[int, tuple] = {}
        futures: list[tuple[int, Future]] = []
        for shard, start, end in _byte_runs(idx, rows):
            run_rows = rows[(idx.shard[rows] == shard) & (idx.offset[rows] >= start) & (idx.offset[rows] < end)]
            t0 = time.perf_counter()
            try:
                buf = memoryview(self._read(shard, start, end))
            except OSError as e:
                if self.cfg.strict:
                    raise StreamError(f"shard {self.ds.shards[shard].name}: {e}") from e
                for r in run_rows:
                    decoded[int(r)] = (f"row{int(r)}", "", None, f"shard_read_failed: {e}", 0.0, 0.0)
                continue
            finally:
                timings["read"] += time.perf_counter() - t0
            futures.extend((int(r), self.decode_pool.submit(self._decode, buf, start, int(r))) for r in run_rows)
        for r, fut in futures:
            decoded[r] = fut.result()
        t0 = time.perf_counter()
        out = []
        for batch_rows in wanted:
            waves, keys, texts, durs = [], [], [], []
            for r in batch_rows:
                key, text, wave, err, t_parse, t_decode = decoded[int(r)]
                timings["parse"] += t_parse
                timings["decode"] += t_decode
                if err is not None:
                    shard_name = self.ds.shards[int(idx.shard[r])].name
                    if self.cfg.strict:
                        raise StreamError(f"{shard_name} key {key}: {err}")
                    errors.append({"key": key, "shard": shard_name, "reason": err})
                    continue
                waves.append(wave)
                keys.append(key)
                texts.append(text)
                durs.append(float(idx.duration_s[r]))
            lengths = np.array([len(w) for w in waves], dtype=np.int64)
            padded = np.zeros((len(waves), int(lengths.max()) if len(waves) else 0),
                              dtype=np.float32 if as_float else np.int16)
            for i, w in enumerate(waves):
                if as_float:
                    np.multiply(w, np.float32(1.0 / 32768.0), out=padded[i, :len(w)], dtype=np.float32)
                else:
                    padded[i, :len(w)] = w
            out.append((padded, lengths, keys, texts, np.array(durs, dtype=np.float64)))
        timings["batch"] += time.perf_counter() - t0
        return ChunkBatches(epoch=epoch, first_step=first_step, batches=out, errors=errors, timings=timings)


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


@dataclass(frozen=True, slots=True)
class _Cursor:
    epoch: int
    step: int
    chain: tuple = ()


def _chunk_schedule(idx: PlanIndex, seed: int, world: World, cfg: StreamConfig,
                    start: _Cursor) -> Iterator[tuple[int, int, Chunk, int]]:
    """(epoch, first step of chunk, chunk, batches to skip) for this rank from `start`, in plan order."""
    epoch, step, chain = start.epoch, start.step, start.chain
    while cfg.epochs is None or epoch < cfg.epochs:
        plan = epoch_plan(idx, seed, epoch, world.world_size, cfg.bucket, chain)
        first = 0
        for chunk in plan.rank_chunks(world.rank):
            m = len(chunk.batches)
            if first + m > step:
                yield epoch, max(first, step), chunk, max(0, step - first)
            first += m
        epoch, step, chain = epoch + 1, 0, ()


class ChunkStream(torch.utils.data.IterableDataset):
    """IterableDataset over this rank's chunks; each item is one chunk's batches (`ChunkBatches`).

    Use with `DataLoader(ds, batch_size=None, num_workers=N)`; worker w loads the chunks at positions
    w, w+N, ... of the schedule, so DataLoader's round-robin yields them in schedule order.
    """

    def __init__(self, ds: Dataset, idx: PlanIndex, seed: int, world: World, cfg: StreamConfig, start: _Cursor):
        self.ds, self.idx, self.seed, self.world, self.cfg, self.start = ds, idx, seed, world, cfg, start

    def __iter__(self) -> Iterator[ChunkBatches]:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        reader = ChunkReader(self.ds, self.idx, self.cfg)
        pending: list[Future] = []
        sched = _chunk_schedule(self.idx, self.seed, self.world, self.cfg, self.start)
        mine = (item for j, item in enumerate(sched) if j % nw == wid)
        try:
            for epoch, first, chunk, skip in mine:
                pending.append(reader.io_pool.submit(reader.load, chunk, epoch, first, skip, info is None))
                if len(pending) >= self.cfg.prefetch_chunks:
                    yield pending.pop(0).result()
            while pending:
                yield pending.pop(0).result()
        finally:
            for f in pending:
                f.cancel()
            reader.io_pool.shutdown(wait=False, cancel_futures=True)
            reader.decode_pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------------------------- loader
def _cfg_fingerprint(cfg: BucketConfig) -> str:
    return json.dumps(asdict(cfg), sort_keys=True)


class Loader:
    """Iterate `(Batch, state)`; `build_loader(..., state=state)` resumes at the batch after `state`'s.

    The state is a small JSON-able cursor: {version, dataset, bucket config, seed, world_size, epoch, step,
    chain, counters}. It is the same on every rank (counters aside), so any rank's copy resumes all of them.
    """

    def __init__(self, url: str, *, world: World, seed: int, cfg: StreamConfig, state: dict | None = None,
                 storage_options: dict | None = None):
        self.world, self.seed, self.cfg = world, seed, cfg
        self.ds = open_dataset(url, storage_options)
        table = self.ds.read_index(columns=list(PLAN_COLUMNS) + ["sample_rate_hz"])
        rates = np.unique(table.column("sample_rate_hz").to_numpy())
        if len(rates) > 1:
            raise StreamError(f"{url} mixes sample rates {rates.tolist()}; repack with `shardtrain pack --sample-rate`")
        self.sample_rate_hz = int(rates[0]) if len(rates) else 16000
        self.idx = PlanIndex.from_table(table)
        self.fingerprint = self.idx.fingerprint()
        self.counters = {"samples": 0, "audio_seconds": 0.0, "batches": 0, "skipped": 0, "too_long": 0,
                         "dropped_for_equal_steps": 0}
        self.stage_s: dict[str, float] = {"read": 0.0, "parse": 0.0, "decode": 0.0, "batch": 0.0, "collate": 0.0}
        """Seconds per stage, summed over threads and workers (not part of the state: not reproducible)."""
        self.skipped_keys: list[dict] = []
        self.cursor = _Cursor(0, 0)
        if state is not None:
            self._load_state(state)
        self._last_state = self.state_dict()
        self._too_long_reported: set[int] = set()

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
        return {"version": STATE_VERSION, "dataset": self.fingerprint, "bucket": _cfg_fingerprint(self.cfg.bucket),
                "seed": self.seed, "world_size": self.world.world_size, "epoch": c.epoch, "step": c.step,
                "chain": [list(x) for x in c.chain], "counters": dict(self.counters),
                "skipped_keys": list(self.skipped_keys)}

    def stats(self) -> dict:
        return {**self.counters, "skipped_keys": list(self.skipped_keys)}

    def steps_per_epoch(self, epoch: int = 0) -> int:
        """Batches every rank yields in `epoch` (a full epoch; a re-striped one differs)."""
        return epoch_plan(self.idx, self.seed, epoch, self.world.world_size, self.cfg.bucket).steps

    # -- iteration
    def dataloader(self) -> torch.utils.data.DataLoader:
        """The DataLoader settings that keep plan order: whole chunks per item, no batching, no sampler."""
        ds = ChunkStream(self.ds, self.idx, self.seed, self.world, self.cfg, self.cursor)
        nw = self.cfg.num_workers
        return torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=nw, prefetch_factor=2 if nw else None, persistent_workers=False,
            multiprocessing_context="fork" if nw and os.name == "posix" else None)

    def _note_epoch(self, epoch: int) -> None:
        if epoch in self._too_long_reported:
            return
        self._too_long_reported.add(epoch)
        plan = epoch_plan(self.idx, self.seed, epoch, self.world.world_size, self.cfg.bucket, self.cursor.chain
                          if epoch == self.cursor.epoch else ())
        n = len(plan.too_long)
        if n:
            self.counters["too_long"] += n
            log.warning("epoch %d: %d utterances longer than max_batch_seconds=%g left out",
                        epoch, n, self.cfg.bucket.max_batch_seconds)

    def __iter__(self) -> Iterator[tuple[Batch, dict]]:
        pin = torch.cuda.is_available()
        for item in self.dataloader():
            self._note_epoch(item.epoch)
            for k, v in item.timings.items():
                self.stage_s[k] += v
            for e in item.errors:
                self.counters["skipped"] += 1
                if len(self.skipped_keys) < self.cfg.max_error_keys:
                    self.skipped_keys.append(e)
                log.warning("skipped %s in %s: %s", e["key"], e["shard"], e["reason"])
            for i, (pcm, lengths, keys, texts, durs) in enumerate(item.batches):
                t0 = time.perf_counter()
                if pcm.dtype != np.float32:  # int16 from a worker process (numpy: ~10x faster than torch here)
                    pcm = np.multiply(pcm, np.float32(1.0 / 32768.0), dtype=np.float32)
                waves = torch.from_numpy(pcm)
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
                self.cursor = _Cursor(item.epoch, step + 1, chain)
                yield batch, self.state_dict()


def build_loader(url: str, *, world: World, seed: int, cfg: StreamConfig, state: dict | None = None,
                 storage_options: dict | None = None) -> Loader:
    """The loader for one rank. Reads manifest.json and index.parquet (numeric columns) once; no audio yet."""
    return Loader(url, world=world, seed=seed, cfg=cfg, state=state, storage_options=storage_options)
