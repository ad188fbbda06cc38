"""Recycled memory for decoded batches: a batch's buffer goes back to the pool when the trainer drops the batch.

Why: a fresh 20 MB float32 batch is fresh pages, and the kernel faults and zeroes every 4 KB of it on the first
write, inside the decoder (perf on the 4k benchmark corpus: page clearing and faults ~3% of the loader's CPU, and
libsndfile decoding into prefaulted memory ~10% faster than into fresh). A recycled buffer was written before:
no faults, and only each row's padding is zeroed (the decoder writes the rest).

How a buffer comes back: `take` returns an array made with `np.frombuffer` over a fresh memoryview of a pooled
block. Every view numpy derives from it (reshape, row slices, `torch.from_numpy`, `.numpy()` of a tensor view)
keeps that memoryview alive, so its finalizer runs only when nothing refers to the batch any more; then the
block is free again (tests/load/test_buffers.py).
A trainer that keeps batches simply makes the pool allocate new blocks; at most `keep` free blocks are held.
Cost: the free blocks' memory (at most `keep` x the largest batch), one weakref finalizer a batch.

Blocks are private anonymous mmaps, not malloc'd: a block let go is unmapped at once, while malloc'd blocks of
a few MB (below glibc's raised mmap threshold) came from the decode threads' arenas and stayed resident as
fragments (peak RSS on the 4k benchmark corpus 716 -> 701 MB).
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import threading
import weakref
from typing import Any
from collections import deque

import numpy as np

ROUND_BYTES = 1 << 20
"""Blocks are whole MiB, so batches of slightly different shapes share them."""
HEADROOM = 4
"""A fresh block is 1/HEADROOM larger than the largest batch expected so far: the chunks planned later in an
epoch hold somewhat larger batches (up to 21 MB where the first chunks' largest was 18 MB on the tone benchmark
corpus: 6 fresh blocks an epoch, 3 with the headroom). Pages never written cost no memory, only address space."""


class BatchBuffers:
    """Pool of byte blocks for padded batches [rows, cols], shared by the threads of one reader."""

    def __init__(self, keep: int):
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._returned: deque[np.ndarray] = deque()
        """Blocks given back by finalizers, which may run in any thread at any moment (a garbage collection
        inside `take`, say): a deque append needs no lock, so a finalizer can never wait on one."""
        self._lock = threading.Lock()
        self._expect = 0
        self._written: dict[int, int] = {}
        """Block address -> bytes its last batch wrote (the rest of the block is not resident)."""
        self.fresh = 0
        """Blocks allocated (not recycled) so far: a trainer that holds batches shows here."""

    def expect(self, nbytes: int) -> None:
        """A batch of `nbytes` is coming: blocks made from now on are at least this large (the reader says so for
        each batch it plans). Why: blocks sized to the batch that first needed them fit no larger batch later, and
        each misfit cost an unmap and a fresh block (10 fresh blocks an epoch of the 4k speech corpus, ~43k page
        faults; sized to the largest batch planned, 3, the most ever in flight). Pages past a batch's end are
        never touched, so a large block costs no memory until a large batch writes it."""
        self._expect = max(self._expect, nbytes)

    def take(self, rows: int, cols: int, dtype: np.dtype | type) -> np.ndarray:
        """An uninitialised [rows, cols] array of `dtype`: the caller writes or zeroes every element."""
        dt = np.dtype(dtype)
        count = rows * cols
        need = max(1, count * dt.itemsize)
        block = None
        with self._lock:
            self._collect()
            # the smallest block that holds it; what a larger batch wrote past this one's end is released below
            fits = [i for i, b in enumerate(self._free) if need <= len(b)]
            if fits:
                block = self._free.pop(min(fits, key=lambda i: len(self._free[i])))
            elif self._free:  # none holds it: give one back to the system, so blocks never outnumber batches
                self._forget(self._free.pop(max(range(len(self._free)), key=lambda i: len(self._free[i]))))
        if block is None:
            size = max(need, self._expect + self._expect // HEADROOM)
            block = _new_block(-(-size // ROUND_BYTES) * ROUND_BYTES, rows, cols, dt)
            self.fresh += 1
            written = 0
        else:
            written = self._written.get(block.ctypes.data, len(block))
        if written - need >= PAGE:  # a larger batch wrote past this one's end: no need to keep that resident
            release_pages(block, need, written)
        self._written[block.ctypes.data] = need
        # Through a fresh memoryview: numpy makes it the base every view of `flat` keeps alive (over the block
        # itself, every view would keep the pooled block alive, which tells nothing)
        flat = np.frombuffer(block.data, dt, count)  # .data: a fresh memoryview of the block
        weakref.finalize(flat.base, self._returned.append, block)
        return flat.reshape(rows, cols)

    def free_blocks(self) -> int:
        """Blocks ready for reuse now."""
        with self._lock:
            self._collect()
            return len(self._free)

    def _collect(self) -> None:
        """Move returned blocks to the free list, keeping at most `keep` (the smallest go: large ones fit all)."""
        while self._returned:
            self._free.append(self._returned.popleft())
        while len(self._free) > self.keep:
            self._forget(self._free.pop(min(range(len(self._free)), key=lambda i: len(self._free[i]))))

    def _forget(self, block: np.ndarray) -> None:
        """Let a block go (unmapped once nothing refers to it); its address may belong to a new block later."""
        self._written.pop(block.ctypes.data, None)


def _madvise():
    """libc's madvise (ctypes releases the GIL around it), or None off Linux."""
    if not hasattr(mmap, "MADV_DONTNEED") or not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


