"""How pack's tasks run: LocalEngine (this process + a process pool) or RayEngine (Ray tasks on a cluster).

    engine.scan(parts)  -> [PartScan]      runs scan.scan_part per SourcePart; records stay with the engine
    engine.path_of(p, r) -> audio path     a candidate's path (only asked for duplicate rejects)
    engine.write(specs) -> markers         runs shard_task.write_shard per shard of the layout, any order (LocalEngine's
                                           pool, for its last shards: its two halves, spool_slice or encode_slice
                                           per slice of a shard in the workers, ShardStream or finish_shard in
                                           the driver)

Both engines call the same task functions (scan_part, write_shard) on the same inputs; everything that decides
bytes (listing order, keys, the sort, shard names and contents) is decided by layout.py from the scans, so the
output does not depend on the engine, the worker count or the order in which tasks finish.

RayEngine imports ray only when constructed (`pip install 'shardtrain[ray]'`). Its driver holds PartScans and
ObjectRefs; the records of each part live in Ray's object store as one flat byte array plus offsets (zero-copy on
the node that reads them), so a shard task unpickles only its own samples. Tasks are retried by Ray when their
worker dies (`max_retries`); a retried shard task rewrites the same bytes under the same name (temp name, then
rename or one whole-object PUT), and an exception raised by the task itself (a --strict failure) is not retried.
"""
from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import threading
import pickle
from collections.abc import Callable, Iterable, Iterator
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from shardtrain import storage
from shardtrain.pack.lifeline import die_with_parent
from shardtrain.pack.layout import ShardSpec
from shardtrain.pack.scan import PartScan, scan_part
from shardtrain.pack.shard_task import (PackError, SampleSpec, ShardStream, ShardTask, finish_shard, publish_marker,
                                        shard_work, write_shard)
from shardtrain.pack.parts import SourcePart

if TYPE_CHECKING:
    from shardtrain.pack.transcode import AudioTarget

log = logging.getLogger(__name__)

TASK_RETRIES = 3
"""Ray re-runs a task this many times when its worker process dies (killed, out of memory, node lost)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WriteJob:
    """What every shard task of one pack shares (besides its spec and records)."""

    output: str
    storage_options: dict | None
    target: AudioTarget
    fingerprint: str
    strict: bool


class Engine(Protocol):
    def scan(self, cfg, parts: Iterable[SourcePart], on_part: Callable[[PartScan], None]) -> list[PartScan]: ...

    def path_of(self, part: int, row: int) -> str: ...

    def write(self, job: WriteJob, specs: Iterable[ShardSpec], count: int) -> Iterator[dict]: ...

    def close(self) -> None: ...


def shard_task(job: WriteJob, spec: ShardSpec, records: Callable[[int, int], tuple],
               defer_sync: bool = False) -> ShardTask:
    """The ShardTask of one spec; `records(part, row)` -> (Item, AudioInfo, duration_s, est_bytes)."""
    samples = []
    for p, r, key in zip(spec.parts.tolist(), spec.rows.tolist(), spec.keys):
        item, info, duration_s, est = records(p, r)
        samples.append(SampleSpec(key=key, item=item, info=info, duration_s=duration_s, est_bytes=est))
    return ShardTask(shard=spec.shard, output=job.output, storage_options=job.storage_options, samples=samples,
                     target=job.target, fingerprint=job.fingerprint, strict=job.strict, defer_sync=defer_sync)


# ---- local ----------------------------------------------------------------------------------------------------
SLICE_BYTES = 2 << 20
"""Estimated encoded audio per slice of a shard in the local pool (LocalEngine.write): ~30 speech FLAC files of
~3 s, ~30 ms of one core's read and decode check here; small enough that 2,000 such files make ~60 slices (every
worker busy to the end), large enough that a slice's hand-off (~1 ms) is noise."""


REMOTE_FINISHERS = 4
"""Threads finishing shards in LocalEngine.write for a remote OUTPUT (each uploads a whole shard: I/O, not CPU);
a local OUTPUT has one (tar and sha256 of ~1 GB/s here)."""


TAIL_SHARDS = 2
"""LocalEngine.write slices the last TAIL_SHARDS x workers shards of a pack (all of them when it has fewer); the
shards before go to a worker whole."""


def _publish(job: WriteJob, marker: dict) -> dict:
    publish_marker(job.output, job.storage_options, marker)
    return marker


