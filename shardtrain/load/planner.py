"""The planner seam (design invariant 13): what a rank reads, behind one small interface the Loader drives.

    Planner (one per loader; rows, blocks, or a weighted mixture of either)
      .epoch(epoch, world_size, chain) -> EpochView          pure: any rank, any step, any world size history
          .steps                                           batches every rank yields in this epoch
          .rows                                            samples the epoch delivers over all ranks
          .chunks(rank, step) -> RankChunk ...             that rank's chunks ending after `step`, plan order
      .name ("rows" | "blocks"), .fingerprint (dataset identity for resume), .too_long (left out per epoch),
      .data: Shards (shard id -> URL, name, size, checksum), .datasets (URLs), .sample_rate_hz

    RankChunk: (first step, Chunk, the PlanIndex its rows index, origin: dataset number and dataset row of every
               index row) -> the reader needs only the index; Batch.rows/sources and per-dataset seconds come
               from the origin, carried with the chunk (no second plan).

Planners here: RowsPlanner (plan_epoch over an index held in the rank) and BlocksPlanner (blockplan over the
node-shared memory map; a rank deals only its own groups). load/mixplan.py adds the weighted mixture over
either. Because a planner answers for ANY rank and any chain of earlier world sizes, elastic re-striping, the
`shardtrain plan` report and tests ask the same object the Loader reads from; a new way of choosing what a rank
reads is a new planner, never a second loader.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np
import numpy.ma  # noqa: F401  (np.unique imports it on first use: ~14 ms of the loader's first batch)

from shardtrain.format.arrownp import numpy_of
from shardtrain.format.manifest import Dataset, ShardInfo, open_dataset
from shardtrain.load.blockplan import Blocks, BlockPlan, block_epoch, block_shape, chunks_from
from shardtrain.load import rowfilter
from shardtrain.load.config import StreamConfig, refuse_ignored_fields
from shardtrain.load.mapped import MappedIndex, default_root, mapped_blocks, open_mapped
from shardtrain.load.plan import (CHECK_COLUMNS, PLAN_COLUMNS, BucketConfig, Chunk, EpochPlan, PlanIndex,
                                  consumed_rows, cost_s,
                                  plan_epoch)
from shardtrain.load.errors import StreamError

log = logging.getLogger(__name__)

Chain = Sequence[Sequence[int]]
"""[(world size, steps done), ...]: earlier segments of an epoch under other world sizes (elastic resume)."""


# ---------------------------------------------------------------------------------------------- the seam
@dataclass(frozen=True, slots=True)
class Shards:
    """Where a shard lives, over one dataset or several: global shard id -> (dataset, its shard)."""

    url: str
    """The first remote dataset's URL (caching and presigning treat the whole as remote), else the first."""
    parts: tuple[Dataset, ...]
    shards: list[ShardInfo]
    """Every dataset's shards in order (named `d<i>/<name>` in a mixture: names are unique per dataset only)."""
    base: np.ndarray
    """Global id of each dataset's first shard."""
    storage_options: dict | None = field(default=None, repr=False)  # may hold keys: never in a repr

    @classmethod
    def of(cls, parts: Sequence[Dataset], storage_options: dict | None) -> "Shards":
        from shardtrain import storage

        counts = [len(d.shards) for d in parts]
        base = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        remote = [d.url for d in parts if not storage.is_local(d.url)]
        shards = (list(parts[0].shards) if len(parts) == 1 else
                  [replace(sh, name=f"d{i}/{sh.name}") for i, d in enumerate(parts) for sh in d.shards])
        return cls(url=remote[0] if remote else parts[0].url, parts=tuple(parts), shards=shards, base=base,
                   storage_options=storage_options)

    def _part(self, i: int) -> int:
        return int(np.searchsorted(self.base, i, side="right")) - 1

    def part_of(self, i: int) -> Dataset:
        """The dataset holding global shard `i` (the loader's check that it was not re-packed: Dataset.still_same)."""
        return self.parts[self._part(i)]

    def shard_url(self, i: int) -> str:
        d = self._part(i)
        return self.parts[d].shard_url(int(i - self.base[d]))


