"""One shard = one task: the layout's samples -> encoded audio -> a byte-reproducible tar -> a done-marker.

    ShardTask(shard, samples, target, fingerprint) -> encode each sample (keep or transcode, decode check)
      -> sort by (stored duration, key) -> ShardWriter into a temp file -> rename / whole-object PUT
      -> publish_marker: fsync the shard (locally), then OUTPUT/_work/shard-NNNNNN.json (index rows, rejects,
         ShardInfo): the engine's proof that the shard is done and on disk (in the task, or with `defer_sync` in
         the driver, while the workers encode the next shards)

Runs in a pool worker or a Ray task; everything it needs is in the task, so a retry rewrites the same bytes.
The task has two halves: encode_slice (the expensive part: read, decode check or transcode) and finish_shard
(sort, tar, hash, publish); write_shard runs both, LocalEngine's pool runs encode_slice on slices of its last
shards in its workers and finish_shard in its driver (engine.py says why), or ShardStream, which tars each slice
as it comes back.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardtrain import faults
from shardtrain.format.codecs import CODECS
from shardtrain.format.tar import MemberOffsets, ShardWriter

if TYPE_CHECKING:  # the worker imports transcoding lazily (forkserver preload)
    from shardtrain.format.audio import AudioInfo
    from shardtrain.pack.item import Item
    from shardtrain.pack.transcode import AudioTarget


# ---- one shard = one task (run in a worker process, or by a cluster engine) ------------------------------------
class PackError(RuntimeError):
    """Packing stopped: a bad item under --strict, or an OUTPUT holding another dataset."""



def error_reason(e: BaseException, default: str) -> tuple[str, str]:
    """(reason code, detail) of a failure: AudioError carries the code in `.reason` and "code: detail" as its
    message; FileNotFoundError is missing_file; anything else is `default` with the exception as detail."""
    if isinstance(e, FileNotFoundError):
        return "missing_file", str(e)
    reason = getattr(e, "reason", None)
    if reason:
        code, _, detail = str(reason).partition(": ")
        msg = str(e)
        return code, detail or (msg[len(code) + 2:] if msg.startswith(code + ": ") else msg)
    return default, f"{type(e).__name__}: {e}"


def _extra_pairs(extra) -> list[tuple[str, object]]:
    if not extra:
        return []
    pairs = extra.items() if isinstance(extra, dict) else extra
    return sorted((str(k), v) for k, v in pairs)


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """One accepted item with its probe result, in the global layout."""

    key: str
    item: Item
    info: AudioInfo
    """Of the source file (headers)."""
    duration_s: float
    """Duration of the utterance (the segment, for a cut), the sort key."""
    est_bytes: int

    def __reduce__(self):  # see format/audio.py AudioInfo.__reduce__
        return (SampleSpec, (self.key, self.item, self.info, self.duration_s, self.est_bytes))

    def identity(self) -> dict:
        """Everything that shapes this sample's bytes; hashed into the dataset fingerprint."""
        it, inf = self.item, self.info
        return {
            "key": self.key, "id": it.id, "audio": str(it.audio), "text": it.text, "start_s": it.start_s,
            "item_duration_s": it.duration_s, "speaker": it.speaker, "language": it.language,
            "extra": _extra_pairs(it.extra), "duration_s": self.duration_s, "est_bytes": self.est_bytes,
            "info": [inf.sample_rate_hz, inf.num_samples, inf.channels, inf.codec],
        }


@dataclass(frozen=True, slots=True)
class ShardTask:
    shard: int
    output: str
    storage_options: dict | None
    samples: list[SampleSpec]
    """[SampleSpec] in layout order."""
    target: AudioTarget
    fingerprint: str
    strict: bool = False
    defer_sync: bool = False
    """The task neither fsyncs its local shard nor writes the done-marker: it returns the marker and the driver
    publishes it (`publish_marker`). Why: an fsync is a wait for the disk (~40 ms per 16 MB here) that idled a
    worker's core; both workers often waited at once (a --no-decode-check pack's write phase 0.8-0.9 s without
    the waits against 1.1-1.35 s with them). Only for a driver on the machine that wrote the file (LocalEngine)."""


