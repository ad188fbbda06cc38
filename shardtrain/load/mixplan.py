"""The weighted mixture as a planner (load/planner.py): each epoch's selection, then rows or blocks planning.

    [(url, weight), ...] -> per dataset: its index (rows) or memory map + block table (blocks), over-budget
    rows left out (counted)
      rows   (below block_plan_min_rows rows together): mixture.select_epoch over rows -> gather_index (one
             PlanIndex of the epoch's virtual rows, shard ids global) -> planner.rows_epoch (plan_epoch)
      blocks (from block_plan_min_rows on): the same streams of passes over each dataset's BLOCKS (a pass: its
             blocks in random order; an epoch takes the next weight share of audio) -> one virtual block table
             (a block chosen twice is two virtual blocks) -> planner.blocks_epoch (plan_blocks, dealt one group
             at a time) -> per chunk a small gathered index of just its rows (localize)
      -> RankChunk.source/row: dataset and dataset row of every virtual row, carried with the chunk, so batches
         know their dataset (Batch.sources, counters["dataset_seconds"]) without a second plan

Memory per rank: rows mode, every dataset's index (~70 B a row) plus the gathered epoch (~70 B per selected
row, two epochs while the next is planned ahead); blocks mode, every dataset's block table (~30 B a block) and
the epoch's virtual block table, the rows themselves shared per node in the memory maps: a mixture of 100M-row
datasets costs a rank what one such dataset costs, per dataset. All datasets must share one sample rate, and
remote ones one set of storage options.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Sequence

import numpy as np

from shardtrain.format.arrownp import numpy_of
from shardtrain.format.manifest import open_dataset
from shardtrain.load.blockplan import Blocks
from shardtrain.load import rowfilter
from shardtrain.load.config import StreamConfig
from shardtrain.load.mixture import MixEpoch, _take, gather_index, select_epoch, targets_s
from shardtrain.load.plan import CHECK_COLUMNS, PLAN_COLUMNS, Chunk, PlanIndex, cost_s
from shardtrain.load.planner import (BlocksEpoch, Chain, Planner, RankChunk, RowsEpoch, Shards, blocks_epoch,
                                     by_blocks, index_drop_mask, open_blocks, open_planner, rows_epoch)
from shardtrain.load.errors import StreamError

log = logging.getLogger(__name__)


def parse_sources(sources: Sequence) -> list[tuple[str, float]]:
    """[url | (url, weight)] -> [(url, weight)]; weight 1 when left out."""
    out = []
    for s in sources:
        url, w = (s, 1.0) if isinstance(s, str) else (str(s[0]), float(s[1]))
        if not w > 0:
            raise ValueError(f"weight of {url} must be > 0, got {w}")
        out.append((url, w))
    if not out:
        raise ValueError("a mixture needs at least one dataset")
    return out


class MixturePlanner:
    """A weighted mixture of datasets, planned as one epoch: by rows, or by blocks above block_plan_min_rows."""

    def __init__(self, sources: Sequence, cfg: StreamConfig, seed: int, storage_options: dict | None,
                 epoch_hours: float | None = None):
        self.sources = parse_sources(sources)
        self.datasets = [u for u, _ in self.sources]
        self.weights = [w for _, w in self.sources]
        self.bucket, self.seed = cfg.bucket, seed
        self.epoch_s = None if epoch_hours is None else epoch_hours * 3600.0
        parts = [open_dataset(u, storage_options, direct_http=cfg.s3_direct_http, budget_s=cfg.retry_budget_s)
                 for u in self.datasets]
        self.data = Shards.of(parts, storage_options)
        self.content = hashlib.sha1(json.dumps([d.content_id for d in parts]).encode()).hexdigest()[:16]
        rows = sum(s.samples for d in parts for s in d.shards)
        self.name = "blocks" if by_blocks(cfg, rows, f"the mixture {self.datasets}") else "rows"
        self._lock = threading.Lock()
        self._cache: dict[int, tuple] = {}
        if self.name == "blocks":
            opened = [open_blocks(d, cfg) for d in parts]
            self.indexes = [mi.idx for mi, _ in opened]
            self.blocks = [b for _, b in opened]
            prints = [mi.meta["fingerprint"] for mi, _ in opened]
            rates = {r for mi, _ in opened for r in mi.meta["sample_rates"]}
            over = [int(b.rows[b.too_long].sum()) for b in self.blocks]
            self.eligible = [np.flatnonzero(~b.too_long) for b in self.blocks]
            self.block_s = [_block_seconds(ix, b) for ix, b in zip(self.indexes, self.blocks)]
            filtered = [0] * len(parts)
        else:
            checks = [c for c in CHECK_COLUMNS if cfg.check_transcripts or c != "text"]
            tables = [d.read_index(columns=list(PLAN_COLUMNS) + ["sample_rate_hz", *checks]) for d in parts]
            rates = {r for t in tables for r in np.unique(numpy_of(t.column("sample_rate_hz"))).tolist()}
            self.indexes = [PlanIndex.from_table(t) for t in tables]
            prints = [ix.fingerprint() for ix in self.indexes]
            masks = [index_drop_mask(d, cfg, ix.duration_s) for d, ix in zip(parts, self.indexes)]
            drops = [np.zeros(len(ix), bool) if m is None else m for m, ix in zip(masks, self.indexes)]
            mask = [cost_s(ix.duration_s, cfg.bucket) > cfg.bucket.max_batch_seconds for ix in self.indexes]
            over = [int((m & ~dr).sum()) for m, dr in zip(mask, drops)]
            filtered = [int(dr.sum()) for dr in drops]
            self.eligible = [np.flatnonzero(~m & ~dr) for m, dr in zip(mask, drops)]
            for d, n, ix in zip(self.datasets, filtered, self.indexes):
                rowfilter.log_filtered(d, cfg, n, len(ix))
        if len(rates) > 1:
            raise StreamError(f"the mixture {self.datasets} mixes sample rates {sorted(rates)}; "
                              "repack with one `shardtrain pack --sample-rate`")
        self.sample_rate_hz = int(rates.pop()) if rates else 16000
        for url, n in zip(self.datasets, over):
            if n:
                log.warning("%s: %d utterances are longer than max_batch_seconds=%g and are left out of every epoch",
                            url, n, cfg.bucket.max_batch_seconds)
        self.too_long, self.filtered = sum(over), sum(filtered)
        self.rows_total = rows
        h = hashlib.sha1(json.dumps([[p, w] for p, w in zip(prints, self.weights)] + [epoch_hours]).encode())
        self.fingerprint = "mix-" + h.hexdigest()[:16]

    def _cached(self, epoch: int, make):
        """One selection per epoch, the last two kept (the Loader plans the next epoch while this one is read)."""
        with self._lock:
            if epoch not in self._cache:
                self._cache = {k: v for k, v in self._cache.items() if abs(k - epoch) <= 1}
                self._cache[epoch] = make(epoch)
            return self._cache[epoch]

    def epoch(self, epoch: int, world_size: int, chain: Chain = ()) -> RowsEpoch | BlocksEpoch:
        if self.name == "rows":
            idx, mix = self._cached(epoch, self._select_rows)
            return rows_epoch(idx, self.seed, epoch, world_size, self.bucket, chain, mix.source, mix.row)
        vb = self._cached(epoch, self._select_blocks)
        return blocks_epoch(vb.blocks, vb.cost_of, self.seed, epoch, world_size, self.bucket, chain,
                            localize=vb.localize)

    def selection(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset number int16, dataset row int64) of every row `epoch` holds, a repeated row once per time:
        what an epoch should train (before the equal-steps tail), for `shardtrain plan` and the ledger."""
        if self.name == "rows":
            mix = self._cached(epoch, self._select_rows)[1]
            return mix.source.astype(np.int16), mix.row.astype(np.int64)
        vb = self._cached(epoch, self._select_blocks)
        return vb.origin(np.arange(int(vb.blocks.rows.sum()), dtype=np.int64))

    # -- rows
    def _select_rows(self, epoch: int) -> tuple[PlanIndex, MixEpoch]:
        durs = [ix.duration_s[e] for ix, e in zip(self.indexes, self.eligible)]
        mix = select_epoch(durs, self.weights, seed=self.seed, epoch=epoch, epoch_s=self.epoch_s)
        rows = np.empty(len(mix.row), np.int64)
        for i, e in enumerate(self.eligible):  # back from eligible positions to index rows
            m = mix.source == i
            rows[m] = e[mix.row[m]]
        mix = MixEpoch(epoch=epoch, source=mix.source, row=rows, seconds=mix.seconds)
        return gather_index(self.indexes, mix, self.data.base), mix

    # -- blocks
    def _select_blocks(self, epoch: int) -> "_VirtualBlocks":
        hours = np.array([float(s[e].sum()) for s, e in zip(self.block_s, self.eligible)])
        empty = [u for u, h in zip(self.datasets, hours) if h <= 0]
        if empty:
            raise ValueError(f"mixture datasets {empty} hold no audio within the batch budget")
        t = targets_s(hours, np.asarray(self.weights), self.epoch_s)
        picks = [e[_take(s[e], self.seed, i, epoch * t[i], (epoch + 1) * t[i])]
                 for i, (s, e) in enumerate(zip(self.block_s, self.eligible))]
        return _VirtualBlocks(self, picks)


