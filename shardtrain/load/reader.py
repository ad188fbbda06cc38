"""Reading and decoding one planned chunk: ranged reads by index offsets, no tar parsing, decode in threads.

    Chunk(rows) -> byte runs (shard, start, end), neighbours within 1 MB merged -> a local shard's run mapped
      (storage.map_range), a remote one read (retry + resume at the byte reached; optional whole-shard LRU cache)
      -> per row: ustar headers (checksum, name = index key, size = index size), json text = index text,
         decode into its batch row (dr_flac for FLAC, else libsndfile; thread pool, no GIL)
      -> ChunkBatches: per batch padded PCM [B, T] (pcm_dtype) in recycled buffers (buffers.py)

Bad data never stops the stream unless `strict`: a sample that fails is recorded with its key and reason
(decode_error, truncated_shard, index_mismatch, bad_header, bad_json) and left out of its batch (the loader stops
when more than `max_skipped_share` of an epoch is skipped). A storage failure is not bad data: transient errors
are retried under `retry_budget_s`, and a hopeless one (403, 404, budget spent) raises StreamError naming the URL.
"""
from __future__ import annotations

import functools
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Generator, Iterable, Iterator, NamedTuple, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
import torch

from shardtrain import storage
from shardtrain.format.arrownp import arrow_of, numpy_of
from shardtrain.format.audio import AudioError, decode_into
from shardtrain.format.codecs import CODECS
from shardtrain.format.manifest import Dataset
from shardtrain.format.tar import BLOCK, KEY_RE, parse_header
from shardtrain.format.validate import MAX_JSON_BYTES, show
from shardtrain.load.buffers import BatchBuffers, release_spans
from shardtrain.load.errors import StreamError
from shardtrain.load.plan import CHECK_COLUMNS, PLAN_COLUMNS, RUN_GAP_BYTES, Chunk, PlanIndex
from shardtrain.load.pool import OldestFirstPool
from shardtrain.storage.cache import ShardCache

if TYPE_CHECKING:
    from shardtrain.load.config import StreamConfig

ROWS_PER_TASK = 4
"""Rows per decode task: one queue handoff and one Future per 4 rows instead of per row (that bookkeeping runs
under the GIL; with the DataLoader bypass it gained +6% in an A/B of 6 alternating runs); still
~20 tasks per chunk for 3 threads to share."""
MAX_REASON_CHARS = 300
"""Skip reasons kept in stats/state are cut to this; their shard-derived parts are escaped (validate.show)."""


@dataclass(slots=True)
class ChunkBatches:
    """What a reader hands over for one chunk: its padded batches plus the chunk's errors."""

    epoch: int
    first_step: int
    batches: list
    """Per batch (pcm, lengths, keys, texts, durations_s, index rows of the kept utterances); from
    `ChunkReader.start`, one Future per batch of such a one-batch ChunkBatches instead."""
    errors: list[dict]
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent per stage on this chunk, summed over threads: read, parse, decode, batch."""


_JSON = json.JSONDecoder()
_USTAR_MAGIC = np.frombuffer(b"ustar\x0000", np.uint8)
_OCTAL = ((100, 108), (108, 116), (116, 124), (124, 136), (136, 148), (329, 337), (337, 345))
"""mode, uid, gid, size, mtime, devmajor, devminor: "%0*o" digits and a NUL, as tarfile (the writer) makes them."""


def _octal(h: np.ndarray, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(value, well formed) per header of the octal digits h[:, a:b] (all '0'-'7')."""
    d = h[:, a:b].astype(np.int64) - 48
    good = np.asarray(((d >= 0) & (d <= 7)).all(axis=1))
    return d @ (8 ** np.arange(b - a - 1, -1, -1, dtype=np.int64)), good