def marker_name(i: int) -> str:
    return f"shard-{i:06d}.json"


def sample_json(s: SampleSpec, stored) -> bytes:
    """`<key>.json`: UTF-8, sorted keys, compact. Extra input fields never override the reserved ones."""
    it = s.item
    meta: dict = {
        "id": it.id, "text": it.text, "duration_s": stored.duration_s, "sample_rate_hz": stored.sample_rate_hz,
        "num_samples": stored.num_samples, "channels": stored.channels, "codec": stored.codec,
        "source": str(it.audio),
    }
    if it.speaker is not None:
        meta["speaker"] = it.speaker
    if it.language is not None:
        meta["language"] = it.language
    if it.start_s or it.duration_s is not None:
        meta["start_s"] = float(it.start_s or 0.0)
    for k, v in _extra_pairs(it.extra):
        meta.setdefault(k, v)
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _fault_marker(task: ShardTask):
    """Where an armed `pack.shard` fault records that it fired (the temp folder, keyed by the layout's fingerprint),
    so the retry of a killed task (Ray) or a re-run of the command goes on. Touched only when a fault is armed."""
    from pathlib import Path

    return Path(tempfile.gettempdir()) / f"shardtrain-fault-{task.fingerprint[:16]}-pack.shard-{task.shard}"


def write_shard(task: ShardTask) -> dict:
    """Encode, tar, hash and atomically publish one shard, then its done-marker. Returns the marker:
    `{"fingerprint", "shard", "info": ShardInfo dict, "rows": [index rows], "rejects": [reject rows], "clipped":
    [{id, key, path, samples}: accepted float sources with samples clipped at full scale]}`.

    A sample whose audio fails to encode is left out and recorded (deterministically: same input, same result);
    under `strict` it raises PackError instead. Samples are written in (stored duration_s, key) order.
    Memory: one encoded sample at a time plus the encoded shard's audio (~target_shard_mb); the tar streams
    to a temp file in `_work/` (locally) or the system temp folder (remote OUTPUT, then uploaded whole).
    = encode_slice over the whole shard, then finish_shard (LocalEngine's pool runs the two apart).
    """
    return finish_shard(task, [encode_slice((task, 0))])


def encode_slice(job: tuple[ShardTask, int]) -> tuple[int, int, tuple]:
    """The expensive half of a shard task (read, decode check or transcode, limits) for a slice of its samples:
    `job` = (the shard's task holding only the slice's samples, the slice's first position in the shard).
    Returns (shard, first, encoded) for finish_shard. The `pack.shard` fault fires on the slice at position 0,
    so an armed fault kills the worker that starts the shard, sliced or not."""
    task, first = job
    if first == 0:
        faults.point("pack.shard", task.shard, once_marker=_fault_marker(task))
    return task.shard, first, _encode_all(task)


@dataclass(frozen=True, slots=True)
class SpooledSlice:
    """A slice's samples as whole tar members in a file of its own (spool_slice), for ShardStream to append."""

    path: str
    nbytes: int
    members: list[tuple[int, AudioInfo, MemberOffsets]]
    """(position in the slice, stored AudioInfo, offsets within the spool file) per encoded sample, slice order."""


def spool_path(task: ShardTask, first: int) -> str:
    """Local path of the spool file of the slice of shard `task.shard` starting at `first` (in OUTPUT/_work)."""
    return os.path.join(_local_work_dir(task), f"{_tar_name(task.shard)}.{first:06d}.spool")


def _local_work_dir(task: ShardTask) -> str:
    """OUTPUT/_work of a local OUTPUT, as a path: where temp tars and spool files live until renamed or removed."""
    from shardtrain import storage

    return storage.fs_and_path(storage.join(task.output, "_work"), task.storage_options)[1]


