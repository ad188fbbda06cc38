"""A memory-mapped copy of the index, built once per node, for corpora too large to hold in every rank.

    manifest.json -> dataset id (sha1 of the manifest: shard names, sizes, checksums)
    index.parquet, one row group at a time (bounded memory; each checked with format.validate.check_index,
    plus what only the whole index shows: rows per shard, (shard, offset) order, duration order)
      -> ROOT/<id>/<column>.npy for PLAN_COLUMNS, key.offsets.npy + key.bytes (raw UTF-8), the same for text,
         meta.json
      -> np.load(mmap_mode="r") -> PlanIndex over memory maps: every rank and worker on the node shares the pages
    ROOT/<id>/blocks-<params>.npz: the block table (load/blockplan.make_blocks) for one batch budget

Why: plan_epoch needs every row in every rank, ~70 B a row plus Arrow strings: 100M rows are ~7 GB in each of
8 ranks. With the block planner a rank reads the block table (~30 B a block, at most ~1.8M blocks) and touches
only the pages of its own rows (1/world_size of them per epoch), so per-node memory is the block table per rank
plus the pages in use, whatever the corpus size.

Cost: the first rank on a node builds the copy: one sequential read of the index's numeric columns, keys and
(with check_transcripts) transcripts, written once to local disk (~200 B a row with LibriSpeech-length
transcripts: 2.3 s and 200 MB per 1M rows, 10-17 s and 2 GB per 10M, benchmarks/bench_block_loader.py). The
others wait on a file lock and open it;
later runs open it at once. It is built in a temporary folder and renamed into place, so a crash never leaves a
half-written copy that looks complete.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from tqdm import tqdm

from shardtrain import storage
from shardtrain.format.manifest import Dataset
from shardtrain.format.validate import DatasetError, check_index
from shardtrain.load.blockplan import Blocks, make_blocks
from shardtrain.load.plan import PLAN_COLUMNS, BucketConfig, PlanIndex, cost_s, table_edges

log = logging.getLogger(__name__)

MAPPED_VERSION = 2
"""Bumped when the folder's layout changes; an older copy is rebuilt, not misread."""
STRINGS = ("key", "text")


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
    """{version, rows, fingerprint, sample_rates, columns}."""


def default_root() -> str:
    """Where copies go unless StreamConfig.index_cache_dir says: the temp folder (node-local, shared by ranks)."""
    return os.path.join(tempfile.gettempdir(), "shardtrain-index")


def dataset_id(ds: Dataset) -> str:
    return hashlib.sha1(json.dumps(ds.manifest, sort_keys=True).encode()).hexdigest()[:16]


