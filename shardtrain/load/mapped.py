"""A memory-mapped copy of the index, built once per node, for corpora too large to hold in every rank.

    manifest.json + index.parquet's size and footer -> copy id (sha256: a re-packed or edited index gets its own)
    index.parquet, one row group at a time (bounded memory; each checked with format.validate.check_index,
    plus what only the whole index shows: rows per shard, (shard, offset) order, duration order)
      -> ROOT/<id>/<column>.npy for PLAN_COLUMNS, key.offsets.npy + key.bytes (raw UTF-8), the same for text,
         meta.json (with every file's size and digest: load/mapfiles.py)
      -> checked (mapfiles.verify) -> np.load(mmap_mode="r") -> PlanIndex over memory maps: every rank and worker
         on the node shares the pages
    ROOT/<id>/blocks-<params>.npz: the block table (load/blockplan.make_blocks) for one batch budget, re-checked
    against the durations each time it is read

Why: plan_epoch needs every row in every rank, ~70 B a row plus Arrow strings: 100M rows are ~7 GB in each of
8 ranks. With the block planner a rank reads the block table (~30 B a block, at most ~1.8M blocks) and touches
only the pages of its own rows (1/world_size of them per epoch), so per-node memory is the block table per rank
plus the pages in use, whatever the corpus size.

Trust: ROOT is a private folder of this user (storage.private: 0700, owner checked, never a symlink; the default is
<tempdir>/shardtrain-<uid>/index), so no other local user can plant or edit a copy. A copy is keyed by the bytes it
derives from (manifest, index size and Parquet footer: the footer holds every column chunk's offset, size and
statistics) and checked when opened (mapfiles.verify: sizes, headers, a full digest of the budget-critical
columns, a sampled one of the rest, durations finite and ascending); one that fails is rebuilt, never used.

Cost: the first rank on a node builds the copy: one sequential read of the index's numeric columns, keys and
(with check_transcripts) transcripts, written once to local disk (~200 B a row with LibriSpeech-length
transcripts: 2.3 s and 200 MB per 1M rows, 10-17 s and 2 GB per 10M, benchmarks/load/bench_block_loader.py). The
others wait on a file lock and open it; later runs open it after the check (~140 ms per 1M rows on 2 busy
cores, 4% of a build; benchmarks/load/bench_mapped_check.py). It is written with plain writes into a temporary
folder (space checked and preallocated first: a full disk is an error naming the folder, never a SIGBUS) and
renamed into place, so a crash never leaves a half-written copy that looks complete.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow.parquet as pq
from tqdm import tqdm

from shardtrain import storage
from shardtrain.format.indexread import check_footer, dictionary_columns, read_bounded
from shardtrain.format.manifest import Dataset
from shardtrain.format.validate import DatasetError, check_index
from shardtrain.load import mapfiles
from shardtrain.load.blockplan import Blocks, make_blocks
from shardtrain.load.plan import PLAN_COLUMNS, BucketConfig, PlanIndex, cost_s, table_edges
from shardtrain.storage.private import NoSpace, PrivateDirError, private_dir, remove_own_tree, space_error, user_dir

log = logging.getLogger(__name__)

MAPPED_VERSION = 3
"""Bumped when the folder's layout changes; an older copy is rebuilt, not misread (3: plain writes, digests)."""
STRINGS = ("key", "text")
SETTING = "stream.index_cache_dir"


@dataclass(frozen=True, slots=True)
class MappedStrings:
    """A string column as two memory maps: byte offsets (n + 1, int64) and the UTF-8 bytes. Indexing gives a str."""

    offsets: np.ndarray
    data: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        return bytes(self.data[int(self.offsets[i]):int(self.offsets[i + 1])]).decode()


@dataclass(frozen=True, slots=True)
class MappedIndex:
    idx: PlanIndex
    folder: Path
    meta: dict
    """{version, rows, fingerprint, sample_rates, columns, source, files}."""


