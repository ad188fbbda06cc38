"""Dataset metadata: `index.parquet` (one row per sample) and `manifest.json` (the commit point).

    dataset URL -> manifest.json -> Dataset(url, manifest, shards=[ShardInfo], storage_options)
                -> Dataset.read_index(columns) -> pyarrow.Table (column projection: planning reads only
                   key/shard/duration_s, a few bytes per sample, never audio)

A dataset without manifest.json is incomplete (the packer writes it last) and `open_dataset` refuses it.
Summaries and integrity checks over a Dataset live in `shardtrain.inspect`.
"""
from __future__ import annotations

import hashlib

import io
import json
from dataclasses import asdict, dataclass, field
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from shardtrain import storage
from shardtrain.format.arrownp import column_arrow
from shardtrain.format.indexread import check_footer, dictionary_columns, read_bounded
from shardtrain.format.validate import (RELATED_COLUMNS, DatasetError, check_index, check_manifest, parse_manifest,
                                        show)

FORMAT = "shardtrain"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.parquet"

INDEX_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("shard", pa.int32()),
        ("offset", pa.int64()),
        ("size", pa.int64()),
        ("audio_offset", pa.int64()),
        ("audio_size", pa.int64()),
        ("json_offset", pa.int64()),
        ("json_size", pa.int64()),
        ("codec", pa.string()),
        ("duration_s", pa.float64()),
        ("num_samples", pa.int64()),
        ("sample_rate_hz", pa.int32()),
        ("channels", pa.int16()),
        ("text", pa.string()),
        ("speaker", pa.string()),
        ("language", pa.string()),
        ("source", pa.string()),
    ]
)
"""Columns of index.parquet, in order (contracts.md). Rows: shard ascending, then position in shard."""


def shard_name(i: int) -> str:
    return f"shard-{i:06d}.tar"


@dataclass(frozen=True, slots=True)
class ShardInfo:
    name: str
    samples: int
    seconds: float
    min_duration_s: float
    max_duration_s: float
    bytes: int
    sha256: str

    @classmethod
    def from_dict(cls, d: dict) -> "ShardInfo":
        return cls(
            name=d["name"],
            samples=int(d["samples"]),
            seconds=float(d["seconds"]),
            min_duration_s=float(d["min_duration_s"]),
            max_duration_s=float(d["max_duration_s"]),
            bytes=int(d["bytes"]),
            sha256=d["sha256"],
        )

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Dataset:
    """An opened (complete) dataset: the manifest in memory, the index read on demand."""

    url: str
    manifest: dict = field(repr=False)
    shards: list[ShardInfo] = field(repr=False)
    storage_options: dict | None = field(default=None, repr=False)
    direct_http: bool = field(default=False, repr=False)
    """Read S3 metadata through presigned URLs (storage.open_ranged) instead of s3fs."""
    budget_s: float = field(default=storage.RETRY_BUDGET_S, repr=False)
    """Time a metadata read may go without progress (the loader passes stream.retry_budget_s)."""
    manifest_version: str = field(default="", repr=False)
    """manifest.json's version (storage.version) taken before it was read: the loader compares it before a
    shard's first read, so a dataset re-packed in place during a run is refused (`still_same`)."""

    def shard_url(self, i: int) -> str:
        return storage.join(self.url, self.shards[i].name)

    def part_of(self, i: int) -> "Dataset":
        """The dataset holding shard `i`: this one (load.planner.Shards answers the same over several)."""
        return self

    @property
    def content_id(self) -> str:
        """The dataset's content identity: a hash of every shard's name and sha256 from the manifest. The index
        fingerprint (offsets, durations) stays the same when a re-pack changes audio but not layout; this does
        not, so a resume or a ledger over changed bytes is refused instead of mixing old and new audio."""
        h = hashlib.sha1()
        for s in self.shards:
            h.update(f"{s.name}:{s.sha256}\n".encode())
        return h.hexdigest()[:16]

    def still_same(self) -> bool:
        """Whether the dataset at `url` still is the one opened: manifest.json unchanged, or rewritten with the
        same shards (names and sha256s: `content_id`). One stat or small request; a re-read only after a change."""
        murl = storage.join(self.url, MANIFEST)
        try:
            now = storage.version(murl, self.storage_options, direct_http=self.direct_http, budget_s=self.budget_s)
        except FileNotFoundError:  # removed (a re-pack with --overwrite deletes the old dataset first)
            return False
        if now == self.manifest_version:
            return True
        try:
            fresh = open_dataset(self.url, self.storage_options, direct_http=self.direct_http, budget_s=self.budget_s)
        except (DatasetError, FileNotFoundError):
            return False
        return fresh.content_id == self.content_id

    @property
    def index_url(self) -> str:
        return storage.join(self.url, self.manifest.get("index", INDEX))

    def open_index(self):
        """index.parquet opened for Arrow's Parquet reader: a local one as Arrow's own file (pa.OSFile), a remote
        one through storage.open_ranged (retries, direct HTTP). Why not one Python file object for both: Arrow
        reads through its IO threads, and a Python file makes them take the GIL; such a thread still holding or
        dropping one while the interpreter exits ends the process with std::terminate ("terminate called without
        an active exception", apache/arrow#34314 and #45017; seen once here: a finished training run exited with
        SIGABRT). A local index never hands Arrow a Python object."""
        if storage.is_local(self.index_url):
            return pa.OSFile(storage.fs_and_path(self.index_url, self.storage_options)[1])
        return storage.open_ranged(self.index_url, self.storage_options, direct_http=self.direct_http,
                                   budget_s=self.budget_s)

    def read_index(self, columns: Sequence[str] | None = None) -> pa.Table:
        """index.parquet as a pyarrow Table; `columns` projects (only those column chunks are read).

        Every column read is checked against the manifest (format.validate.check_index) before it is returned:
        a row out of range, overlapping another or sized past its duration raises DatasetError. Before any row is
        read, the footer is checked (rows, column types, chunk sizes: format.indexread), and strings are read
        dictionary-encoded and length-checked before they are expanded, so a crafted index cannot make this
        allocate more than its rows x the per-column bounds. Asking for one of duration_s/num_samples/
        sample_rate_hz reads all three (they are checked against each other; ~8 bytes a row more).
        """
        wanted = list(columns) if columns is not None else None
        cols = wanted
        if wanted is not None and set(wanted) & set(RELATED_COLUMNS):  # checked against each other: read all three
            cols = wanted + [c for c in RELATED_COLUMNS if c not in wanted]
        rows = sum(s.samples for s in self.shards)
        # ParquetFile, not pq.read_table: the latter imports pyarrow.dataset/compute/acero (~30 ms) for nothing
        with self.open_index() as f:
            try:
                pf = pq.ParquetFile(f)
                if cols is None:
                    cols = list(pf.schema_arrow.names)
                check_footer(pf, rows, cols, self.index_url)  # before a single row is read
                have = set(pf.schema_arrow.names)
                cols = [c for c in cols if c in have or wanted is None or c in wanted]  # extras only if present
                pf = pq.ParquetFile(f, metadata=pf.metadata, read_dictionary=dictionary_columns(pf.schema_arrow))
                table = read_bounded(pf, cols, self.index_url)
            except (pa.ArrowException, OSError, ValueError, KeyError) as e:
                if isinstance(e, FileNotFoundError):
                    raise
                raise DatasetError(f"{self.index_url}: not a readable index ({type(e).__name__}: "
                                   f"{str(e)[:200]!r})") from None
        check_index(table, [s.bytes for s in self.shards], [s.samples for s in self.shards])
        if wanted is not None and cols != wanted:
            table = table.select([c for c in wanted if c in table.column_names])
        return table

    @property
    def totals(self) -> dict:
        return dict(self.manifest["totals"])