def _finish(job: WriteJob, task: ShardTask, parts: list) -> dict:
    """A sliced shard, in the driver: tar, sha256, rename (finish_shard, deferring the fsync), fsync, marker."""
    return _publish(job, finish_shard(task, parts))


def _finish_stream(job: WriteJob, stream: ShardStream) -> dict:
    """A sliced shard tarred as its slices came back (ShardStream): close, rename, fsync, marker."""
    return _publish(job, stream.finish())


def slices(samples: list[SampleSpec], target: int) -> list[tuple[int, int]]:
    """[start, stop) bounds cutting `samples` (layout order) into runs of about `target` estimated bytes (at least
    one sample each). Only how work is spread: the output does not depend on it."""
    bounds, start, acc = [], 0, 0
    for i, s in enumerate(samples):
        acc += s.est_bytes
        if acc >= target:
            bounds.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(samples) or not samples:
        bounds.append((start, len(samples)))
    return bounds


def _scan_task(job: tuple) -> tuple[PartScan, list]:
    """scan_part in a pool worker (a module-level function: picklable)."""
    cfg, part = job
    return scan_part(cfg, part)


class LocalEngine:
    """Scans parts (in this process until the pool is up, then in the pool), writes in a process pool of
    `workers` (or all in this process for 1). Holds every part's records in memory (~1 KB per item).

    `fork`: the pool's workers are forked from this process when start_workers is called (before any thread or
    remote-storage connection of the pack exists: packer uses it for a local INPUT and OUTPUT on Linux), ~10 ms
    a worker with everything imported. Else a forkserver starts them: a fresh interpreter that imports the pack
    modules first (~0.3 s of CPU; 0.6-1 s before the first worker is up on 2 busy cores) and shares nothing with
    this process (fsspec's event loop, open connections), but it left both cores without decoding work after
    the scan of a 2,000-file pack (0.2-0.5 s from the first task to its result, against 0.05-0.2 s forked)."""

    def __init__(self, workers: int, fork: bool = False) -> None:
        self.workers = workers
        self.fork = fork
        self._records: dict[int, list] = {}
        self._pool: ProcessPoolExecutor | None = None
        self._up: threading.Event | None = None
        """Set once every pool worker has run a task (start_workers); None: not started in the background."""
        self._frozen = False
        """gc.freeze() was called by start_workers (undone by close)."""

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            ctx: Any
            if self.fork:
                ctx = multiprocessing.get_context("fork")
            else:
                ctx = multiprocessing.get_context("forkserver")
                ctx.set_forkserver_preload(["shardtrain.pack.shard_task", "shardtrain.pack.transcode",
                                            "shardtrain.pack.scan", "shardtrain.pack.parts",
                                            "shardtrain.pack.lifeline"])
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx, initializer=die_with_parent,
                                             initargs=(os.getpid(),))
        return self._pool

    def start_workers(self) -> None:
        """Start the pool's processes now. With `fork`, here in this thread (a fork pool starts all its workers
        at its first task; forking from a background thread while this one scans could copy a held lock), and
        `scan` sends every part to the pool. Else in the background: a forkserver worker starts only after the
        server has imported the pack modules (~0.8 s idle, 1.5-2 s on a loaded machine), and the first task is
        submitted only once the input is listed: started here, the two overlap, and `scan` scans in this process
        until every worker is up (`_up`). Errors surface at the first real task, as before."""
        ex = self._executor()
        up = self._up = threading.Event()
        if self.fork:
            # Objects that exist now are left out of the garbage collector's passes until close (gc.freeze, as
            # CPython's gc docs advise before a fork): a worker's first full collection otherwise walks every
            # inherited object and so copies every page of the caller's heap. Measured here from a caller that
            # had imported torch and lhotse (bench_pack): the scan 0.20 -> 0.10 s, the pack 0.88 -> 0.78 s. A
            # caller that froze objects itself is left as it is (close would unfreeze them too).
            if not gc.get_freeze_count():
                gc.freeze()
                self._frozen = True
            try:
                ex.submit(int)
            except (RuntimeError, BrokenProcessPool):  # the real tasks report it
                pass
            up.set()
            return

        def start() -> None:
            try:
                wait([ex.submit(int) for _ in range(self.workers)])
            except (RuntimeError, BrokenProcessPool):  # shut down or broken meanwhile: the real tasks report it
                pass
            finally:
                up.set()

        threading.Thread(target=start, name="pack-pool-start", daemon=True).start()

    def _bounded(self, fn: Callable, args: Iterable, what: str) -> Iterator[Any]:
        """fn(arg) for each arg in the pool, at most 2 per worker in flight (a huge layout is not pickled up front);
        results in completion order. A dead worker process raises PackError."""
        done_n = 0
        try:
            ex, it = self._executor(), iter(args)
            pending = set()
            for a in it:
                pending.add(ex.submit(fn, a))
                if len(pending) >= 2 * self.workers:
                    break
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    done_n += 1
                    yield f.result()  # re-raises worker errors (PackError, ...)
                    nxt = next(it, None)
                    if nxt is not None:  # submitting to a pool broken meanwhile raises here, not in result()
                        pending.add(ex.submit(fn, nxt))
        except BrokenProcessPool as e:
            raise PackError(
                f"a worker process died (killed, or out of memory) while {what}; {done_n} tasks finished in this "
                "run (finished shards are kept): re-run the same command to write only the rest") from e

    def scan(self, cfg, parts: Iterable[SourcePart], on_part: Callable[[PartScan], None]) -> list[PartScan]:
        """Parts in the pool's worker processes (with 1 worker: in this process, probe threads inside each part).

        A scan is CPU work in Python (a transcript read, a header parse, a digest: ~0.3 ms a file), which one
        process does on one core however many probe threads it has; in the pool every core scans, and the pool
        is started here anyway for the writes. Records come back pickled (~300 bytes an item). Until the pool's
        workers are up (start_workers), this process scans the parts itself instead of waiting for them: a
        2,000-file folder was scanned in ~0.3 s here while the pool took 1-2 s to start on a loaded machine,
        and the decoding (the writes) could not begin before. Parts finish in any order and either place; the
        layout sorts them, so the output does not depend on it."""
        scans = []

        def take(result: tuple[PartScan, list]) -> None:
            scan, records = result
            self._records[scan.index] = records
            scans.append(scan)
            on_part(scan)

        it = iter(parts)
        if self.workers == 1:
            for part in it:
                take(scan_part(cfg, part))
            return scans
        while self._up is not None and not self._up.is_set():
            nxt = next(it, None)
            if nxt is None:
                return scans
            take(scan_part(cfg, nxt))
        log.debug("scanned %d parts in the driver while the pool started", len(scans))
        for result in self._bounded(_scan_task, ((cfg, p) for p in it), "scanning the input"):
            take(result)
        return scans

    def path_of(self, part: int, row: int) -> str:
        return str(self._records[part][row][0].audio)

    def _record(self, part: int, row: int) -> tuple:
        return self._records[part][row]

    def write(self, job: WriteJob, specs: Iterable[ShardSpec], count: int) -> Iterator[dict]:
        """Markers of written shards, each yielded once its shard is on disk and its marker written.

        With the pool, the last TAIL_SHARDS x workers shards (all of them in a small pack) are cut into slices
        of ~SLICE_BYTES of estimated audio (`slices`): the workers encode them (read, decode check or transcode:
        the expensive part) and a thread here finishes each shard once its slices are back (tar, sha256, fsync,
        marker). For a local OUTPUT a worker writes its slice's tar members to a spool file (shard_task.
        spool_slice) and the thread appends each slice to the shard's tar as soon as the slices before it are
        in (shard_task.ShardStream), so after the last slice only its own ~2 MB, the close and the fsync are
        left (a one-shard pack of 2,000 files waited ~0.4 s for the whole 125 MB tar there, both workers idle);
        for a remote OUTPUT the slices come back pickled (encode_slice) and finish_shard sorts and uploads each
        shard. The shards before the tail go to a worker whole (write_shard, leaving fsync and marker to a
        thread here: an fsync is a wait for the disk, ~40 ms per 16 MB, that idled a worker's core). Why slices:
        with a task per shard a corpus of one shard ran on one core (a 2,000-file pack took ~2x a 2-process
        decode of the same audio) and every pack ended with its last shards on fewer cores than it has; sliced,
        every worker decodes from the first file to the last. Why only the tail: a sliced shard's bytes are
        copied once more and hashed by one thread here, which a whole shard does in its worker.

        The output is the same bytes: finish_shard sorts the whole shard and keeps the layout order of rejects,
        however it was sliced, and ShardStream falls back to it when a slice is out of the stored order. Memory
        here: the slices' index rows, one slice buffer per shard being appended, and for a remote OUTPUT the
        encoded audio of the sliced shards with a slice in flight (at most 2 tasks per worker are, in layout
        order: one or two shards of ~target_shard_mb, or 2 x workers smaller ones) plus at most `finishers` + 1
        shards queued for the finishing threads (a full queue stops new work); never the corpus. A remote OUTPUT
        gets REMOTE_FINISHERS of them (whole-shard uploads). A worker that dies costs nothing: a shard without
        its marker is written again by the re-run (a spool file it left in _work/ goes with _work/ at commit)."""
        if self.workers == 1:
            for t in (shard_task(job, s, self._record) for s in specs):
                yield write_shard(t)
            return
        open_shards: dict[int, list] = {}  # shard -> [task or ShardStream, slices left, slice results]
        local = storage.is_local(job.output)
        finishers = 1 if local else min(self.workers, REMOTE_FINISHERS)
        work = self._work(job, specs, count - TAIL_SHARDS * self.workers, open_shards, spool=local)
        written: deque[Future] = deque()
        try:
            # Leaving the `with` (an error included) waits for the queued shards: shards whose slices all came
            # back are written with their markers, and a re-run writes only the rest.
            with ThreadPoolExecutor(finishers, thread_name_prefix="pack-finish") as writer:
                for shard, first, result in self._bounded(shard_work, work, "writing shards"):
                    if first is None:  # a whole shard, written by its worker: fsync and marker here
                        written.append(writer.submit(_publish, job, result))
                    else:
                        written.extend(self._sliced(writer, job, open_shards, (shard, first, result)))
                    while written and (written[0].done() or len(written) > finishers + 1):
                        yield written.popleft().result()  # a full queue waits here: no work is submitted meanwhile
                while written:
                    yield written.popleft().result()
        finally:  # a pack that stopped: the partial tars and spool files of unfinished shards (a slice still in
            # a worker may leave one more spool file in _work/, removed with _work/ when a re-run commits)
            for held, *_ in open_shards.values():
                if isinstance(held, ShardStream):
                    held.discard()

    def _work(self, job: WriteJob, specs: Iterable[ShardSpec], whole: int, open_shards: dict,
              spool: bool) -> Iterator[tuple[ShardTask, int | None, bool]]:
        """shard_work's jobs in layout order: the first `whole` shards whole, the rest as slices (registered in
        `open_shards`); `spool` (a local OUTPUT): slices come back as spool files (shard_task.spool_slice)."""
        for k, spec in enumerate(specs):
            task = shard_task(job, spec, self._record, defer_sync=True)
            if k < whole:
                yield task, None, False
                continue
            bounds = slices(task.samples, SLICE_BYTES)
            held = ShardStream(task, [a for a, _ in bounds]) if spool else task
            open_shards[task.shard] = [held, len(bounds), []]
            yield from ((replace(task, samples=task.samples[a:b]), a, spool) for a, b in bounds)

    @staticmethod
    def _sliced(writer: ThreadPoolExecutor, job: WriteJob, open_shards: dict, got: tuple) -> list[Future]:
        """A slice's result (shard, first, encoded) in: handed to its shard's ShardStream on the one finishing
        thread (local OUTPUT: tarred there now, in call order), else kept; once a shard's slices are all back,
        the future of its marker (finish_shard or ShardStream.finish, then fsync and marker)."""
        entry = open_shards[got[0]]
        entry[1] -= 1
        held = entry[0]
        if isinstance(held, ShardStream):
            writer.submit(held.add, got[1], got[2])  # its errors surface in finish
        else:
            entry[2].append(got)
        if entry[1]:
            return []
        del open_shards[got[0]]
        if isinstance(held, ShardStream):
            return [writer.submit(_finish_stream, job, held)]
        return [writer.submit(_finish, job, held, entry[2])]

    def close(self) -> None:
        self._records.clear()
        try:
            if self._pool is not None:
                self._pool.shutdown(cancel_futures=True)
                self._pool = None
        finally:
            if self._frozen:  # the caller's objects are collectable again (a cycle made before the pack is freed)
                gc.unfreeze()
                self._frozen = False