def default_root() -> str:
    """Where copies go unless StreamConfig.index_cache_dir says: this user's private folder in the temp folder
    (node-local, shared by the user's ranks): <tempdir>/shardtrain-<uid>/index (storage.private.user_dir)."""
    return str(user_dir("index", setting=SETTING))


def index_source(ds: Dataset) -> dict:
    """What the copy derives from, cheaply: the manifest's digest, the index's size and its Parquet footer's digest
    (two small ranged reads of the index)."""
    with storage.open_ranged(ds.index_url, ds.storage_options, direct_http=ds.direct_http) as f:
        size = f.seek(0, os.SEEK_END)
        tail = b""
        if size >= 12:
            f.seek(size - 8)
            tail = f.read(8)
        n = int.from_bytes(tail[:4], "little") if tail[4:] == b"PAR1" else 0
        if not 0 < n <= size - 12:
            raise DatasetError(f"{ds.index_url}: not a Parquet file (no footer)")
        f.seek(size - 8 - n)
        footer = f.read(n)
    return {"manifest_sha256": hashlib.sha256(json.dumps(ds.manifest, sort_keys=True).encode()).hexdigest(),
            "index_bytes": size, "index_footer_sha256": hashlib.sha256(footer + tail).hexdigest()}


def dataset_id(ds: Dataset, source: dict | None = None) -> str:
    """The copy's folder name: a digest of `index_source(ds)` (read when not given)."""
    return hashlib.sha256(json.dumps(source or index_source(ds), sort_keys=True).encode()).hexdigest()[:24]


@contextlib.contextmanager
def _flock(path: Path, how: int) -> Iterator[None]:
    with open(path, "a+") as lock:
        fcntl.flock(lock, how)
        yield


def open_mapped(ds: Dataset, root: str, *, text: bool) -> MappedIndex:
    """The node's memory-mapped index of `ds` under `root` (a private folder: created 0700, or checked), built
    first when missing or when the copy there fails its check (one builder per node; checks run in parallel)."""
    base = private_dir(root, setting=SETTING)
    source = index_source(ds)
    folder = base / dataset_id(ds, source)
    lock = base / f"{folder.name}.lock"
    with _flock(lock, fcntl.LOCK_SH):  # ranks check a built copy in parallel
        opened = _open_checked(folder, text)
    if opened is None:
        with _flock(lock, fcntl.LOCK_EX):  # ranks of one node wait here while the first one builds
            opened = _open_checked(folder, text)
            if opened is None:
                if os.path.lexists(folder):
                    remove_own_tree(folder)
                _build(ds, folder, text=text, source=source)
                opened = _open_checked(folder, text)
                if opened is None:
                    raise DatasetError(f"{folder}: the memory-mapped index fails its check right after being built")
    return MappedIndex(idx=opened[0], folder=folder, meta=opened[1])