@dataclass(frozen=True, slots=True)
class RankChunk:
    first_step: int
    chunk: Chunk
    index: PlanIndex
    """The index `chunk`'s rows refer to (shard ids global in Shards)."""
    source: np.ndarray | None = None
    """Dataset number of every index row (None: all dataset 0)."""
    row: np.ndarray | None = None
    """Row in its dataset's index of every index row (None: the index row itself)."""

    def origin(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset rows int64, dataset numbers int16) of index rows."""
        rows = np.asarray(rows, np.int64)
        return (rows if self.row is None else self.row[rows],
                np.zeros(len(rows), np.int16) if self.source is None else self.source[rows].astype(np.int16))


class EpochView(Protocol):
    @property
    def steps(self) -> int:
        """Batches every rank yields in this epoch."""

    @property
    def rows(self) -> int:
        """Samples this epoch delivers over all ranks (the skip share's base)."""

    def chunks(self, rank: int, step: int = 0) -> Iterator[RankChunk]:
        """`rank`'s chunks that end after `step`, in step order (a resume skips the batches before it)."""


class Planner(Protocol):
    name: str
    """"rows" or "blocks" (a mixture's too): kept in the state, a mid-epoch resume needs the same."""
    fingerprint: str
    """The data's identity (index fingerprint; a mixture's: its datasets' and weights'), checked on resume."""
    content: str
    """The data's content identity (Dataset.content_id: shard sha256s; a mixture's: its datasets'), checked on
    resume, so a same-layout re-pack is refused instead of mixing old and new audio."""
    data: Shards
    datasets: list[str]
    too_long: int
    """Utterances left out of every epoch because one alone exceeds its batch budget (counted once an epoch)."""
    filtered: int
    """Utterances left out of every epoch by the load-time filters (load/rowfilter.py; counted once an epoch)."""
    sample_rate_hz: int

    def epoch(self, epoch: int, world_size: int, chain: Chain = ()) -> EpochView:
        """The plan of `epoch` for `world_size` ranks after the steps of `chain`; pure, so any rank may ask."""

    def selection(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset number, dataset row) of every row the epoch holds (a repeated row once per time)."""
        ...


# ---------------------------------------------------------------------------------------------- rows
@dataclass(frozen=True, slots=True)
class RowsEpoch:
    plan: EpochPlan
    index: PlanIndex
    rows: int
    source: np.ndarray | None = None
    row: np.ndarray | None = None

    @property
    def steps(self) -> int:
        return self.plan.steps

    def chunks(self, rank: int, step: int = 0) -> Iterator[RankChunk]:
        first = 0
        for chunk in self.plan.rank_chunks(rank):
            if first + len(chunk.batches) > step:
                yield RankChunk(first, chunk, self.index, self.source, self.row)
            first += len(chunk.batches)


def epoch_plan(idx: PlanIndex, seed: int, epoch: int, world_size: int, cfg: BucketConfig,
               chain: Chain = (), dropped: np.ndarray | None = None) -> EpochPlan:
    """The plan for `epoch`, after excluding rows the load-time filters drop (`dropped`, a row mask) and rows
    consumed under earlier world sizes (`chain`)."""
    exclude = dropped
    for ws, steps in chain:
        prev = plan_epoch(idx, seed=seed, epoch=epoch, world_size=int(ws), cfg=cfg, exclude=exclude)
        mask = np.zeros(len(idx), bool) if exclude is None else exclude.copy()
        mask[consumed_rows(prev, int(steps))] = True
        exclude = mask
    return plan_epoch(idx, seed=seed, epoch=epoch, world_size=world_size, cfg=cfg, exclude=exclude)


def rows_epoch(idx: PlanIndex, seed: int, epoch: int, world_size: int, cfg: BucketConfig, chain: Chain,
               source: np.ndarray | None = None, row: np.ndarray | None = None,
               dropped: np.ndarray | None = None) -> RowsEpoch:
    plan = epoch_plan(idx, seed, epoch, world_size, cfg, chain, dropped)
    return RowsEpoch(plan, idx, len(usable_rows(idx, cfg, dropped)), source, row)


def usable_rows(idx: PlanIndex, cfg: BucketConfig, dropped: np.ndarray | None = None) -> np.ndarray:
    """Rows an epoch holds: within the batch budget and kept by the load-time filters."""
    ok = cost_s(idx.duration_s, cfg) <= cfg.max_batch_seconds
    return np.flatnonzero(ok if dropped is None else ok & ~dropped)


class RowsPlanner:
    """plan_epoch over the whole index, held by every rank (~70 B a row plus keys and transcripts)."""

    name = "rows"

    def __init__(self, ds: Dataset, cfg: StreamConfig, seed: int, storage_options: dict | None):
        checks = [c for c in CHECK_COLUMNS if cfg.check_transcripts or c != "text"]
        table = ds.read_index(columns=list(PLAN_COLUMNS) + ["sample_rate_hz", *checks])
        self.sample_rate_hz = _one_rate(ds.url, np.unique(numpy_of(table.column("sample_rate_hz"))))
        self.idx = PlanIndex.from_table(table)
        self.fingerprint, self.content = self.idx.fingerprint(), ds.content_id
        self.bucket, self.seed = cfg.bucket, seed
        self.data, self.datasets = Shards.of([ds], storage_options), [ds.url]
        self.dropped = index_drop_mask(ds, cfg, self.idx.duration_s)
        self.filtered = 0 if self.dropped is None else int(self.dropped.sum())
        over = cost_s(self.idx.duration_s, cfg.bucket) > cfg.bucket.max_batch_seconds
        self.too_long = int((over if self.dropped is None else over & ~self.dropped).sum())
        rowfilter.log_filtered(ds.url, cfg, self.filtered, len(self.idx))

    def epoch(self, epoch: int, world_size: int, chain: Chain = ()) -> RowsEpoch:
        return rows_epoch(self.idx, self.seed, epoch, world_size, self.bucket, chain, dropped=self.dropped)

    def selection(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        rows = usable_rows(self.idx, self.bucket, self.dropped)
        return np.zeros(len(rows), np.int16), rows.astype(np.int64)


def index_drop_mask(ds: Dataset, cfg: StreamConfig, duration_s: np.ndarray) -> np.ndarray | None:
    """The load-time filters' row mask of `ds` (None: no filter set); reads the speaker column only if needed."""
    if not rowfilter.active(cfg):
        return None
    speaker = ds.read_index(columns=["speaker"]).column("speaker") if rowfilter.needs_speaker(cfg) else None
    return rowfilter.drop_mask(cfg, duration_s, speaker)


# ---------------------------------------------------------------------------------------------- blocks
@dataclass(frozen=True, slots=True)
class BlocksEpoch:
    plan: BlockPlan
    blocks: Blocks
    cost_of: Callable[[np.ndarray], np.ndarray]
    seed: int
    gone: np.ndarray
    """Rows of partly consumed groups of earlier segments (elastic re-stripe)."""
    rows: int
    index: PlanIndex | None = None
    """The index the rows refer to; None: `localize` makes one per chunk (a mixture's virtual rows)."""
    localize: Callable[[int, Chunk], RankChunk] | None = None

    @property
    def steps(self) -> int:
        return self.plan.steps

    def chunks(self, rank: int, step: int = 0) -> Iterator[RankChunk]:
        for first, chunk in chunks_from(self.plan, self.blocks, self.cost_of, rank, self.seed, self.gone, step):
            if self.localize is not None:
                yield self.localize(first, chunk)
            else:
                assert self.index is not None
                yield RankChunk(first, chunk, self.index)


def blocks_epoch(blocks: Blocks, cost_of, seed: int, epoch: int, world_size: int, cfg: BucketConfig, chain: Chain,
                 **kw) -> BlocksEpoch:
    plan, gone = block_epoch(blocks, cost_of, seed=seed, epoch=epoch, world_size=world_size, cfg=cfg,
                             chain=tuple(chain))
    rows = int(blocks.rows[~blocks.too_long].sum())  # the whole epoch's, re-striped or not (as for rows)
    return BlocksEpoch(plan, blocks, cost_of, seed, gone, rows, **kw)


def open_blocks(ds: Dataset, cfg: StreamConfig) -> tuple[MappedIndex, Blocks]:
    """The node's memory-mapped index of `ds` and its block table for this budget (built once per node)."""
    mi = open_mapped(ds, cfg.index_cache_dir or default_root(), text=cfg.check_transcripts)
    rows = int(mi.meta["rows"])
    block_s, block_rows = block_shape(float(ds.totals.get("seconds", 0.0)), rows, cfg.bucket.batches_per_chunk,
                                      cfg.block_s)
    blocks = mapped_blocks(mi, cfg.bucket, block_s, block_rows)
    log.info("%s: %d rows, planned by %d blocks of <= %.0f s and %d rows (index memory-mapped in %s)", ds.url,
             rows, len(blocks), block_s, block_rows, mi.folder)
    return mi, blocks


class BlocksPlanner:
    """blockplan over the node-shared memory map: per rank the block table plus its own rows, any corpus size."""

    name = "blocks"

    def __init__(self, ds: Dataset, cfg: StreamConfig, seed: int, storage_options: dict | None):
        mi, self.blocks = open_blocks(ds, cfg)
        self.idx, self.fingerprint, self.content = mi.idx, mi.meta["fingerprint"], ds.content_id
        self.sample_rate_hz = _one_rate(ds.url, np.asarray(mi.meta["sample_rates"]))
        self.bucket, self.seed = cfg.bucket, seed
        self.data, self.datasets = Shards.of([ds], storage_options), [ds.url]
        self.too_long = int(self.blocks.rows[self.blocks.too_long].sum())
        self.filtered = 0

    def cost_of(self, rows: np.ndarray) -> np.ndarray:
        return cost_s(np.asarray(self.idx.duration_s[rows]), self.bucket)

    def epoch(self, epoch: int, world_size: int, chain: Chain = ()) -> BlocksEpoch:
        return blocks_epoch(self.blocks, self.cost_of, self.seed, epoch, world_size, self.bucket, chain,
                            index=self.idx)

    def selection(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        keep = ~self.blocks.too_long
        starts, counts = self.blocks.start[keep].astype(np.int64), self.blocks.rows[keep].astype(np.int64)
        rows = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(counts.sum())
        return np.zeros(len(rows), np.int16), rows


# ---------------------------------------------------------------------------------------------- choosing
def _one_rate(url: str, rates: np.ndarray) -> int:
    if len(rates) > 1:
        raise StreamError(f"{url} mixes sample rates {np.asarray(rates).tolist()}; repack with "
                          "`shardtrain pack --sample-rate`")
    return int(rates[0]) if len(rates) else 16000


def by_blocks(cfg: StreamConfig, rows: int, what: str) -> bool:
    """Whether to plan by blocks: stream.planner, or "auto" from block_plan_min_rows rows (logged). Refuses
    bucket fields the block planner would ignore, naming them."""
    blocks = cfg.planner == "blocks" or (cfg.planner == "auto" and rows >= cfg.block_plan_min_rows)
    if blocks:
        rowfilter.refuse_blocks(cfg, f"{what} plans by blocks (stream.planner={cfg.planner}, {rows} rows)")
    if blocks and cfg.planner == "auto":
        log.info("%s: %d rows >= stream.block_plan_min_rows=%d: planning by blocks (stream.planner=auto)", what,
                 rows, cfg.block_plan_min_rows)
        refuse_ignored_fields(cfg.bucket, f"{what} has {rows} rows, so stream.planner=auto plans by blocks")
    return blocks


def open_planner(url: str, cfg: StreamConfig, seed: int, storage_options: dict | None) -> Planner:
    """The planner of one dataset: rows, or blocks (see `by_blocks`)."""
    ds = open_dataset(url, storage_options, direct_http=cfg.s3_direct_http, budget_s=cfg.retry_budget_s)
    rows = sum(s.samples for s in ds.shards)
    kind = BlocksPlanner if by_blocks(cfg, rows, url) else RowsPlanner
    return kind(ds, cfg, seed, storage_options)