def open_dataset(url: str, storage_options: dict | None = None, *, direct_http: bool = False,
                 budget_s: float = storage.RETRY_BUDGET_S) -> Dataset:
    """Open a dataset folder/prefix. Reads only manifest.json (a few KB per 1,000 shards).

    The manifest is untrusted input: it is parsed with bounds and checked (format.validate) so that every shard
    and index name stays inside the dataset; anything else raises DatasetError naming the field and value.

    `direct_http` reads S3 metadata over presigned URLs (see shardtrain.s3http): the loader's choice, because
    with explicit keys it skips s3fs's ~0.3 s start-up.
    """
    url = str(url).rstrip("/")
    murl = storage.join(url, MANIFEST)
    try:  # the version first: a change while reading is then seen as a change (still_same)
        version = storage.version(murl, storage_options, direct_http=direct_http, budget_s=budget_s)
        raw = storage.read_bytes(murl, storage_options, direct_http=direct_http, budget_s=budget_s)
    except (FileNotFoundError, NotADirectoryError):
        from shardtrain.format.locate import missing_manifest_message

        raise DatasetError(missing_manifest_message(url, storage_options)) from None
    manifest = parse_manifest(raw, murl)
    if manifest.get("format") != FORMAT:
        raise DatasetError(f"{murl}: not a shardtrain manifest (format={show(manifest.get('format'))})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DatasetError(
            f"{murl}: format_version {show(manifest.get('format_version'))} is not supported "
            f"(this shardtrain reads version {FORMAT_VERSION})"
        )
    shards = [ShardInfo(**s) for s in check_manifest(manifest, murl)]
    return Dataset(url=url, manifest=manifest, shards=shards, storage_options=storage_options,
                   direct_http=direct_http, budget_s=budget_s, manifest_version=version)


ROW_GROUP = 1 << 17
"""Rows per index.parquet row group. pack assembles the index one row group at a time (~45 MB of rows with
LibriSpeech-length transcripts), so this bounds its driver memory; readers project columns, any size works."""


def index_table(rows: list[dict]) -> pa.Table:
    """Rows (dicts with INDEX_SCHEMA's names) to a typed table; missing nullable fields become null."""
    cols = [column_arrow([r.get(f.name) for r in rows], f.type) for f in INDEX_SCHEMA]
    return pa.table(cols, schema=INDEX_SCHEMA)  # Arrow columns, so pyarrow does not import pandas


def index_bytes(table: pa.Table) -> bytes:
    """Serialise deterministically (no pandas metadata, fixed row groups) so equal input -> equal bytes."""
    buf = io.BytesIO()
    pq.write_table(
        table.replace_schema_metadata(None),
        buf,
        compression="zstd",
        row_group_size=ROW_GROUP,
        write_statistics=True,
        store_schema=False,
    )
    return buf.getvalue()


def write_index(url: str, table: pa.Table, storage_options: dict | None = None) -> None:
    storage.atomic_write_bytes(storage.join(url, INDEX), index_bytes(table), storage_options)


def manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def write_manifest(url: str, manifest: dict, storage_options: dict | None = None) -> None:
    """Write manifest.json: call this LAST; its presence marks the dataset complete."""
    storage.atomic_write_bytes(storage.join(url, MANIFEST), manifest_bytes(manifest), storage_options)
