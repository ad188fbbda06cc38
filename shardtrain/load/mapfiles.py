"""The files of a memory-mapped index copy (load/mapped.py): written with ordinary writes, checked when opened.

    write:  ColumnFiles -> <column>.npy (header + rows, preallocated), <string>.offsets.npy, <string>.bytes
            -> digests(folder) recorded in meta.json {file: [bytes, sha256, full?]}
    open:   verify(folder, meta) -> None, or why the copy cannot be used (then mapped.py rebuilds it)

Why ordinary writes: a page dirtied through a memory map on a full disk (tmpfs, a sparse file, a quota) is a
SIGBUS that kills the process and leaves the temp folder behind; write() returns ENOSPC instead, which the build
turns into one line naming the folder and the space it needs. Each file is preallocated first (posix_fallocate),
so a full disk is found before any row is written; the files are mapped read-only only once complete.

What a check costs at open (measured, benchmarks/load/bench_mapped_check.py): every file's size and .npy header, a
full sha256 of the budget-critical columns (BUDGET_COLUMNS, 26 B a row, ~1 GB/s) and a sampled sha256 of the
others (SAMPLES pages of 4 KiB plus both ends), plus the durations' order and range. A copy that changed after it
was built (a torn write, a flipped page, a file replaced) fails the check and is rebuilt rather than used.
"""
from __future__ import annotations

import errno
import hashlib
import mmap
import os
from pathlib import Path

import numpy as np

BUDGET_COLUMNS = ("duration_s", "num_samples", "channels", "size")
"""Columns a batch budget or a memory bound is computed from: checked in full at every open."""
SAMPLES = 32
"""4 KiB pages checked in the other files, evenly spread (besides the first and last 64 KiB)."""
PAGE = 4096
SPACE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _preallocate(f, nbytes: int) -> None:
    """Reserve `nbytes` for `f` (ENOSPC now, not at a later write); a filesystem without fallocate is skipped."""
    try:
        os.posix_fallocate(f.fileno(), 0, nbytes)
    except OSError as e:
        if e.errno in SPACE_ERRORS:
            raise
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


class ColumnFiles:
    """Column files filled one row group at a time with plain writes: each numeric column is an .npy file (header,
    then rows appended), a string column is its byte offsets (n + 1 int64, .npy) plus its raw UTF-8 bytes."""

    def __init__(self, folder: Path, rows: int, dtypes: dict[str, np.dtype], strings: tuple[str, ...]):
        self.at = 0
        self.files = {c: self._npy(folder / f"{c}.npy", dt, rows) for c, dt in dtypes.items()}
        self.offsets = {c: self._npy(folder / f"{c}.offsets.npy", np.dtype(np.int64), rows + 1) for c in strings}
        for f in self.offsets.values():
            f.write(np.zeros(1, np.int64).tobytes())
        self.raw = {c: open(folder / f"{c}.bytes", "wb") for c in strings}
        self.nbytes = dict.fromkeys(strings, 0)

    @staticmethod
    def _npy(path: Path, dtype: np.dtype, n: int):
        f = open(path, "wb")
        np.lib.format.write_array_header_1_0(
            f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n,)})
        f.flush()
        _preallocate(f, f.tell() + n * dtype.itemsize)
        return f

    def add(self, table) -> None:
        n = table.num_rows
        for c, f in self.files.items():
            f.write(np.ascontiguousarray(table.column(c).to_numpy(zero_copy_only=False)).tobytes())
        for c, raw in self.raw.items():
            arr = table.column(c).combine_chunks().cast("large_string")
            offs = np.frombuffer(arr.buffers()[1], np.int64, n + 1, arr.offset * 8)
            raw.write(memoryview(arr.buffers()[2])[offs[0]:offs[-1]])
            self.offsets[c].write((self.nbytes[c] + offs[1:] - offs[0]).astype(np.int64).tobytes())
            self.nbytes[c] += int(offs[-1] - offs[0])
        self.at += n

    def abort(self) -> None:
        """Close every file without flushing what a full disk refused (the folder is deleted next)."""
        for f in (*self.files.values(), *self.offsets.values(), *self.raw.values()):
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        """Flush and close every file (ENOSPC surfaces here at the latest)."""
        errors = []
        for f in (*self.files.values(), *self.offsets.values(), *self.raw.values()):
            try:
                f.close()
            except OSError as e:
                errors.append(e)
        if errors:
            raise errors[0]