_MADVISE = _madvise()
PAGE = mmap.PAGESIZE


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _ProcessMadvise:
    """process_madvise(2) on this process: many ranges, one system call, and since Linux 6.16 one TLB flush for
    all of them (madvise flushes once per call, and each flush interrupts every other core running this process:
    with two decode threads on two cores, ~4,000 interrupts an epoch of the 4k benchmark corpus, one per row).
    MADV_DONTNEED through it needs Linux >= 6.13; on anything older (EINVAL), under a seccomp filter (ENOSYS,
    EPERM) or off Linux it turns itself off at the first refusal and the ranges go through madvise one by one."""

    SYSCALL = 440
    """process_madvise: the same number on every architecture (added with the unified syscall table)."""
    PIDFD_SELF = -10000
    """The calling process, without a pidfd (Linux >= 6.14); before that, a pidfd of our own pid."""

    def __init__(self) -> None:
        self.on = _MADVISE is not None
        self._self_ok = True  # PIDFD_SELF understood (else a pidfd of our own)
        self._syscall: Any = None  # libc's syscall(), loaded on first use
        self._pidfd: tuple[int, int] | None = None  # (pid, fd): a fork's child must never advise its parent

    def __call__(self, pages: list[tuple[int, int]]) -> bool:
        """Release (address, length) pages in one call; False when the caller must madvise them itself."""
        if not self.on:
            return False
        if self._syscall is None:
            self._syscall = ctypes.CDLL(None, use_errno=True).syscall
            self._syscall.restype = ctypes.c_long
        iov = (_IoVec * len(pages))(*(_IoVec(a, n) for a, n in pages))
        want = sum(n for _, n in pages)
        while True:
            pidfd = self.PIDFD_SELF if self._self_ok else self._own_pidfd()
            if pidfd is None:
                return False
            got = self._syscall(ctypes.c_long(self.SYSCALL), ctypes.c_long(pidfd), iov, ctypes.c_size_t(len(pages)),
                                ctypes.c_int(mmap.MADV_DONTNEED), ctypes.c_uint(0))
            if got == want:
                return True
            if got < 0 and ctypes.get_errno() == errno.EBADF and self._self_ok:  # a kernel before PIDFD_SELF
                self._self_ok = False
                continue
            if got < 0:  # refused (EINVAL before 6.13, ENOSYS/EPERM under seccomp): madvise from now on
                self.on = False
            return False  # partly done: the caller madvises every range again (harmless)

    def _own_pidfd(self) -> int | None:
        pid = os.getpid()
        if self._pidfd is None or self._pidfd[0] != pid:
            try:
                self._pidfd = (pid, os.pidfd_open(pid))
            except (AttributeError, OSError):
                self.on = False
                return None
        return self._pidfd[1]


