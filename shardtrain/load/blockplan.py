"""Planning at block granularity for very large corpora (issue 11.4): every rank plans the same small block
table, then loads and deals only its own rows. Not wired into the Loader yet; benchmarks/bench_plan_scale.py
--simulate runs it for 1k..100M rows and 1..1,024 ranks.

    index (duration-sorted) -> blocks: runs of `block_rows` rows (a block never mixes over-budget rows with
         others); per block: first row, rows, cost, max cost, bytes       (~40 B per block; 100M rows / 256 = 6 MB)
      -> plan_blocks (pure, identical on every rank; O(blocks)):
           buckets over blocks (equal audio, at least one batch per rank) -> per bucket n chunks (a multiple of
           world_size, <= batches_per_chunk batches each) -> blocks in random order, each to the lightest chunk
           -> groups of world_size chunks; M_g = the most batches any member needs (cost / (budget - its longest),
           so any assignment of its rows fits) -> group order shuffled
      -> rank r: rows of its chunks only (rank_rows) -> deal_chunk: random order, each row to the least-loaded
         batch (list scheduling: a batch never exceeds mean + longest <= budget)

Properties, the same as plan_epoch's: exactly once (each block in one chunk), equal steps (M_g per group),
budget (list-scheduling bound), lock-step duration bands (a group is one bucket), batch composition new every
epoch (blocks re-dealt). Memory per rank: the block table plus its own ~1/world_size of the rows.
Left out for now: elastic re-striping at block granularity (a partly consumed block) and max_batch_size.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from shardtrain.load.plan import FILL_TARGET, BucketConfig, estimate_bins


@dataclass(frozen=True, slots=True)
class Blocks:
    start: np.ndarray  # int64, first row of the block in the duration-sorted index
    rows: np.ndarray   # int32
    cost: np.ndarray   # float64, summed budget cost
    max_cost: np.ndarray  # float32
    nbytes: np.ndarray  # int64
    too_long: np.ndarray  # bool: every row alone exceeds the budget (left out, counted)

    def __len__(self) -> int:
        return len(self.start)


def make_blocks(cost: np.ndarray, size: np.ndarray, block_rows: int, budget: float) -> Blocks:
    """Blocks of duration-sorted rows (`cost` ascending); over-budget rows get blocks of their own."""
    n = len(cost)
    cut = int(np.searchsorted(cost, budget, side="right"))  # rows [cut, n) are too long
    starts = np.concatenate([np.arange(0, cut, block_rows), np.arange(cut, n, block_rows)]).astype(np.int64)
    ends = np.append(starts[1:], n)
    ends = np.where((starts < cut) & (ends > cut), cut, ends)
    cs = np.concatenate([[0.0], np.cumsum(cost)])
    bs = np.concatenate([[0], np.cumsum(size)])
    mx = np.maximum.reduceat(cost, starts) if n else np.zeros(0)
    return Blocks(start=starts, rows=(ends - starts).astype(np.int32), cost=cs[ends] - cs[starts],
                  max_cost=mx.astype(np.float32), nbytes=(bs[ends] - bs[starts]).astype(np.int64),
                  too_long=starts >= cut)


@dataclass(frozen=True, slots=True)
class BlockPlan:
    epoch: int
    world_size: int
    groups: list[tuple[int, list[np.ndarray]]]
    """(batches M_g, [block ids of rank r's chunk for r in ranks]) per group, in step order."""
    too_long_rows: int

    @property
    def steps(self) -> int:
        return sum(m for m, _ in self.groups)


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 4242])))


