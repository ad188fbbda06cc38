"""index.parquet is untrusted input too: its footer is checked before a row is read, and its strings before they
are materialised.

    ParquetFile footer -> check_footer: rows == the manifest's, column types, row groups, and every column chunk's
                          uncompressed size within rows x the column's per-row bound       (no data read yet)
    column chunks      -> read_bounded: string columns read dictionary-encoded (as stored: a repeated 1 MB string
                          costs 1 MB, not rows x 1 MB), their lengths checked (per value, format/limits.py)
                          on the dictionary, then decoded to plain strings              -> pyarrow.Table

Why both: a crafted 9 KB index can hold one long string in a dictionary page and point every row at it, so a
plain read expands it to gigabytes before any check could run; and its footer can claim any row count. The
footer bounds what the pages may hold; the dictionary check bounds what decoding them would produce. The checks
of values and of fields against each other (`validate.check_index`) then run on the bounded table.

Cost (benchmarks/format/bench_index_guard.py, 200k rows, loaded 2-core box): the footer check 0.4 ms; reading key +
text dictionary-encoded, checking and decoding them ~2.6x a plain read (a hash per plain-encoded string: ~2.5 us
a row, once per open), against ~34 ms to decode one 8-12 s FLAC row. Numeric columns cost nothing extra.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardtrain.format.arrownp import filled, numpy_of
from shardtrain.format.limits import MAX_STRING_BYTES, string_bound
from shardtrain.format.validate import DatasetError

STRING_COLUMNS = tuple(MAX_STRING_BYTES)
NUMBER_BYTES = 16
"""Uncompressed bytes per row a numeric column chunk may hold (8-byte value + levels + page overhead)."""
CHUNK_SLACK_BYTES = 1 << 20
"""Headers, statistics and dictionary pages of one column chunk, on top of its per-row bound."""
MAX_ROW_GROUPS = 1 << 20


def _is_string(t: pa.DataType) -> bool:
    """A string column, or one a writer stored with an Arrow dictionary type over strings."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def check_footer(pf, rows: int, columns: Sequence[str], where: str) -> None:
    """Refuse an index whose footer disagrees with the manifest (`rows`) or whose column chunks (of `columns`)
    claim more uncompressed bytes than their rows may hold. Reads nothing but the footer already parsed."""
    md = pf.metadata
    if md.num_rows > rows:  # fewer is no memory hazard: check_index names the shard that lacks rows
        raise DatasetError(f"{where}: {md.num_rows} rows, the manifest's shards hold {rows}")
    if md.num_row_groups > MAX_ROW_GROUPS:
        raise DatasetError(f"{where}: {md.num_row_groups} row groups, more than {MAX_ROW_GROUPS}")
    schema = pf.schema_arrow
    want = set(columns)
    for name in want:
        if name not in schema.names:
            continue
        t = schema.field(name).type
        if not (_is_string(t) or pa.types.is_integer(t) or pa.types.is_floating(t)):
            raise DatasetError(f"{where}: column {name} has type {t}, not a string or number")
    leaf = {md.schema.column(i).path: i for i in range(md.num_columns)}
    total = 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        total += rg.num_rows
        for name in want:
            i = leaf.get(name)
            if i is None:
                continue
            t = schema.field(name).type
            per_row = string_bound(name) + 4 if _is_string(t) else NUMBER_BYTES
            size = rg.column(i).total_uncompressed_size
            if size > rg.num_rows * per_row + CHUNK_SLACK_BYTES:
                raise DatasetError(f"{where}: row group {g} column {name} claims {size} uncompressed bytes for "
                                   f"{rg.num_rows} rows (at most {per_row} a row)")
    if total != md.num_rows:
        raise DatasetError(f"{where}: row groups hold {total} rows, the footer says {md.num_rows}")


def _bounded_strings(col: pa.ChunkedArray, name: str, where: str) -> pa.ChunkedArray:
    """A dictionary-encoded string column -> plain strings, after checking the length of every value in use
    against format/limits.MAX_STRING_BYTES (computed on the dictionary: no expansion), the bound pack enforces per
    item. A column then expands to at most rows x its bound, what the footer check allows its stored chunks."""
    dictionary = pa.types.is_dictionary(col.type)
    if not _is_string(col.type):
        return col
    limit = string_bound(name)
    for chunk in col.chunks:
        if len(chunk) == 0:
            continue
        if dictionary:
            if len(chunk.dictionary) == 0:
                continue
            lengths = numpy_of(pc.binary_length(chunk.dictionary)).astype(np.int64)
            used = lengths[numpy_of(filled(chunk.indices, 0))]
        else:  # already plain (read without read_dictionary): its bytes are in memory, still bound what follows
            used = numpy_of(filled(pc.binary_length(chunk), 0))
        if used.max(initial=0) > limit:
            row = int(np.argmax(used > limit))
            raise DatasetError(f"{where}: column {name} holds a {int(used[row])}-byte value (row {row} of a "
                               f"chunk), more than the {limit} it may have")
    if not dictionary:
        return col
    return pa.chunked_array([c.dictionary_decode() for c in col.chunks], type=col.type.value_type)


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The string columns to read dictionary-encoded (ParquetFile(read_dictionary=...))."""
    return [f.name for f in schema if _is_string(f.type)]


def read_bounded(pf, columns: Sequence[str] | None, where: str, row_group: int | None = None) -> pa.Table:
    """Read `columns` (all when None) of a ParquetFile opened with read_dictionary=dictionary_columns(...), or
    one row group of it; every string value is length-checked before the strings are decoded.

    One thread (use_threads=False): what Arrow's pool threads allocate for a threaded read stayed resident after
    it (peak RSS of the loader on the 4k benchmark corpora ~-2 to -3 MB); the index is read once, at start
    (4k rows: ~1 ms slower single-threaded)."""
    cols = list(columns) if columns is not None else None
    table = (pf.read(columns=cols, use_threads=False) if row_group is None
             else pf.read_row_group(row_group, columns=cols, use_threads=False))
    out = [_bounded_strings(table.column(i), name, where) for i, name in enumerate(table.column_names)]
    return pa.table(out, names=table.column_names)