_PROCESS_MADVISE = _ProcessMadvise()


def release_pages(block: np.ndarray, start: int, end: int) -> None:
    """Give the kernel back the whole pages inside bytes [start, end) of `block` (a uint8 array from `take`,
    whose memory is a private anonymous map): they leave RSS now and read as zeros after. What for: a run of
    shard bytes (reader.py) lives until its last row is decoded, and rows are decoded batch by batch, not in
    file order, so a run would stay whole until the end of its chunk: releasing each row's audio once decoded
    keeps two chunks' runs from adding up (peak RSS on the 4k benchmark corpora ~-5 to -10 MB). A no-op off
    Linux."""
    addr = block.ctypes.data
    release_spans([(addr + start, addr + end)])


def release_spans(spans: list[tuple[int, int]]) -> None:
    """`release_pages` of several [first, end) address ranges (each inside one private map: a block from `take`,
    or a file mapped by storage.map_range, whose pages then read from the file again) in one system call
    (`_ProcessMadvise`). The caller keeps each map alive until this returns: an address of a map already gone
    may belong to another by then. Cost: the zap and, for a block, the page frees (moved from unmap to here),
    and a TLB flush of the other cores running this process per call. A no-op off Linux."""
    if _MADVISE is None:
        return
    pages = []
    for start, end in spans:
        lo, hi = -(-start // PAGE) * PAGE, end // PAGE * PAGE
        if hi > lo:
            pages.append((lo, hi - lo))
    if len(pages) > 1 and _PROCESS_MADVISE(pages):
        return
    for lo, n in pages:
        _MADVISE(lo, n, mmap.MADV_DONTNEED)


def _new_block(nbytes: int, rows: int, cols: int, dt: np.dtype) -> np.ndarray:
    """`nbytes` of fresh private memory (zero pages until written), returned to the system when the last array
    over it dies. Out of memory (a `ulimit -v` or a container limit) is one line naming the allocation and the
    knobs that shrink it (`_no_memory`), still an OSError(ENOMEM).

    4 KB pages, not transparent huge ones (MADV_HUGEPAGE was measured): one fault per 2 MiB instead of 512 cut
    the loader's page faults ~110k -> ~72k an epoch of the 4k speech corpus, but the padding zeroed at `take`
    touches every 2 MiB of a fresh batch block at once, so the block is resident before its rows are decoded
    (peak RSS +1.6-2.2 MB, past the 650 MB goal); and a run's huge page released a row at a time is freed only
    once all of it is, though RSS stops counting it."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    try:
        if not flags:  # Windows: no flags; malloc it
            return np.empty(nbytes, np.uint8)
        return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), np.uint8)
    except (MemoryError, OSError) as e:
        if isinstance(e, OSError) and e.errno != errno.ENOMEM:
            raise
        raise OSError(errno.ENOMEM, _no_memory(nbytes, rows, cols, dt)) from e


def _no_memory(nbytes: int, rows: int, cols: int, dt: np.dtype) -> str:
    if rows == 1 and dt == np.uint8:  # reader: one byte run of a shard (the rows of a chunk that sit together)
        what = (f"a run of {cols / 1e6:.1f} MB of shard bytes (the rows read together; a long utterance makes "
                f"it large): lower stream.bucket.chunk_mb")
    else:
        what = (f"a padded audio batch of {rows} utterances x {cols:,} samples {dt} (~{cols / 16000:.0f} s at "
                f"16 kHz: the longest utterance sets the width): lower stream.bucket.max_batch_seconds, or drop "
                f"very long utterances when packing (--max-duration-s)")
    return (f"cannot allocate {nbytes / 1e6:.0f} MB for {what}; or raise the memory limit (ulimit -v, the "
            f"container's or the job's memory)")