def _assign(ids: np.ndarray, cost: np.ndarray, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Blocks in random order, each to the chunk with the least cost so far (chunks within one block's cost)."""
    heap = [(0.0, c) for c in range(n)]
    out: list[list[int]] = [[] for _ in range(n)]
    for b in ids[rng.permutation(len(ids))].tolist():
        load, c = heapq.heappop(heap)
        out[c].append(b)
        heapq.heappush(heap, (load + float(cost[b]), c))
    return [np.sort(np.asarray(o, np.int64)) for o in out]


def plan_blocks(blocks: Blocks, *, seed: int, epoch: int, world_size: int, cfg: BucketConfig) -> BlockPlan:
    """Every rank's chunks as block lists, and each group's batch count. Pure and O(blocks)."""
    rng = _rng(seed, epoch)
    ok = np.flatnonzero(~blocks.too_long)
    if 0 < int(blocks.rows[ok].sum()) < world_size:
        raise ValueError(f"{int(blocks.rows[ok].sum())} samples for {world_size} ranks: use fewer ranks")
    budget = cfg.max_batch_seconds
    mean = blocks.cost[ok] / np.maximum(blocks.rows[ok], 1)
    fill = float(blocks.cost[ok].sum()) / (world_size * budget)
    nb = max(1, min(cfg.num_buckets, int(fill), len(ok) // world_size))  # a bucket: >= a batch and a block per rank
    edges = estimate_bins(mean, nb) if len(ok) else np.zeros(0)
    bucket = np.searchsorted(edges, mean, side="right")
    groups: list[tuple[int, list[np.ndarray]]] = []
    for b in np.unique(bucket):
        ids = ok[bucket == b]
        cost = float(blocks.cost[ids].sum())
        per_chunk = cfg.batches_per_chunk * budget * FILL_TARGET
        n = max(1, math.ceil(cost / per_chunk), math.ceil(float(blocks.nbytes[ids].sum()) / (cfg.chunk_mb * 1e6)))
        n = min(math.ceil(n / world_size) * world_size, max(world_size, (len(ids) // world_size) * world_size))
        chunks = _assign(ids, blocks.cost, n, rng)
        for g0 in range(0, n, world_size):
            members = chunks[g0:g0 + world_size]
            m = 1
            for c in members:  # enough batches that any order fits; never more than one row per batch
                if len(c):
                    room = budget - float(blocks.max_cost[c].max())
                    need = math.ceil(float(blocks.cost[c].sum()) / max(room, 1e-9) - 1e-9)
                    m = max(m, min(need, int(blocks.rows[c].sum())))
            groups.append((m, members))
    order = rng.permutation(len(groups))
    return BlockPlan(epoch=epoch, world_size=world_size, groups=[groups[i] for i in order],
                     too_long_rows=int(blocks.rows[blocks.too_long].sum()))


def chunk_rows(blocks: Blocks, ids: np.ndarray) -> np.ndarray:
    """Index rows of a chunk's blocks, ascending (what a rank loads and reads)."""
    if len(ids) == 0:
        return np.zeros(0, np.int64)
    starts, counts = blocks.start[ids], blocks.rows[ids].astype(np.int64)
    offs = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return offs + np.arange(int(counts.sum()))


def deal_chunk(rows: np.ndarray, cost: np.ndarray, m: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Rows (with their costs) in random order, each to the least-loaded of m batches: every batch stays under
    mean + longest row, which the group's M_g keeps within the budget. O(rows log m), a Python loop."""
    p = rng.permutation(len(rows))
    if m == 1:
        return [rows[p]]
    heap = [(0.0, i) for i in range(m)]
    out: list[list[int]] = [[] for _ in range(m)]
    for r, c in zip(rows[p].tolist(), cost[p].tolist()):
        load, i = heapq.heappop(heap)
        out[i].append(r)
        heapq.heappush(heap, (load + c, i))
    return [np.asarray(o, np.int64) for o in out]


def rank_batches(plan: BlockPlan, blocks: Blocks, cost_of, rank: int, seed: int) -> list[np.ndarray]:
    """Rank `rank`'s batches for the epoch; `cost_of(rows)` gives budget costs of index rows (only this rank's
    rows are ever asked for: that is all a rank loads)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, plan.epoch, 4243, rank])))
    out: list[np.ndarray] = []
    for m, members in plan.groups:
        rows = chunk_rows(blocks, members[rank])
        out.extend(deal_chunk(rows, cost_of(rows), m, rng))
    return out