def _block_seconds(idx: PlanIndex, blocks: Blocks) -> np.ndarray:
    """Audio seconds per block (the mixture's shares are audio, not budget cost); one pass over the column."""
    if not len(blocks):
        return np.zeros(0)
    return np.add.reduceat(np.asarray(idx.duration_s, np.float64), blocks.start)


class _VirtualBlocks:
    """An epoch's chosen blocks of every dataset as one block table over virtual rows (a block chosen twice is two
    virtual blocks with distinct rows), with the map back to (dataset, row) and per-chunk gathered indexes."""

    def __init__(self, mp: MixturePlanner, picks: list[np.ndarray]):
        self.mp = mp
        self.src = np.concatenate([np.full(len(p), i, np.int16) for i, p in enumerate(picks)])
        self.dstart = np.concatenate([mp.blocks[i].start[p] for i, p in enumerate(picks)]).astype(np.int64)
        cat = lambda f: np.concatenate([getattr(mp.blocks[i], f)[p] for i, p in enumerate(picks)])  # noqa: E731
        rows = cat("rows")
        self.vstart = np.concatenate([[0], np.cumsum(rows.astype(np.int64))[:-1]]).astype(np.int64)
        self.blocks = Blocks(start=self.vstart, rows=rows, cost=cat("cost"), max_cost=cat("max_cost"),
                             nbytes=cat("nbytes"), too_long=np.zeros(len(rows), bool))

    def origin(self, vrows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset number, dataset row) of virtual rows."""
        vb = np.searchsorted(self.vstart, vrows, side="right") - 1
        return self.src[vb], self.dstart[vb] + (vrows - self.vstart[vb])

    def cost_of(self, vrows: np.ndarray) -> np.ndarray:
        src, row = self.origin(np.asarray(vrows, np.int64))
        dur = np.empty(len(row))
        for i, ix in enumerate(self.mp.indexes):
            m = src == i
            dur[m] = ix.duration_s[row[m]]
        return cost_s(dur, self.mp.bucket)

    def localize(self, first: int, chunk: Chunk) -> RankChunk:
        """The chunk over a small index of its own rows, in (dataset, row) order: byte order inside each
        dataset's shards, so reads stay sequential."""
        src, row = self.origin(chunk.rows)
        order = np.lexsort((row, src))
        local = np.empty(len(order), np.int64)
        local[order] = np.arange(len(order))
        mix = MixEpoch(epoch=0, source=src[order], row=row[order], seconds=np.zeros(0))
        idx = _gather_small(self.mp.indexes, mix, self.mp.data.base)
        pos = lambda b: local[np.searchsorted(chunk.rows, b)]  # noqa: E731
        return RankChunk(first, Chunk(rows=np.arange(len(order)), batches=tuple(pos(b) for b in chunk.batches)),
                         idx, mix.source, mix.row)