def headers_ok(arr: np.ndarray, offs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Bool per header (`offs`: the first byte of each 512-byte header in `arr`): a plain POSIX ustar regular-file
    header in tarfile's own layout (octal fields of digits and a NUL, or all NUL; checksum "%06o\\0 ", ASCII names, no prefix),
    with a valid checksum and the size `sizes`. Everything format.tar.parse_header's fast path accepts in that
    layout, nothing it refuses; False sends a header to the row-by-row check. One [R, 512] array, no loop."""
    if len(offs) == 0:
        return np.zeros(0, bool)
    # rows of a strided view, copied 512 bytes at a time: an [R, 512] int64 index array to gather them cost
    # ~1.6 us a row (4 KB of index per header), this ~0.1 us
    h = sliding_window_view(arr, BLOCK)[np.asarray(offs, np.int64)]
    ok = (h[:, 257:265] == _USTAR_MAGIC).all(axis=1) & (h[:, 156] == ord("0"))
    ok &= ~h[:, 157:257].any(axis=1) & ~h[:, 345:500].any(axis=1) & (h[:, :345] < 128).all(axis=1)
    for a, b in _OCTAL:
        v, good = _octal(h, a, b - 1)
        empty = ~h[:, a:b].any(axis=1)  # an all-NUL field reads as 0 (devmajor/devminor of a regular file)
        ok &= (good & (h[:, b - 1] == 0)) | empty
        v[empty] = 0
        if a == 124:
            ok &= v == np.asarray(sizes, np.int64)
    chk, good = _octal(h, 148, 154)
    ok &= good & (h[:, 154] == 0) & (h[:, 155] == 32)
    return ok & (chk == h.sum(axis=1, dtype=np.int64) - h[:, 148:156].sum(axis=1, dtype=np.int64) + 256)


def _strings(col, rows: np.ndarray) -> list[str]:
    """Rows of a `key`/`text` column: one Arrow take for an Arrow array, else row by row (MappedStrings)."""
    if hasattr(col, "take"):
        return col.take(arrow_of(rows)).to_pylist()
    return [col[int(r)] for r in rows]


class _LazyBatch:
    """A padded batch [rows, longest] whose memory is taken from the pool when a decode thread first needs a row.

    Any decode thread may ask first (one lock a batch, taken once per row: ~0.2 us); the padding of every row is
    zeroed then (recycled memory), the decoder writes the rest. A batch none of whose rows was decoded (all
    failed their checks) is taken when the chunk is assembled."""

    __slots__ = ("lengths", "dtype", "pcm", "lock")

    def __init__(self, lengths: list[int], dtype: type):
        self.lengths, self.dtype = lengths, dtype
        self.pcm: np.ndarray | None = None
        self.lock = threading.Lock()

    def array(self, pool: BatchBuffers) -> np.ndarray:
        with self.lock:
            if self.pcm is None:
                pcm = pool.take(len(self.lengths), max(self.lengths, default=0), self.dtype)
                for i, n in enumerate(self.lengths):
                    pcm[i, n:] = 0
                self.pcm = pcm
            return self.pcm

    def row(self, i: int, pool: BatchBuffers) -> np.ndarray:
        return self.array(pool)[i, :self.lengths[i]]


def _byte_runs(idx: PlanIndex, rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(shard, start, end) byte ranges covering `rows` (ascending), merging rows separated by small gaps."""
    return [run[:3] for run in _runs_with_rows(idx, rows)]


def _runs_with_rows(idx: PlanIndex, rows: np.ndarray) -> list[tuple[int, int, int, np.ndarray]]:
    """`_byte_runs` with the rows each run reads: every row in exactly one run, in ascending byte order inside it.
    A mixture's gathered index may hold a sample twice (a dataset repeated to its weight): the second copy never
    joins a run already past its bytes, so it gets a run (a buffer) of its own, and no row is read or counted
    twice (a batch resolves when each of its rows is in once; a decoded row's pages are released)."""
    runs: list[list] = []
    for r in rows:
        s, a, b = int(idx.shard[r]), int(idx.offset[r]), int(idx.offset[r] + idx.size[r])
        if runs and runs[-1][0] == s and 0 <= a - runs[-1][2] <= RUN_GAP_BYTES:
            runs[-1][2] = max(runs[-1][2], b)
            runs[-1][3].append(int(r))
        else:
            runs.append([s, a, b, [int(r)]])
    return [(s, a, b, np.asarray(rr, np.int64)) for s, a, b, rr in runs]


class ChunkReader:
    """Reads and decodes chunks; one per loader iteration (its threads are the loader's decode threads)."""

    def __init__(self, ds: Dataset, idx: PlanIndex, cfg: StreamConfig):
        self.ds, self.idx, self.cfg = ds, idx, cfg
        self.decode_pool = OldestFirstPool(cfg.decode_threads, "decode")
        self.buffers = BatchBuffers(keep=(cfg.prefetch_chunks + 1) * cfg.bucket.batches_per_chunk + 4)
        """Batches: what is in flight plus the trainer's."""
        self.run_buffers = BatchBuffers(keep=0)
        """Bytes of the runs being read and decoded: mapped per run and unmapped once its rows are decoded. Runs
        are 1-10 MB and rarely fit a kept block (45 of 58 fresh with one kept); kept, idle run blocks were ~10 MB
        of the 6k benchmark corpus's peak RSS (703 -> 689-694 MB). Their page faults happen in the read thread's
        kernel copy, not in the decoder (~60k an epoch of the 4k speech corpus)."""
        self.io_pool = ThreadPoolExecutor(cfg.prefetch_chunks, thread_name_prefix="read")
        self.pins: dict = {}
        """Each shard's version as first read (S3 ETag, local inode/size/mtime): every later read is held to it."""
        self.cache = (ShardCache(cfg.cache_dir, int(cfg.cache_max_gb * 1e9))
                      if cfg.cache_dir and not storage.is_local(ds.url) else None)
        self.seen: set[int] = set()
        """Shards read at least once: before a shard's first read, its dataset must still be the one opened."""

    def _fill(self, shard: int, start: int, out: memoryview) -> Iterator[int]:
        """Fill `out` with bytes [start, start + len(out)) of a shard, yielding the count filled after each piece;
        ends early when the shard is truncated. Transient errors are retried inside storage for up to
        `retry_budget_s`; what escapes is hopeless (see `_read_failed`)."""
        url = self.ds.shard_url(shard)
        so = self.ds.storage_options
        kw: dict[str, Any] = dict(retries=self.cfg.retries, budget_s=self.cfg.retry_budget_s,
                                  piece_bytes=int(self.cfg.piece_mb * (1 << 20)), backoff_s=self.cfg.retry_backoff_s,
                                  direct_http=self.cfg.s3_direct_http, pins=self.pins)
        if self.cache is None:
            return storage.fill_range(url, start, out, so, **kw)
        info = self.ds.shards[shard]  # streamed to local disk on a miss; read from an open file (safe to evict)
        pieces = self.cache.read(info.name, info.sha256, info.bytes, lambda: storage.iter_range(url, 0, None, so, **kw),
                                 start, start + len(out), kw["piece_bytes"])
        return storage.copy_into(pieces, out)

    def _read_failed(self, shard: int, e: OSError) -> StreamError:
        """The loud error for a shard read that storage gave up on: infrastructure, not data, so never a skip.

        Names the shard URL, the status and what to check; training stops and resumes from its last checkpoint."""
        url = self.ds.shard_url(shard)
        if isinstance(e, storage.StorageUnavailable):
            hint = "storage unreachable for the whole retry budget"
        elif isinstance(e, storage.ObjectChanged):
            hint = ("the shard changed while this run read it (re-packed or overwritten in place): its rows would "
                    "mix two versions; pack into a new folder/prefix instead of over a dataset in use, then start "
                    "a fresh run")
        elif isinstance(e, PermissionError):
            hint = ("access denied (HTTP 403): check the credentials (key/secret/token, AWS_* variables), their "
                    "expiry, and the bucket policy")
        elif isinstance(e, FileNotFoundError):
            hint = ("shard missing (HTTP 404 / no such file): the dataset is incomplete or was changed after "
                    "packing; re-run `shardtrain pack` or `shardtrain inspect --verify`")
        else:
            hint = "unexpected storage error"
        return StreamError(f"cannot read shard {url}: {hint}: {e}")

    def _decode(self, buf: memoryview, base: int, have: int, row: int, out: np.ndarray,
                checked: tuple[str, str, str | None, float] | None = None) -> tuple:
        """Decode one row of a run's bytes straight into `out` (its zeroed row of the padded batch).

        Returns (key, text, samples written, error or None, parse s, decode s). Before decoding, what was read
        is checked against the index: both ustar headers (checksum, regular member, name = index key, size =
        index size) and the json (bounded parse, text and num_samples = the index's), by `_check_rows` for a whole
        piece of a run (`checked`: its verdict and seconds per row) or here by `_check_row`. A stale, foreign or
        tampered shard then costs a counted skip, never a wrong sample. The key reported is the index's (checked
        on open), so nothing from the shard's bytes reaches logs or state unescaped. Decoding into the batch row
        saves the int16 intermediate and a copy.
        """
        t0 = time.perf_counter()
        if checked is None:
            key, text, err = self._check_row(buf, base, have, row)
            t_parse = time.perf_counter() - t0
        else:
            key, text, err, t_parse = checked
        if err is not None:
            return key, "", 0, err, t_parse, 0.0
        idx = self.idx
        a0, a_len = int(idx.audio_offset[row]) - base, int(idx.audio_size[row])
        t1 = time.perf_counter()
        want = len(out)
        try:
            got = decode_into(buf[a0:a0 + a_len], out)
        except AudioError as e:  # NaN/Inf in a float source (format.audio.float_peak) is its own skip reason
            why = f"non_finite_audio: {show(e.detail, 200)}" if e.reason == "non_finite_audio" else \
                f"decode_error: {show(str(e), 200)}"
            return key, text, 0, why, t_parse, time.perf_counter() - t1
        t2 = time.perf_counter()
        if got < want:
            return key, text, 0, f"decode_error: {got} of {want} samples decoded (truncated or damaged audio)", t_parse, t2 - t1
        return key, text, got, None, t_parse, t2 - t1

    def _check_rows(self, buf: memoryview, base: int, have: int, rows: list[int],
                    strings: dict[int, tuple] | None = None) -> list[tuple]:
        """`_check_row`'s verdicts for many rows of one run at once, the costly parts over numpy arrays.

        The ustar headers the writer makes (`headers_ok`: every header of the piece in one [2R, 512] array) and
        the keys and transcripts (one Arrow `take`) are checked for all rows together; the json is parsed per row
        (bounded, as before). A row whose headers are anything else (another writer's, damaged) goes through
        `_check_row`, so every verdict and message is the same as row by row. Measured on the 4k benchmark
        corpus: ~58 us a row row by row, ~25 us here (GIL-held time that the decode threads wait on)."""
        idx = self.idx
        if idx.key is None or not rows:
            return [self._check_row(buf, base, have, r) for r in rows]
        r = np.asarray(rows, np.int64)
        a0, a_len = idx.audio_offset[r] - base, idx.audio_size[r]
        j0, j_len = idx.json_offset[r] - base, idx.json_size[r]
        inside = (a0 >= BLOCK) & (j0 >= BLOCK) & (a0 + a_len <= have) & (j0 + j_len <= have) & (j_len <= MAX_JSON_BYTES)
        ok = inside.copy()
        if inside.any():
            arr = np.frombuffer(buf, np.uint8, count=have)
            w = np.flatnonzero(inside)
            ok[w] = headers_ok(arr, np.concatenate([a0[w], j0[w]]) - BLOCK, np.concatenate([a_len[w], j_len[w]])) \
                .reshape(2, -1).all(axis=0)
        if strings is None:
            strings = self._index_strings(r)
        keys = [strings[row][0] for row in rows]
        texts = [strings[row][1] for row in rows] if idx.text is not None else None
        out: list[tuple] = []
        for i, row in enumerate(rows):
            if not ok[i]:
                out.append(self._check_row(buf, base, have, row))
                continue
            key = keys[i]
            a, j = int(a0[i]), int(j0[i])
            stem, _, ext = bytes(buf[a - BLOCK:a - BLOCK + 100]).split(b"\0", 1)[0].decode().rpartition(".")
            jname = bytes(buf[j - BLOCK:j - BLOCK + 100]).split(b"\0", 1)[0].decode()
            if stem != key or ext not in CODECS or jname != f"{key}.json":
                out.append(self._check_row(buf, base, have, row))  # the message names both members
                continue
            try:  # UTF-8 straight to the decoder (json.loads sniffs the encoding first); anything else row by row
                meta = _JSON.decode(bytes(buf[j:j + int(j_len[i])]).decode("utf-8"))
            except (ValueError, RecursionError):
                out.append(self._check_row(buf, base, have, row))
                continue
            out.append((key, *self._meta_verdict(meta, row, texts[i] if texts else None)))
        return out

    def _index_strings(self, rows: np.ndarray) -> dict[int, tuple]:
        """row -> (key, transcript or None) from the index, for many rows at once: one Arrow `take` per column
        costs ~0.5 ms whatever its size, so a chunk takes them once, not each piece of each run."""
        idx = self.idx
        keys = _strings(idx.key, rows)
        texts = _strings(idx.text, rows) if idx.text is not None else [None] * len(keys)
        return dict(zip(rows.tolist(), zip(keys, texts)))

    def _check_row(self, buf: memoryview, base: int, have: int, row: int) -> tuple[str, str, str | None]:
        """(key, text, error or None) for one row: its bytes present, headers and json as the index says."""
        idx = self.idx
        a0, a_len = int(idx.audio_offset[row]) - base, int(idx.audio_size[row])
        j0, j_len = int(idx.json_offset[row]) - base, int(idx.json_size[row])
        key = idx.string_at("key", row) if idx.key is not None else f"row{row}"
        if a0 < BLOCK or j0 < BLOCK or a0 + a_len > have or j0 + j_len > have:
            return key, "", "truncated_shard: sample bytes past the end of the shard"
        if j_len > MAX_JSON_BYTES:
            return key, "", f"index_mismatch: json member of {j_len} bytes exceeds {MAX_JSON_BYTES}"
        names = []
        for off, size in ((a0, a_len), (j0, j_len)):
            try:
                name, hsize = parse_header(bytes(buf[off - BLOCK:off]))
            except ValueError as e:
                return key, "", f"bad_header: at byte {base + off - BLOCK}: {e}"
            if hsize != size:
                return key, "", f"index_mismatch: member {show(name)} holds {hsize} bytes, the index says {size}"
            names.append(name)
        stem, _, ext = names[0].rpartition(".")
        if idx.key is None and KEY_RE.match(stem):
            key = stem
        if stem != key or ext not in CODECS or names[1] != f"{key}.json":
            return key, "", f"index_mismatch: members {show(names[0])}, {show(names[1])} are not sample {key!r}"
        return (key, *self._check_json(buf, j0, j_len, row,
                                       idx.string_at("text", row) if idx.text is not None else None))

    def _check_json(self, buf: memoryview, j0: int, j_len: int, row: int,
                    want_text: str | None) -> tuple[str, str | None]:
        """(text, error or None) of a row's `<key>.json` (already bounded by MAX_JSON_BYTES): parsed, its text
        and num_samples the index's (`want_text`: the index's transcript, when held)."""
        try:
            meta = json.loads(bytes(buf[j0:j0 + j_len]))
        except RecursionError:
            return "", "bad_json: nested too deeply"
        except ValueError as e:  # UnicodeDecodeError is a ValueError
            return "", f"bad_json: {show(str(e), 120)}"
        return self._meta_verdict(meta, row, want_text)

    def _meta_verdict(self, meta: Any, row: int, want_text: str | None) -> tuple[str, str | None]:
        text = meta.get("text", "") if isinstance(meta, dict) else None
        if not isinstance(text, str):
            return "", "bad_json: no text string in the sample's json"
        if want_text is not None and text != want_text:
            return "", "index_mismatch: the json transcript differs from the index's"
        ns = int(self.idx.num_samples[row])
        if meta.get("num_samples", ns) != ns:
            return "", f"index_mismatch: json num_samples {show(meta.get('num_samples'))} != index"
        return text, None

    def _decode_rows(self, buf: memoryview, base: int, have: int, rows: list, track: "_Tracker") -> None:
        """One decode task: rows (row, (batch, lazy batch, slot), check verdict) of one batch whose bytes are all
        in `buf`; the results go to `track`, which hands the batch over once its last row is in. A decoded row's
        audio bytes are needed no more: `track` gives their pages back to the kernel when the batch is handed
        over, the whole batch's rows in one system call (buffers.release_spans: each call's TLB flush interrupts
        the other decode threads' cores; one a batch instead of one a task: ~1.8% of the loader's CPU less)."""
        addr = np.frombuffer(buf, np.uint8).ctypes.data
        done, spans = [], []
        for r, (b, lazy, i), chk in rows:
            done.append((r, self._decode(buf, base, have, r, lazy.row(i, self.buffers), chk)))
            a0 = addr + int(self.idx.audio_offset[r]) - base
            spans.append((a0, a0 + int(self.idx.audio_size[r])))
        track.put(rows[0][1][0], done, (buf, spans))

    def load(self, chunk: Chunk, epoch: int, first_step: int, skip_batches: int, order: int = 0) -> ChunkBatches:
        """`start`, then every batch gathered into one ChunkBatches (read_members; the loader takes batches one
        by one as they are ready)."""
        head = self.start(chunk, epoch, first_step, skip_batches, order)
        parts = [f.result() for f in head.batches]
        timings = dict(head.timings)
        for part in parts:
            for k, v in part.timings.items():
                timings[k] = timings.get(k, 0.0) + v
        return ChunkBatches(epoch=epoch, first_step=first_step, batches=[b for p in parts for b in p.batches],
                            errors=[e for p in parts for e in p.errors], timings=timings)

    def start(self, chunk: Chunk, epoch: int, first_step: int, skip_batches: int, order: int = 0) -> ChunkBatches:
        """Read the rows of `chunk.batches[skip_batches:]` (skipped batches are never decoded) and queue their
        decoding; returns once the reads are done, with one Future per batch (a one-batch ChunkBatches: its
        rows, errors and stage seconds) that resolves when the batch's last row is decoded.

        Each row decodes straight into its slot of a padded batch as soon as the piece holding its bytes has
        arrived (decoding overlaps the rest of the transfer). Rows are decoded batch by batch (the decode pool
        takes the lowest batch number first; the loader gates how far ahead: StreamConfig.decode_ahead), and a batch's memory (recycled: load/buffers.py) is taken when its
        first row is decoded: a chunk holds about two batches being decoded, not all of them, and its first batch
        reaches the trainer after a quarter of the chunk's decode instead of all of it (peak RSS on the 4k
        benchmark corpora -25 MB). The dtype is the trainer's (`pcm_dtype`): the decoder writes float32 as fast
        as int16, and the separate int16 -> float32 pass it replaces cost ~1 ns a sample in the training
        process's thread (~5% of the loader's CPU on 2 cores); same values bit for bit (scale 1/32768).
        """
        idx = self.idx
        wanted = chunk.batches[skip_batches:]
        dtype = np.float32 if self.cfg.pcm_dtype == "float32" else np.int16
        t0 = time.perf_counter()
        padded, slot = [], {}
        for bi, rows_b in enumerate(wanted):
            lengths = idx.num_samples[rows_b].astype(np.int64)
            lazy = _LazyBatch(lengths.tolist(), dtype)
            self.buffers.expect(len(lengths) * int(lengths.max(initial=0)) * np.dtype(dtype).itemsize)
            for i, r in enumerate(rows_b.tolist()):
                slot[r] = (bi, lazy, i)
            padded.append(lazy)
        track = _Tracker(self, wanted, padded, epoch, first_step)
        timings = {"batch": time.perf_counter() - t0}
        rows = np.sort(np.fromiter(slot, np.int64, len(slot)))
        t0 = time.perf_counter()
        strings = self._index_strings(rows) if idx.key is not None and len(rows) else None
        for shard, start, end, run_rows in _runs_with_rows(idx, rows):
            self._read_run(shard, start, end, run_rows, slot, order, track, strings)
        timings["read"] = time.perf_counter() - t0
        return ChunkBatches(epoch=epoch, first_step=first_step, batches=track.futures, errors=[], timings=timings)

    def _read_run(self, shard: int, start: int, end: int, run_rows: np.ndarray, slot: dict, order: int,
                  track: "_Tracker", strings: dict[int, tuple] | None = None) -> None:
        """Stream one byte run and hand each row to the decode pool as soon as its bytes have all arrived.

        A row whose bytes never arrive because the shard ended early gets its result here: the header check's
        verdict on the partial bytes (truncated). A read that fails (hopeless, or out of retry budget) raises
        StreamError: an outage is not bad data, and skipping its rows would quietly thin the epoch."""
        idx = self.idx
        ends = idx.offset[run_rows] + idx.size[run_rows] - start
        have = nxt = 0
        view, mapped = memoryview(b""), False
        try:
            if shard not in self.seen:
                self._still_same(shard)
            view, filled, mapped = self._open_run(shard, start, end)
            for have in filled:
                ready = []
                while nxt < len(run_rows) and ends[nxt] <= have:  # this row's bytes are all here
                    r = int(run_rows[nxt])
                    ready.append((r, slot[r]))
                    nxt += 1
                if ready:  # the view's length, not the planned one: a mapped run ends where a cut shard does
                    self._submit(view, start, len(view), ready, order, track, strings)
            if mapped and len(view):  # checked: see _open_run
                addr = np.frombuffer(view, np.uint8).ctypes.data
                release_spans([(addr, addr + len(view))])
        except OSError as e:  # transient errors were retried in storage: this one stops the stream
            raise self._read_failed(shard, e) from e
        for r in run_rows[nxt:]:  # the shard ended early: the header check reports them as truncated
            track.put(slot[int(r)][0], [(int(r), self._decode(view, start, have, int(r), np.zeros(0, np.int16)))])

    def _still_same(self, shard: int) -> None:
        """Refuse a dataset re-packed in place during the run (its manifest.json rewritten with other shards) before
        a shard is first read: pins hold a shard to the version first read, but a shard first read after a
        same-layout re-pack would be pinned to the new bytes, against the index and plan of the old (WAV members
        of equal size pass every row check). Cost: one stat or small request per shard, once per run."""
        ds = self.ds.part_of(shard)
        if not ds.still_same():
            raise StreamError(f"{ds.url} was re-packed or removed while this run reads it (its manifest.json is gone "
                              "or lists other shards): its batches would mix two versions; pack into a new "
                              "folder/prefix instead of over a dataset in use, then start a fresh run")
        self.seen.add(shard)

    def _open_run(self, shard: int, start: int, end: int) -> tuple[memoryview, Iterable[int], bool]:
        """A run's bytes, the counts of them present as they arrive, and whether they are mapped: a local shard's
        run is mapped (all present at once; cfg.map_local), else a run buffer is filled by reads (`_fill`).

        A mapped run is given back to the kernel whole once its rows are checked (`_read_run`): the checks touch
        each row's headers and json, and the kernel maps 64 KB around every touch, so most of the run (of both
        chunks in flight) would stay resident until its rows decode; its pages are the file's, so a decoder
        reading them afterwards faults them back in, from the page cache (peak RSS on the 4k speech corpus
        648 -> 636-641 MB, CPU the same within noise: ~3.5k more faults an epoch, 64 KB each)."""
        if self.cfg.map_local and self.cache is None:
            view = storage.map_range(self.ds.shard_url(shard), start, end, self.ds.storage_options, self.pins)
            if view is not None:
                return view, (len(view),), True
        view = memoryview(self.run_buffers.take(1, end - start, np.uint8)[0])
        return view, self._fill(shard, start, view), False

    def _submit(self, view: memoryview, base: int, have: int, ready: list, order: int, track: "_Tracker",
                strings: dict[int, tuple] | None) -> None:
        """Check rows whose bytes have arrived; failures go to `track` at once, the rest to the decode pool in
        tasks of up to ROWS_PER_TASK rows of one batch, at priority `order` (the number of the chunk's first batch
        in the stream) + the batch's place in the chunk: the oldest batch first."""
        t0 = time.perf_counter()
        checks = self._check_rows(view, base, have, [r for r, _ in ready], strings)
        per_row = (time.perf_counter() - t0) / len(ready)
        todo: dict[int, list] = {}
        for (r, at), (key, text, err) in zip(ready, checks):
            if err is None:
                todo.setdefault(at[0], []).append((r, at, (key, text, None, per_row)))
            else:  # a failed check: no decode task
                track.put(at[0], [(r, (key, "", 0, err, per_row, 0.0))])
        for b, rows in sorted(todo.items()):
            for g in range(0, len(rows), ROWS_PER_TASK):
                fut = self.decode_pool.submit(order + b, self._decode_rows, view, base, have,
                                              rows[g:g + ROWS_PER_TASK], track)
                fut.add_done_callback(functools.partial(track.failed, b))

    def _assemble(self, wanted: Sequence[np.ndarray], padded: list[np.ndarray], results: dict,
                  timings: dict) -> tuple[list[tuple], list[dict]]:
        """Decoded rows -> batch tuples (pcm, lengths, keys, texts, durations); failed rows are dropped and listed."""
        idx, out, errors = self.idx, [], []
        for bi, batch_rows in enumerate(wanted):
            keep, lengths, keys, texts, durs = [], [], [], [], []
            for i, r in enumerate(batch_rows):
                key, text, n, err, t_parse, t_decode = results[int(r)]
                timings["parse"] += t_parse
                timings["decode"] += t_decode
                if err is not None:
                    err = err if len(err) <= MAX_REASON_CHARS else err[:MAX_REASON_CHARS - 3] + "..."
                    shard_name = self.ds.shards[int(idx.shard[r])].name
                    if self.cfg.strict:
                        raise StreamError(f"{shard_name} key {key}: {err}")
                    errors.append({"key": key, "shard": shard_name, "reason": err})
                    continue
                keep.append(i)
                lengths.append(n)
                keys.append(key)
                texts.append(text)
                durs.append(float(idx.duration_s[r]))
            pcm = padded[bi]
            if len(keep) < len(batch_rows):  # rare: drop failed rows, trim to the longest survivor
                pcm = np.ascontiguousarray(pcm[keep, : max(lengths, default=0)])
            out.append((torch.from_numpy(pcm), np.array(lengths, dtype=np.int64), keys, texts,
                        np.array(durs, dtype=np.float64), np.asarray(batch_rows, np.int64)[keep]))
        return out, errors



class _Tracker:
    """The batches of one chunk being decoded: a batch's Future resolves (a one-batch ChunkBatches) in the thread
    that puts its last row, so the loader takes it without waiting for the rest of the chunk.

    A decode task that raises (out of memory, a bug) fails its batch's Future with that error; a batch already
    handed over keeps its result. Results and buffers of a handed-over batch are dropped here at once, and the
    pages of its rows' audio bytes given back (`spent`)."""

    def __init__(self, reader: ChunkReader, wanted: Sequence[np.ndarray], padded: list[_LazyBatch], epoch: int,
                 first_step: int):
        self.reader, self.wanted = reader, list(wanted)
        self.padded: list[_LazyBatch | None] = list(padded)
        self.epoch, self.first_step = epoch, first_step
        self.left = [len(b) for b in wanted]
        self.results: list[dict | None] = [{} for _ in wanted]
        self.spent: list[list[tuple[memoryview, list]]] = [[] for _ in wanted]
        """Per batch, (run bytes, [(first, end) address of a decoded row's audio]): released once the batch is
        handed over. Holding the run's view keeps its memory mapped until then: released after an unmap, the
        addresses could belong to a new block by then."""
        self.futures: list[Future] = [Future() for _ in wanted]
        self.lock = threading.Lock()
        for b, n in enumerate(self.left):
            if n == 0:  # a batch empty by plan
                self._resolve(b)

    def put(self, b: int, results: list[tuple[int, tuple]], spent: tuple[memoryview, list] | None = None) -> None:
        """(row, result) of batch `b`; `spent`: the run bytes and audio addresses of the decoded ones."""
        with self.lock:
            got = self.results[b]
            if got is None:  # the batch already failed
                return
            got.update(results)
            if spent is not None:
                self.spent[b].append(spent)
            self.left[b] -= len(results)
            last = self.left[b] == 0
        if last:
            self._resolve(b)

    def failed(self, b: int, task: Future) -> None:
        """Done callback of a decode task of batch `b`: its exception fails the batch."""
        e = None if task.cancelled() else task.exception()
        if e is None:
            return
        with self.lock:
            if self.results[b] is None:
                return
            self.results[b], self.padded[b], self.spent[b] = None, None, []
        if not self.futures[b].done():
            self.futures[b].set_exception(e)

    def _resolve(self, b: int) -> None:
        fut, reader, lazy = self.futures[b], self.reader, self.padded[b]
        try:
            t0 = time.perf_counter()
            timings = {"parse": 0.0, "decode": 0.0}
            out, errors = reader._assemble([self.wanted[b]], [lazy.array(reader.buffers)],  # type: ignore[union-attr]
                                           self.results[b] or {}, timings)
            timings["batch"] = time.perf_counter() - t0
            fut.set_result(ChunkBatches(self.epoch, self.first_step + b, out, errors, timings))
        except BaseException as e:  # noqa: BLE001 - strict mode's StreamError, or a bug: the loader raises it
            fut.set_exception(e)
        if lazy is not None:  # the batch is the trainer's now: a task still holding this lazy must not keep it
            lazy.pcm = None
        self.results[b], self.padded[b] = None, None
        spent, self.spent[b] = self.spent[b], []
        release_spans([span for _, spans in spent for span in spans])


class Member(NamedTuple):
    """One index row read by `read_members`: its audio (float32, mono), or the reason it was skipped."""

    row: int
    key: str
    sample_rate_hz: int
    samples: np.ndarray | None
    """Mono float32 in [-1, 1), a private copy (None when skipped)."""
    error: str | None
    """The loader's skip reason (decode_error, index_mismatch, bad_header, ...), or None."""


def read_members(ds: Dataset, rows: Sequence[int] | np.ndarray, cfg: StreamConfig | None = None,
                 group: int = 16) -> Generator[Member, None, None]:
    """Members of `ds` by index row, in the order given, read and decoded by the loader's own path.

    The one way to read a member outside an epoch (the noise and RIR banks of train/augment.py, the augment demo):
    a ChunkReader over `group` rows at a time, each row its own one-row batch, so the same ranged reads by index
    offsets, the same checks against the index (ustar headers, key, size, json text and num_samples) and the same
    decoder (dr_flac / libsndfile, multi-channel averaged) as a training batch. A bad member is yielded with its
    reason, as the loader would skip it (or StreamError under `cfg.strict`); a storage failure raises StreamError.
    Cost: the index's plan and check columns once (~200 bytes a row), `cfg.decode_threads` threads while iterating,
    one copy of each member's samples (the batch buffers are recycled)."""
    from shardtrain.load.config import StreamConfig

    cfg = replace(cfg or StreamConfig(), pcm_dtype="float32")
    checks = [c for c in CHECK_COLUMNS if cfg.check_transcripts or c != "text"]
    table = ds.read_index(columns=list(PLAN_COLUMNS) + ["sample_rate_hz", *checks])
    rates = np.asarray(numpy_of(table.column("sample_rate_hz")), np.int64)
    rows = np.asarray(rows, np.int64)
    if len(rows) and (rows.min() < 0 or rows.max() >= table.num_rows):
        raise IndexError(f"{ds.url}: rows must be in [0, {table.num_rows}), got {rows.min()}..{rows.max()}")
    if len(np.unique(rows)) < len(rows):
        raise ValueError("read_members: each row at most once (a row is one slot of the read)")
    reader = ChunkReader(ds, PlanIndex.from_table(table), cfg)
    try:
        for g in range(0, len(rows), max(1, group)):
            part = rows[g:g + group]
            got = reader.load(Chunk(rows=np.unique(part), batches=tuple(part[i:i + 1] for i in range(len(part)))),
                              epoch=0, first_step=0, skip_batches=0)
            errors = iter(got.errors)
            for r, (pcm, lengths, keys, _texts, _durs, _kept) in zip(part.tolist(), got.batches):
                if len(keys):
                    yield Member(r, keys[0], int(rates[r]), pcm.numpy()[0, :int(lengths[0])].copy(), None)
                else:
                    e = next(errors)
                    yield Member(r, e["key"], int(rates[r]), None, e["reason"])
    finally:
        reader.io_pool.shutdown(wait=False, cancel_futures=True)
        reader.decode_pool.shutdown()
