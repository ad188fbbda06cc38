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
import sys
import threading
import weakref
from collections import deque

import numpy as np

ROUND_BYTES = 1 << 20
"""Blocks are whole MiB, so batches of slightly different shapes share them."""


class BatchBuffers:
    """Pool of byte blocks for padded batches [rows, cols], shared by the threads of one reader."""

    def __init__(self, keep: int):
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._returned: deque[np.ndarray] = deque()
        """Blocks given back by finalizers, which may run in any thread at any moment (a garbage collection
        inside `take`, say): a deque append needs no lock, so a finalizer can never wait on one."""
        self._lock = threading.Lock()
        self.fresh = 0
        """Blocks allocated (not recycled) so far: a trainer that holds batches shows here."""

    def take(self, rows: int, cols: int, dtype: np.dtype | type) -> np.ndarray:
        """An uninitialised [rows, cols] array of `dtype`: the caller writes or zeroes every element."""
        dt = np.dtype(dtype)
        count = rows * cols
        need = max(1, count * dt.itemsize)
        block = None
        with self._lock:
            self._collect()
            # the smallest block that holds it, if not much larger: a small batch in a large block written full
            # before would keep all of it resident (~20 MB a block of the 4k benchmark corpus's peak RSS)
            fits = [i for i, b in enumerate(self._free) if need <= len(b) <= need + need // 4 + ROUND_BYTES]
            if fits:
                block = self._free.pop(min(fits, key=lambda i: len(self._free[i])))
            elif self._free:  # none holds it: give one back to the system, so blocks never outnumber batches
                self._free.pop(max(range(len(self._free)), key=lambda i: len(self._free[i])))
        if block is None:
            block = _new_block(-(-need // ROUND_BYTES) * ROUND_BYTES, rows, cols, dt)
            self.fresh += 1
        elif len(block) - need >= PAGE:  # a larger batch wrote the tail: no need to keep it resident (~-5 MB)
            release_pages(block, need, len(block))
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
            del self._free[min(range(len(self._free)), key=lambda i: len(self._free[i]))]


def _madvise():
    """libc's madvise (ctypes releases the GIL around it), or None off Linux."""
    if not hasattr(mmap, "MADV_DONTNEED") or not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


_MADVISE = _madvise()
PAGE = mmap.PAGESIZE


def release_pages(block: np.ndarray, start: int, end: int) -> None:
    """Give the kernel back the whole pages inside bytes [start, end) of `block` (a uint8 array from `take`,
    whose memory is a private anonymous map): they leave RSS now and read as zeros after. What for: a run of
    shard bytes (reader.py) lives until its last row is decoded, and rows are decoded batch by batch, not in
    file order, so a run would stay whole until the end of its chunk: releasing each row's audio once decoded
    keeps two chunks' runs from adding up (peak RSS on the 4k benchmark corpora ~-10 MB). Cost: one madvise
    a row (a few us, no GIL), and pages that are freed now instead of at unmap. A no-op off Linux."""
    if _MADVISE is None:
        return
    addr = block.ctypes.data
    lo, hi = -(-(addr + start) // PAGE) * PAGE, (addr + end) // PAGE * PAGE
    if hi > lo:
        _MADVISE(lo, hi - lo, mmap.MADV_DONTNEED)


def _new_block(nbytes: int, rows: int, cols: int, dt: np.dtype) -> np.ndarray:
    """`nbytes` of fresh private memory (zero pages until written), returned to the system when the last array
    over it dies. Out of memory (a `ulimit -v` or a container limit) is one line naming the allocation and the
    knobs that shrink it (`_no_memory`), still an OSError(ENOMEM)."""
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