def _gather_small(indexes: list[PlanIndex], mix: MixEpoch, base: np.ndarray) -> PlanIndex:
    """gather_index for a few rows of memory-mapped indexes: string columns as Python lists."""
    strings = {}
    for col in ("key", "text"):
        if all(getattr(ix, col) is not None for ix in indexes):
            strings[col] = [indexes[s].string_at(col, int(r)) for s, r in zip(mix.source.tolist(), mix.row.tolist())]
    bare = [PlanIndex(**{**{f: getattr(ix, f) for f in PLAN_COLUMNS}, "key": None, "text": None}) for ix in indexes]
    idx = gather_index(bare, mix, base)
    return PlanIndex(**{**{f: getattr(idx, f) for f in PLAN_COLUMNS}, "key": strings.get("key"),
                        "text": strings.get("text")})


def make_planner(url: str | list | tuple, *, seed: int, cfg: StreamConfig, storage_options: dict | None = None,
                 epoch_hours: float | None = None) -> Planner:
    """The planner of one dataset URL, or of a list of datasets (each a URL or (URL, weight)): a weighted mixture
    (MixturePlanner). Metadata only: what `build_loader`, `shardtrain plan` and the ledger all plan with. Lives
    here, beside the mixture, so planner.py never imports mixplan.py (no import circle)."""
    if isinstance(url, (list, tuple)):
        return MixturePlanner(url, cfg, seed, storage_options, epoch_hours)
    return open_planner(url, cfg, seed, storage_options)