def spool_slice(job: tuple[ShardTask, int]) -> tuple[int, int, tuple]:
    """encode_slice for a local OUTPUT: the slice's samples are written as tar members to a spool file
    (spool_path) instead of coming back pickled. Returns (shard, first, (SpooledSlice, rejects, clipped)).

    Why: a pickled slice is copied four times more (pickle, pipe, the driver's read, unpickle), which cost the
    driver ~0.2 s of CPU per 125 MB beside the tar and hash (a one-shard pack of 2,000 files on 2 cores, where
    the driver's CPU is taken from the decoding); a spool file is written once here (into the page cache: it is
    removed before the kernel writes it back) and read once by the driver into a reused buffer."""
    task = job[0]
    _, first, (ok, rejects, clipped) = encode_slice(job)
    path = spool_path(task, first)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    members = []
    try:
        with open(path, "wb") as f:
            w = ShardWriter(f, hashed=False)
            for i, stored, data, meta in ok:
                members.append((i, stored, w.add(task.samples[i].key, stored.codec, data, meta)))
    except BaseException:
        if os.path.exists(path):
            os.unlink(path)
        raise
    return task.shard, first, (SpooledSlice(path, w.bytes, members), rejects, clipped)


def shard_work(job: tuple[ShardTask, int | None, bool]) -> tuple[int, int | None, Any]:
    """What LocalEngine's pool runs: `(task, None, _)` writes the whole shard (write_shard: returns its marker),
    `(slice task, first, spool)` encodes a slice: to a spool file (spool_slice) or pickled back (encode_slice).
    Returns (shard, first, result)."""
    task, first, spool = job
    if first is None:
        return task.shard, None, write_shard(task)
    return spool_slice((task, first)) if spool else encode_slice((task, first))


def finish_shard(task: ShardTask, slices: list[tuple[int, int, tuple]]) -> dict:
    """The cheap half of a shard task: encode_slice results covering `task.samples` (any order) -> sort by
    (stored duration_s, key) -> tar -> sha256 -> publish (and the marker unless defer_sync). Rejects and clipped
    notes keep layout order (the slices' order), so the marker is the same however the shard was sliced."""
    encoded, rejects, clipped = [], [], []
    for _, first, (ok, rej, clip) in sorted(slices, key=lambda s: s[1]):
        encoded += [_entry(task, first, i, stored, data, meta) for i, stored, data, meta in ok]
        rejects += rej
        clipped += clip
    encoded.sort(key=lambda e: (e[0], e[1]))
    tar = _TarOut(task)
    try:
        for e in encoded:
            tar.add(e)
        rows, nbytes, sha = tar.commit()
    finally:
        tar.abort()
    return _done(task, tar.name, rows, nbytes, sha, (rejects, clipped))


def _entry(task: ShardTask, first: int, i: int, stored, data: bytes, meta: bytes) -> tuple:
    """One encoded sample as the tar takes it: (stored duration_s, key, SampleSpec, stored info, audio, json)."""
    s = task.samples[first + i]
    return stored.duration_s, s.key, s, stored, data, meta


def _done(task: ShardTask, name: str, rows: list[dict], nbytes: int, sha: str, notes: tuple[list, list]) -> dict:
    """The done-marker of a written shard (published here unless defer_sync); `notes` = (rejects, clipped)."""
    durations = [r["duration_s"] for r in rows]
    marker = {
        "fingerprint": task.fingerprint,
        "shard": task.shard,
        "info": {"name": name, "samples": len(rows), "seconds": sum(durations),
                 "min_duration_s": min(durations, default=0.0), "max_duration_s": max(durations, default=0.0),
                 "bytes": nbytes, "sha256": sha},
        "rows": rows,
        "rejects": notes[0],
        "clipped": notes[1],
    }
    if not task.defer_sync:
        publish_marker(task.output, task.storage_options, marker, synced=True)
    return marker