# ---- ray ------------------------------------------------------------------------------------------------------
def pack_records(records: list) -> tuple[np.ndarray, np.ndarray]:
    """Records -> (offsets int64 [n + 1], pickled bytes uint8): one object-store value, sliceable without copying."""
    blobs = [pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL) for r in records]
    offsets = np.zeros(len(blobs) + 1, np.int64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    return offsets, np.frombuffer(b"".join(blobs), np.uint8)


def unpack_record(packed: tuple[np.ndarray, np.ndarray], row: int) -> Any:
    offsets, blob = packed
    return pickle.loads(blob.data[int(offsets[row]): int(offsets[row + 1])])


def _ray_scan(cfg, part: SourcePart) -> tuple[PartScan, tuple[np.ndarray, np.ndarray]]:
    scan, records = scan_part(cfg, part)
    return scan, pack_records(records)


def _ray_write(job: WriteJob, spec: ShardSpec, part_ids: list[int], *packed) -> dict:
    by_part = dict(zip(part_ids, packed))
    return write_shard(shard_task(job, spec, lambda p, r: unpack_record(by_part[p], r)))


def _ray_paths(packed: tuple[np.ndarray, np.ndarray], rows: list[int]) -> list[str]:
    return [str(unpack_record(packed, r)[0].audio) for r in rows]


class RayEngine:
    """Runs scan and write tasks on a Ray cluster: `address` None starts a local one (`ray.init()`), "auto" joins
    the cluster this machine belongs to, or "ray://host:10001". An already initialised Ray is used as it is (and
    not shut down by close()). At most 2 tasks per cluster CPU are in flight, so the driver never holds more than
    that many part results it has not consumed."""

    def __init__(self, address: str | None = None) -> None:
        try:
            import ray
        except ImportError as e:
            raise PackError("--engine ray needs Ray: pip install 'shardtrain[ray]'") from e
        self._ray = ray
        self._owns = not ray.is_initialized()
        if self._owns:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        self._inflight = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
        self._scan_fn = ray.remote(num_returns=2, max_retries=TASK_RETRIES)(_ray_scan)
        self._write_fn = ray.remote(max_retries=TASK_RETRIES)(_ray_write)
        self._paths_fn = ray.remote(max_retries=TASK_RETRIES)(_ray_paths)
        self._records: dict[int, Any] = {}

    def _bounded(self, submit: Callable[[Any], Any], jobs: Iterable[Any]) -> Iterator[Any]:
        """Submit `jobs` with at most self._inflight refs pending; yield each finished ref's value. A task's own
        exception (PackError, ValueError) is re-raised as itself; a task that died TASK_RETRIES + 1 times raises
        PackError."""
        ray, pending = self._ray, []
        try:
            for job in jobs:
                pending.append(submit(job))
                if len(pending) >= self._inflight:
                    done, pending = ray.wait(pending, num_returns=1)
                    yield ray.get(done[0])
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                yield ray.get(done[0])
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, (PackError, ValueError)):
                raise cause from None
            raise
        except ray.exceptions.RayError as e:
            raise PackError(f"a Ray task failed after {TASK_RETRIES} retries ({type(e).__name__}: {e}); shards "
                            "finished so far are kept: re-run the same command to write only the rest") from e
        finally:
            for ref in pending:
                ray.cancel(ref)

    def scan(self, cfg, parts: Iterable[SourcePart], on_part: Callable[[PartScan], None]) -> list[PartScan]:
        def submit(part: SourcePart):
            scan_ref, records_ref = cast(list, self._scan_fn.remote(cfg, part))  # num_returns=2
            self._records[part.index] = records_ref
            return scan_ref

        scans = []
        for scan in self._bounded(submit, parts):
            scans.append(scan)
            on_part(scan)
        return scans

    def path_of(self, part: int, row: int) -> str:
        return self._ray.get(self._paths_fn.remote(self._records[part], [row]))[0]

    def write(self, job: WriteJob, specs: Iterable[ShardSpec], count: int) -> Iterator[dict]:
        job_ref = self._ray.put(job)

        def submit(spec: ShardSpec):
            part_ids = sorted(set(spec.parts.tolist()))
            return self._write_fn.remote(job_ref, spec, part_ids, *(self._records[p] for p in part_ids))

        yield from self._bounded(submit, specs)

    def close(self) -> None:
        self._records.clear()
        if self._owns:
            self._ray.shutdown()