def _open_checked(folder: Path, text: bool) -> tuple[PlanIndex, dict] | None:
    """The copy in `folder` mapped, when it is complete, current and passes mapfiles.verify; None otherwise (a
    failing one is logged: it is rebuilt by the caller)."""
    meta = _read_meta(folder)
    if meta is None or (text and "text" not in meta["columns"]):
        return None
    try:
        idx = _open(folder, meta)
        why = mapfiles.verify(folder, meta, {c: getattr(idx, c) for c in PLAN_COLUMNS})
    except (OSError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        log.warning("the memory-mapped index %s fails its check (%s): rebuilding it", folder, why)
        return None
    return idx, meta


def _read_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("version") == MAPPED_VERSION else None


def _open(folder: Path, meta: dict) -> PlanIndex:
    cols: dict[str, Any] = {c: np.load(folder / f"{c}.npy", mmap_mode="r") for c in PLAN_COLUMNS}
    for c in STRINGS:
        cols[c] = (MappedStrings(np.load(folder / f"{c}.offsets.npy", mmap_mode="r"), _map_bytes(folder / f"{c}.bytes"))
                   if c in meta["columns"] else None)
    return PlanIndex(**cols)


def _map_bytes(path: Path) -> np.ndarray:
    """A raw file as a read-only uint8 memory map (mmap refuses an empty file: then an empty array)."""
    return np.memmap(path, np.uint8, "r") if path.stat().st_size else np.zeros(0, np.uint8)


def _need_bytes(pf, rows: int, dtypes: dict[str, np.dtype], strings: tuple[str, ...]) -> int:
    """Bytes the copy takes on disk: exact for the columns and offsets, the strings' uncompressed size otherwise."""
    names = pf.schema_arrow.names
    text = sum(pf.metadata.row_group(g).column(names.index(c)).total_uncompressed_size
               for g in range(pf.num_row_groups) for c in strings)
    return rows * (sum(dt.itemsize for dt in dtypes.values()) + 8 * len(strings)) + text + (1 << 16)


def _build(ds: Dataset, folder: Path, *, text: bool, source: dict) -> None:
    strings = ("key", "text") if text else ("key",)
    rows = sum(s.samples for s in ds.shards)
    if rows == 0:
        raise DatasetError(f"{ds.url}: the dataset has no samples to plan")
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    log.info("building a memory-mapped index of %s (%d rows) in %s", ds.url, rows, folder)
    need, w = 0, None
    try:
        with ds.open_index() as f:
            pf = pq.ParquetFile(f)
            if pf.metadata.num_rows != rows:
                raise DatasetError(f"{ds.index_url}: {pf.metadata.num_rows} rows, the manifest's shards hold {rows}")
            dtypes = {c: np.dtype(pf.schema_arrow.field(c).type.to_pandas_dtype()) for c in PLAN_COLUMNS}
            need = _need_bytes(pf, rows, dtypes, strings)
            if shutil.disk_usage(tmp).free < need:
                raise space_error(folder.parent, need, "the memory-mapped index", SETTING)
            w = mapfiles.ColumnFiles(tmp, rows, dtypes, strings)
            check = _WholeIndexCheck(ds)
            cols = list(PLAN_COLUMNS) + ["sample_rate_hz", *strings]
            check_footer(pf, rows, cols, ds.index_url)  # sizes bounded before a row group is read
            pf = pq.ParquetFile(f, metadata=pf.metadata, read_dictionary=dictionary_columns(pf.schema_arrow))
            for g in tqdm(range(pf.num_row_groups), desc="index -> memory map", unit="group", disable=None):
                table = read_bounded(pf, cols, ds.index_url, row_group=g)  # strings length-checked, then decoded
                check_index(table, [s.bytes for s in ds.shards], None, w.at)
                check.add(table, w.at)
                w.add(table)
            w.close()
        check.finish()
        meta = {"version": MAPPED_VERSION, "rows": rows, "columns": [*PLAN_COLUMNS, *strings], "source": source,
                "sample_rates": sorted(check.rates), "fingerprint": _open(tmp, {"columns": strings}).fingerprint(),
                "files": mapfiles.digests(tmp)}
        (tmp / "meta.json").write_text(json.dumps(meta))
        os.replace(tmp, folder)
    except OSError as e:
        if w is not None:
            w.abort()
        shutil.rmtree(tmp, ignore_errors=True)  # space is free again once the files are closed and gone
        if e.errno in mapfiles.SPACE_ERRORS and not isinstance(e, (NoSpace, PrivateDirError)):
            raise space_error(folder.parent, need, "the memory-mapped index", SETTING, more=True) from e
        raise
    except BaseException:
        if w is not None:
            w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _WholeIndexCheck:
    """What check_index cannot see one row group at a time: rows per shard against the manifest, no two rows
    overlapping (rows in (shard, offset) order, the packer's), and rows in duration order (the block planner cuts
    the index into runs of neighbouring durations)."""

    def __init__(self, ds: Dataset):
        self.ds = ds
        self.counts = np.zeros(len(ds.shards), np.int64)
        self.last = (-1, 0, -np.inf)  # shard, end byte, duration of the previous row
        self.rates: set[int] = set()

    def add(self, table, first_row: int) -> None:
        shard = table.column("shard").to_numpy().astype(np.int64)
        off = table.column("offset").to_numpy()
        end = off + table.column("size").to_numpy()
        dur = table.column("duration_s").to_numpy()
        self.counts += np.bincount(shard, minlength=len(self.counts))
        self.rates.update(np.unique(table.column("sample_rate_hz").to_numpy()).tolist())
        if not len(shard):
            return
        ps, pe, pd = np.concatenate([[self.last[0]], shard[:-1]]), np.concatenate([[self.last[1]], end[:-1]]), \
            np.concatenate([[self.last[2]], dur[:-1]])
        bad = (shard < ps) | ((shard == ps) & (off < pe))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DatasetError(f"{self.ds.index_url}: row {first_row + i} is out of (shard, offset) order or overlaps "
                               "the row before; re-run `shardtrain pack`")
        if (dur < pd).any():
            i = int(np.flatnonzero(dur < pd)[0])
            raise DatasetError(f"{self.ds.index_url}: row {first_row + i} is out of duration order; the block planner "
                               "needs the packer's duration-sorted index (re-run `shardtrain pack`, or set "
                               "stream.planner=rows)")
        self.last = (int(shard[-1]), int(end[-1]), float(dur[-1]))

    def finish(self) -> None:
        want = np.asarray([s.samples for s in self.ds.shards], np.int64)
        wrong = np.flatnonzero(self.counts != want)
        if len(wrong):
            i = int(wrong[0])
            raise DatasetError(f"{self.ds.index_url}: {self.counts[i]} rows for shard {i}, the manifest says {want[i]}")


def mapped_blocks(mi: MappedIndex, cfg: BucketConfig, block_s: float, block_rows: int) -> Blocks:
    """The block table for this budget: from ROOT/<id>/blocks-<params>.npz when it agrees with the (checked)
    durations and sizes (mapfiles.check_blocks), made (streaming) otherwise."""
    params = json.dumps([block_s, block_rows, cfg.max_batch_seconds, cfg.quadratic_duration_s, cfg.budget_table])
    path = mi.folder / f"blocks-{hashlib.sha1(params.encode()).hexdigest()[:12]}.npz"
    cost_fn = lambda d: cost_s(d, cfg)  # noqa: E731
    with _flock(mi.folder.parent / f"{mi.folder.name}.lock", fcntl.LOCK_EX):
        b = _read_blocks(path)
        why = "missing" if b is None else mapfiles.check_blocks(b, mi.idx.duration_s, mi.idx.size, cost_fn,
                                                                 cfg.max_batch_seconds)
        if why is not None:
            if b is not None:
                log.warning("the block table %s fails its check (%s): remaking it", path, why)
            b = make_blocks(mi.idx.duration_s, mi.idx.size, block_s, cfg.max_batch_seconds, cost_fn, block_rows,
                            table_edges(cfg))
            tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npz")
            try:
                np.savez(tmp, **{f: getattr(b, f) for f in Blocks.__slots__})  # type: ignore[attr-defined]
                os.replace(tmp, path)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                if e.errno in mapfiles.SPACE_ERRORS:
                    raise space_error(mi.folder, 64 * len(b), "the block table", SETTING) from e
                raise
    assert b is not None
    return b


def _read_blocks(path: Path) -> Blocks | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            return Blocks(**{f: z[f] for f in Blocks.__slots__})  # type: ignore[attr-defined]
    except (OSError, ValueError, KeyError, EOFError) as e:
        if not isinstance(e, FileNotFoundError):
            log.warning("the block table %s is unreadable (%s): remaking it", path, e)
        return None