class ShardStream:
    """finish_shard for a shard whose slices come back one by one as spool files (spool_slice; LocalEngine, local
    OUTPUT): each slice's members are appended to the shard's tar and hashed as soon as every slice before it is
    in, while the workers still decode the next ones, instead of the whole shard after its last slice (a
    one-shard pack of 2,000 files, ~125 MB, waited ~0.4 s for that here with both workers idle).

    Streaming is right only while the slices, in layout order, are already in (stored duration_s, key) order,
    which they are when the stored duration is the probed one (kept audio: the layout sorted by it). The first
    sample out of that order ends the streaming: `finish` reads every slice back (from the partial tar, or its
    spool file) and runs finish_shard, so the bytes are those of finish_shard either way. Memory: the slices'
    index rows and one buffer of the largest slice; the audio stays in files (page cache). A spool file is
    removed once appended (a slice added after the streaming ended: by finish, or discard). One thread must call
    add and finish (the tar is written in call order)."""

    def __init__(self, task: ShardTask, starts: list[int]) -> None:
        self.task, self.starts = task, starts
        """`starts`: each slice's first position in task.samples, ascending (the slices cover them)."""
        self.got: dict[int, tuple] = {}
        self.next = 0
        self.tar: _TarOut | None = None
        self.base: dict[int, int] = {}
        """First position of an appended slice -> where its members start in the tar."""
        self.last: tuple | None = None
        self.streaming = True
        self.error: BaseException | None = None
        self._buf = bytearray()

    def add(self, first: int, result: tuple) -> None:
        """A spool_slice result (SpooledSlice, rejects, clipped) of the slice at `first`; appends what is ready.
        An error ends the shard's streaming and is raised again by finish (the engine does not wait for add)."""
        self.got[first] = result
        try:
            while self.streaming and self.next < len(self.starts) and self.starts[self.next] in self.got:
                self._append(self.starts[self.next])
                self.next += 1
            if self.streaming and self.tar is not None:
                self.tar.start_writeback()
        except BaseException as e:
            self.error = e
            self.streaming = False
            raise

    def _append(self, first: int) -> None:
        spool: SpooledSlice = self.got[first][0]
        order = [(stored.duration_s, self.task.samples[first + i].key) for i, stored, _ in spool.members]
        if (self.last is not None and order and order[0] < self.last) or order != sorted(order):
            self.streaming = False  # out of order: finish sorts the whole shard
            return
        if self.tar is None:
            self.tar = _TarOut(self.task)
        self.base[first] = self.tar.append_spool(self.task, first, spool,
                                                 self._read(spool.path, 0, spool.nbytes, "its slice wrote"))
        os.unlink(spool.path)
        if order:
            self.last = order[-1]

    def _read(self, path: str, offset: int, nbytes: int, whose: str) -> memoryview:
        """`nbytes` of `path` from `offset`, in a buffer reused across slices (a fresh 2 MB one per slice costs
        page faults); valid until the next call."""
        if len(self._buf) < nbytes:
            self._buf = bytearray(nbytes)
        view = memoryview(self._buf)[:nbytes]
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise PackError(f"{path} is gone, where {whose} {nbytes} bytes: was it removed while packing? Re-run "
                            "the same command") from None
        try:
            got = 0
            while got < nbytes:
                n = os.preadv(fd, [view[got:]], offset + got)
                if not n:
                    break
                got += n
        finally:
            os.close(fd)
        if got != nbytes:
            raise PackError(f"{path} holds {got} bytes from {offset} where {whose} {nbytes}: was it changed or "
                            "removed while packing? Re-run the same command")
        return view

    def discard(self) -> None:
        """Remove the partial tar and every spool file this shard still has (a pack that stops before finish)."""
        if self.tar is not None:
            self.tar.abort()
            self.tar = None
        for result in self.got.values():
            if os.path.exists(result[0].path):
                os.unlink(result[0].path)

    def finish(self) -> dict:
        """The shard's marker, once every slice was added (as finish_shard returns it)."""
        try:
            if self.error is not None:
                raise self.error
            if self.tar is None or not self.streaming:
                if self.tar is not None:
                    self.tar.f.flush()  # the slices appended before the streaming ended are read back from it
                return finish_shard(self.task, [self._unspooled(a) for a in self.starts])
            rows, nbytes, sha = self.tar.commit()
        finally:
            self.discard()
        notes: tuple[list, list] = ([], [])
        for a in self.starts:
            notes[0].extend(self.got[a][1])
            notes[1].extend(self.got[a][2])
        return _done(self.task, _tar_name(self.task.shard), rows, nbytes, sha, notes)

    def _unspooled(self, first: int) -> tuple[int, int, tuple]:
        """A slice as encode_slice returns it (its members read back), for finish_shard."""
        spool, rejects, clipped = self.got[first]
        if first in self.base:
            assert self.tar is not None
            data = bytes(self._read(self.tar.tmp, self.base[first], spool.nbytes, "the tar holds a slice of"))
        else:
            data = bytes(self._read(spool.path, 0, spool.nbytes, "its slice wrote"))
        ok = [(i, stored, data[o.audio_offset:o.audio_offset + o.audio_size],
               data[o.json_offset:o.json_offset + o.json_size]) for i, stored, o in spool.members]
        return self.task.shard, first, (ok, rejects, clipped)


