"""Arrow columns as numpy arrays without pyarrow's lazy pandas import.

Why: the first `Array.to_numpy()` of a process makes pyarrow import pandas (0.3-1.7 s measured here, more than
everything else the loader does before its first batch). Index columns are numeric without nulls, so their
values are one plain buffer per chunk, read here with numpy directly. What cannot be read that way (nulls,
strings, other types) falls back to `to_numpy`. Cost: one copy of the column (its width a row).

pyarrow.compute is imported here, at import time, not on first use: its ~70 ms import would otherwise land on
the loader's first batch (the index checks use it).
"""
from __future__ import annotations

import logging
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

log = logging.getLogger(__name__)

_DTYPES = {"int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64, "uint8": np.uint8,
           "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64, "float": np.float32,
           "double": np.float64}


def numpy_of(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A numeric or boolean Arrow column without nulls as a writable numpy array (other columns: to_numpy)."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    name = str(col.type)
    if any(c.null_count for c in chunks) or (name != "bool" and name not in _DTYPES):
        return np.asarray(col.to_numpy(zero_copy_only=False))
    parts = []
    for c in chunks:
        if len(c) == 0:
            continue
        buf = c.buffers()[1]
        if name == "bool":  # bit-packed, least significant bit first
            bits = np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little")
            parts.append(bits[c.offset:c.offset + len(c)].astype(bool))
        else:
            dtype = np.dtype(_DTYPES[name])
            parts.append(np.frombuffer(buf, dtype, count=len(c), offset=c.offset * dtype.itemsize))
    if not parts:
        return np.zeros(0, bool if name == "bool" else _DTYPES[name])
    return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()


def filled(arr, value):
    """`arr` with nulls replaced by `value`; without nulls `arr` itself (pyarrow.compute.fill_null builds a
    scalar, which imports pandas on first use)."""
    if arr.null_count == 0:
        return arr
    return pc.fill_null(arr, value)


def arrow_of(values: np.ndarray) -> pa.Array:
    """An int64 numpy array as an Arrow array over the same bytes (pa.array(numpy) imports pandas on first use)."""
    v = np.ascontiguousarray(values, np.int64)
    return pa.Array.from_buffers(pa.int64(), len(v), [None, pa.py_buffer(v)])


def bool_arrow(values: np.ndarray) -> pa.Array:
    """A boolean numpy array as an Arrow array (bit-packed; pa.array imports pandas on first use)."""
    v = np.asarray(values, bool)
    return pa.Array.from_buffers(pa.bool_(), len(v), [None, pa.py_buffer(np.packbits(v, bitorder="little"))])


def string_arrow(values: list[str | None]) -> pa.Array:
    """An Arrow string array built from its buffers: the same array as `pa.array(values, pa.string())`, without
    pyarrow's pandas import on the first pa.array (~0.3 s wall, ~0.5-1 s of CPU on a loaded machine, in every
    fresh process: the pack driver and each scanning pool worker would pay it, for nothing). None is null."""
    raw = [b"" if v is None else v.encode("utf-8") for v in values]
    ends = np.cumsum([len(b) for b in raw], dtype=np.int64)
    if len(ends) and ends[-1] > np.iinfo(np.int32).max:  # string offsets are int32: never let them wrap
        raise OverflowError(f"{ends[-1]} bytes of strings do not fit one Arrow string array (2 GiB)")
    offsets = np.zeros(len(raw) + 1, np.int32)
    offsets[1:] = ends
    nulls = [i for i, v in enumerate(values) if v is None]
    return pa.StringArray.from_buffers(len(raw), pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(raw)),
                                       _validity(len(raw), nulls), len(nulls))


def column_arrow(values: list, type_: pa.DataType) -> pa.Array:
    """A column of Python values (None for null) as an Arrow array of `type_` (string, integer or floating point),
    without pyarrow's pandas import (see string_arrow). Ints that do not fit `type_` raise, as pa.array would."""
    if pa.types.is_string(type_):
        return string_arrow(values)
    nulls = [i for i, v in enumerate(values) if v is None]
    dt = np.dtype(type_.to_pandas_dtype())
    raw = np.array([0 if v is None else v for v in values])
    if dt.kind in "iu" and len(raw) and raw.dtype.kind not in "iub":  # numpy would truncate 3.7 to 3 where pa.array refuses
        raise TypeError(f"values of type {raw.dtype} in a {type_} column")
    data = raw.astype(dt)
    if dt.kind in "iu" and not np.array_equal(data, raw):  # astype wraps around where pa.array refuses
        raise OverflowError(f"a value does not fit {type_}")
    return pa.Array.from_buffers(type_, len(data), [_validity(len(data), nulls), pa.py_buffer(data)], len(nulls))


def _validity(n: int, nulls: list[int]) -> pa.Buffer | None:
    if not nulls:
        return None
    valid = np.ones(n, bool)
    valid[nulls] = False
    return pa.py_buffer(np.packbits(valid, bitorder="little"))


def lean_memory_pool() -> str:
    """Make glibc's allocator pyarrow's default pool when pyarrow chose mimalloc itself; returns the pool's name.

    Why: mimalloc reserves and touches ~17-20 MB per process on the first Arrow allocation, for an index of a few
    hundred KB (measured on the 4k benchmark corpus: the loader's peak RSS 701 -> 679 MB; jemalloc 682). The
    loader's Arrow use is the index and small per-chunk `take`s, where the allocator's speed does not show.
    An explicit choice wins: with ARROW_DEFAULT_MEMORY_POOL set (pyarrow's own variable) nothing changes.
    Process-wide, like pyarrow's own setting; buffers allocated before keep their pool. This moves pyarrow's own
    default only: Arrow's C++ default (the Parquet reader's buffers) is chosen when pyarrow is imported, which is
    why `import shardtrain` sets ARROW_DEFAULT_MEMORY_POOL first (shardtrain/__init__.py).
    """
    pool = pa.default_memory_pool()
    if pool.backend_name != "mimalloc" or os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return pool.backend_name
    pa.set_memory_pool(pa.system_memory_pool())
    log.debug("pyarrow default memory pool: mimalloc -> system (less memory for the loader's small Arrow use)")
    return "system"