def file_digest(path: Path, full: bool) -> str:
    """sha256 of the whole file, or (`full` False) of its size, first and last 64 KiB and SAMPLES spread pages."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        if full or size <= (SAMPLES + 32) * PAGE:
            if size:  # hashed straight from a read-only map: no copy through read()
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    h.update(mm)
            return h.hexdigest()
        spots = [0, size - (16 * PAGE), *np.linspace(16 * PAGE, size - 17 * PAGE, SAMPLES).astype(np.int64)]
        for at in spots:
            f.seek(int(at))
            h.update(f.read(16 * PAGE if at in spots[:2] else PAGE))
    return h.hexdigest()


def _full(name: str) -> bool:
    return name.endswith(".npy") and name[:-4] in BUDGET_COLUMNS


def digests(folder: Path) -> dict[str, list]:
    """{file name: [bytes, sha256, full]} for every data file of a copy (recorded in its meta.json)."""
    return {p.name: [p.stat().st_size, file_digest(p, _full(p.name)), _full(p.name)]
            for p in sorted(folder.iterdir()) if p.suffix in (".npy", ".bytes")}


def verify(folder: Path, meta: dict, arrays: dict[str, np.ndarray]) -> str | None:
    """None when the copy is as it was built, else why not: a file missing, resized or changed (digests), a
    column of the wrong shape, durations out of order or not finite, a negative sample count."""
    files = meta.get("files")
    if not isinstance(files, dict):
        return "no file digests (an older layout)"
    for name, (nbytes, digest, full) in files.items():
        p = folder / name
        try:
            st = os.lstat(p)
        except OSError:
            return f"{name} is missing"
        if st.st_size != nbytes:
            return f"{name} has {st.st_size} bytes, {nbytes} when built"
        if file_digest(p, bool(full)) != digest:
            return f"{name} changed since it was built"
    rows = meta["rows"]
    for c, a in arrays.items():
        if a.shape != (rows,):
            return f"{c} holds {a.shape} values, {rows} rows expected"
    d = np.asarray(arrays["duration_s"])
    if len(d) and not (np.isfinite(d).all() and d[0] >= 0 and (d[1:] >= d[:-1]).all()):
        return "duration_s is not finite, non-negative and ascending"
    if len(d) and int(np.asarray(arrays["num_samples"]).min()) < 0:
        return "num_samples is negative"
    return None


def check_blocks(b, duration_s: np.ndarray, size: np.ndarray, cost_fn, budget: float,
                 window: int = 1 << 22) -> str | None:
    """None when the block table tiles the rows in order and each block's cost, longest cost, bytes and too-long
    flag (every row over `budget`) equal what the (verified) columns give; else why not. Streams the columns
    `window` rows at a time (memory O(blocks)); ~the cost of making the table, without its sort of cuts."""
    n = len(duration_s)
    start, rows = np.asarray(b.start, np.int64), np.asarray(b.rows, np.int64)
    if len(start) == 0:
        return None if n == 0 else "no blocks"
    if start[0] != 0 or (rows <= 0).any() or (start[1:] != start[:-1] + rows[:-1]).any() or start[-1] + rows[-1] != n:
        return "blocks do not tile the rows"
    ends, i = start + rows, 0
    while i < len(start):
        j = max(i + 1, int(np.searchsorted(ends, start[i] + window, side="right")))
        lo, hi = int(start[i]), int(ends[j - 1])
        c, rel = cost_fn(np.asarray(duration_s[lo:hi], np.float64)), start[i:j] - lo
        if not (np.allclose(np.add.reduceat(c, rel), b.cost[i:j], rtol=1e-9, atol=1e-6)
                and np.allclose(np.maximum.reduceat(c, rel), b.max_cost[i:j], rtol=1e-6, atol=1e-4)
                and np.array_equal(np.add.reduceat(np.asarray(size[lo:hi], np.int64), rel), b.nbytes[i:j])
                and np.array_equal(np.minimum.reduceat(c, rel) > budget, np.asarray(b.too_long[i:j], bool))):
            return f"blocks {i}..{j - 1} disagree with the index's durations or sizes"
        i = j
    return None