def publish_marker(output: str, storage_options: dict | None, marker: dict, synced: bool = False) -> None:
    """Make a written shard durable, then write its done-marker `_work/shard-NNNNNN.json` (atomic, fsynced).

    The order is the resume guarantee: a marker exists only for a shard whose bytes reached the disk first, so a
    re-run after a crash (power loss included) never trusts a shard the crash cut short; a shard without its
    marker is written again. `synced`: the task fsynced the shard already. A remote shard was one whole-object
    PUT, durable when the PUT returned."""
    from shardtrain import storage

    if not synced:
        storage.sync(storage.join(output, marker["info"]["name"]), storage_options)
    storage.atomic_write_bytes(storage.join(output, "_work/" + marker_name(marker["shard"])),
                               json.dumps(marker, sort_keys=True).encode(), storage_options)


def _encode_all(task: ShardTask) -> tuple[list[tuple], list[dict], list[dict]]:
    """Encode every sample of the task: ([(position in task.samples, stored info, bytes, json)] in layout order,
    [reject rows], [clipped rows: float sources with samples clipped at full scale]). One failing sample is a
    reject (PackError under strict), never the whole shard; so is one a reader would refuse (format/limits via
    itemcheck.stored_problem: member sizes, stored rate)."""
    from shardtrain.pack.itemcheck import ItemError, stored_problem
    from shardtrain.pack.transcode import encode_for_shard

    encoded, rejects, clipped = [], [], []
    for i, s in enumerate(task.samples):
        notes: dict = {}
        try:
            data, stored = encode_for_shard(s.item, s.info, task.target, task.storage_options, notes=notes)
            if stored.codec not in CODECS:
                raise ValueError(f"stored codec {stored.codec!r} is not one of {CODECS}")
            if stored.num_samples <= 0 or not data:
                raise ValueError("encoded audio is empty")
            meta = sample_json(s, stored)
            problem = stored_problem(s.item, stored, len(data), len(meta))  # what a reader would refuse
            if problem is not None:
                raise ItemError(*problem)
        except Exception as e:  # noqa: BLE001 - any failure of one sample rejects that sample only
            reason, detail = error_reason(e, "encode_failed")
            if task.strict:
                raise PackError(f"--strict: cannot encode {s.item.id!r} ({s.item.audio}): {reason}: {detail}. "
                                "Fix the input, or drop --strict to skip it and record it in rejects.jsonl") from e
            rejects.append({"id": s.item.id, "key": s.key, "path": str(s.item.audio), "reason": reason,
                            "detail": detail})
            continue
        encoded.append((i, stored, data, meta))
        if notes.get("clipped"):
            clipped.append({"id": s.item.id, "key": s.key, "path": str(s.item.audio), "samples": notes["clipped"]})
    return encoded, rejects, clipped


_LIBC: list = []


def _sync_file_range(fd: int, offset: int, n: int) -> bool:
    """sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE): start writing those bytes to disk and return (the
    fsync that makes them durable still comes, in publish_marker). False where libc has no such call."""
    if not _LIBC:
        import ctypes

        try:
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
            _LIBC.append(fn)
        except (OSError, AttributeError):  # not Linux (glibc or musl)
            _LIBC.append(None)
    return _LIBC[0] is not None and _LIBC[0](fd, offset, n, 2) == 0  # 2: SYNC_FILE_RANGE_WRITE