def open_mapped(ds: Dataset, root: str, *, text: bool) -> MappedIndex:
    """The node's memory-mapped index of `ds` under `root`, built first when missing (one builder per node)."""
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    folder = base / dataset_id(ds)
    with open(base / f"{folder.name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks of one node wait here while the first one builds
        meta = _read_meta(folder)
        if meta is None or (text and "text" not in meta["columns"]):
            if folder.exists():
                shutil.rmtree(folder)
            _build(ds, folder, text=text)
            meta = _read_meta(folder)
            assert meta is not None
    return MappedIndex(idx=_open(folder, meta), folder=folder, meta=meta)


def _read_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if meta.get("version") == MAPPED_VERSION else None


def _open(folder: Path, meta: dict) -> PlanIndex:
    cols: dict[str, Any] = {c: np.load(folder / f"{c}.npy", mmap_mode="r") for c in PLAN_COLUMNS}
    for c in STRINGS:
        cols[c] = (MappedStrings(np.load(folder / f"{c}.offsets.npy", mmap_mode="r"), _map_bytes(folder / f"{c}.bytes"))
                   if c in meta["columns"] else None)
    return PlanIndex(**cols)


def _map_bytes(path: Path) -> np.ndarray:
    """A raw file as a read-only uint8 memory map (mmap refuses an empty file: then an empty array)."""
    return np.memmap(path, np.uint8, "r") if path.stat().st_size else np.zeros(0, np.uint8)


class _Writer:
    """Column files filled one row group at a time; string bytes appended to a raw file, offsets to an .npy."""

    def __init__(self, folder: Path, rows: int, schema, strings: tuple[str, ...]):
        self.at = 0
        dtype = lambda c: np.dtype(schema.field(c).type.to_pandas_dtype())  # noqa: E731
        self.cols = {c: np.lib.format.open_memmap(folder / f"{c}.npy", "w+", dtype(c), (rows,)) for c in PLAN_COLUMNS}
        self.offsets = {c: np.lib.format.open_memmap(folder / f"{c}.offsets.npy", "w+", np.int64, (rows + 1,))
                        for c in strings}
        self.raw = {c: open(folder / f"{c}.bytes", "wb") for c in strings}
        self.nbytes = dict.fromkeys(strings, 0)

    def add(self, table) -> None:
        n, a = table.num_rows, self.at
        for c, out in self.cols.items():
            out[a:a + n] = table.column(c).to_numpy(zero_copy_only=False)
        for c, f in self.raw.items():
            arr = table.column(c).combine_chunks().cast("large_string")
            offs = np.frombuffer(arr.buffers()[1], np.int64, n + 1, arr.offset * 8)
            f.write(memoryview(arr.buffers()[2])[offs[0]:offs[-1]])
            self.offsets[c][a + 1:a + n + 1] = self.nbytes[c] + offs[1:] - offs[0]
            self.nbytes[c] += int(offs[-1] - offs[0])
        self.at += n

    def close(self) -> None:
        for out in (*self.cols.values(), *self.offsets.values()):
            out.flush()
        for f in self.raw.values():
            f.close()


def _build(ds: Dataset, folder: Path, *, text: bool) -> None:
    strings = ("key", "text") if text else ("key",)
    rows = sum(s.samples for s in ds.shards)
    if rows == 0:
        raise DatasetError(f"{ds.url}: the dataset has no samples to plan")
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    log.info("building a memory-mapped index of %s (%d rows) in %s", ds.url, rows, folder)
    try:
        with storage.open_ranged(ds.index_url, ds.storage_options, direct_http=ds.direct_http) as f:
            pf = pq.ParquetFile(f)
            if pf.metadata.num_rows != rows:
                raise DatasetError(f"{ds.index_url}: {pf.metadata.num_rows} rows, the manifest's shards hold {rows}")
            w = _Writer(tmp, rows, pf.schema_arrow, strings)
            check = _WholeIndexCheck(ds)
            cols = list(PLAN_COLUMNS) + ["sample_rate_hz", *strings]
            for g in tqdm(range(pf.num_row_groups), desc="index -> memory map", unit="group", disable=None):
                table = pf.read_row_group(g, columns=cols)
                check_index(table, [s.bytes for s in ds.shards], None, w.at)
                check.add(table, w.at)
                w.add(table)
            w.close()
        check.finish()
        meta = {"version": MAPPED_VERSION, "rows": rows, "columns": [*PLAN_COLUMNS, *strings],
                "sample_rates": sorted(check.rates), "fingerprint": _open(tmp, {"columns": strings}).fingerprint()}
        (tmp / "meta.json").write_text(json.dumps(meta))
        os.replace(tmp, folder)
    except BaseException:
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
    """The block table for this budget: from ROOT/<id>/blocks-<params>.npz, made (streaming) when missing."""
    params = json.dumps([block_s, block_rows, cfg.max_batch_seconds, cfg.quadratic_duration_s, cfg.budget_table])
    path = mi.folder / f"blocks-{hashlib.sha1(params.encode()).hexdigest()[:12]}.npz"
    with open(mi.folder.parent / f"{mi.folder.name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            b = make_blocks(mi.idx.duration_s, mi.idx.size, block_s, cfg.max_batch_seconds,
                            lambda d: cost_s(d, cfg), block_rows, table_edges(cfg))
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, **{f: getattr(b, f) for f in Blocks.__slots__})  # type: ignore[attr-defined]
            os.replace(tmp, path)
    with np.load(path) as z:
        return Blocks(**{f: z[f] for f in Blocks.__slots__})  # type: ignore[attr-defined]