def _tar_name(shard: int) -> str:
    """shard-NNNNNN.tar (format.manifest.shard_name, without importing the index code into a worker)."""
    return f"shard-{shard:06d}.tar"


class _TarOut:
    """A shard's tar being written: a temp file (OUTPUT/_work locally, this user's private temp folder for a remote OUTPUT:
    storage.private.temp_file, which sweeps what killed packs left there)
    through a ShardWriter, and the index row of each sample added. `commit` closes it, fsyncs it (unless
    `defer_sync`: publish_marker does), publishes it atomically (rename, or one whole-object upload) and returns
    (index rows, bytes, sha256); `abort` removes the temp file (a no-op after commit)."""

    def __init__(self, task: ShardTask) -> None:
        from shardtrain import storage

        self.task, self.name = task, _tar_name(task.shard)
        self.rows: list[dict] = []
        if storage.is_local(task.output):
            work_dir = _local_work_dir(task)
            os.makedirs(work_dir, exist_ok=True)
            fd, self.tmp = tempfile.mkstemp(prefix=self.name + ".", suffix=".tmp", dir=work_dir)
        else:
            from shardtrain.storage.private import temp_file

            fd, self.tmp = temp_file(self.name, ".tmp")
        self.f = os.fdopen(fd, "wb")
        self.w = ShardWriter(self.f)
        self.flushed = 0
        """Bytes whose writeback start_writeback has started."""

    def add(self, entry: tuple) -> None:
        """entry = (duration_s, key, SampleSpec, stored AudioInfo, audio bytes, json bytes)."""
        duration_s, key, s, stored, data, meta = entry
        self._row(duration_s, key, s, stored, self.w.add(key, stored.codec, data, meta))

    def append_spool(self, task: ShardTask, first: int, spool: SpooledSlice, data: memoryview) -> int:
        """A spooled slice (its file's bytes: `data`) appended whole, with its samples' index rows; returns the
        offset its members start at."""
        base = self.w.append(data)
        for i, stored, o in spool.members:
            s = task.samples[first + i]
            self._row(stored.duration_s, s.key, s, stored, MemberOffsets(
                offset=base + o.offset, size=o.size, audio_offset=base + o.audio_offset, audio_size=o.audio_size,
                json_offset=base + o.json_offset, json_size=o.json_size))
        return base

    def _row(self, duration_s: float, key: str, s: SampleSpec, stored, o: MemberOffsets) -> None:
        self.rows.append({
            "key": key, "shard": self.task.shard, "offset": o.offset, "size": o.size,
            "audio_offset": o.audio_offset, "audio_size": o.audio_size, "json_offset": o.json_offset,
            "json_size": o.json_size, "codec": stored.codec, "duration_s": duration_s,
            "num_samples": stored.num_samples, "sample_rate_hz": stored.sample_rate_hz,
            "channels": stored.channels, "text": s.item.text, "speaker": s.item.speaker,
            "language": s.item.language, "source": str(s.item.audio),
        })

    def start_writeback(self) -> None:
        """Start the disk writes of what was added since the last call, without waiting for them (Linux
        sync_file_range; elsewhere nothing), so the fsync after the last sample finds little left to write: a
        streamed 125 MB shard's fsync took ~60 ms at the end of the pack here, ~1 ms after this."""
        self.f.flush()
        end = self.w.bytes
        if end > self.flushed and _sync_file_range(self.f.fileno(), self.flushed, end - self.flushed):
            self.flushed = end

    def commit(self) -> tuple[list[dict], int, str]:
        from shardtrain import storage

        with self.f:
            self.w.close()
            self.f.flush()
            if not self.task.defer_sync:
                os.fsync(self.f.fileno())
        storage.commit_local_file(self.tmp, storage.join(self.task.output, self.name), self.task.storage_options)
        return self.rows, self.w.bytes, self.w.sha256

    def abort(self) -> None:
        self.f.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)
