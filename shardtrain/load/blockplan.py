"""Planning at block granularity for very large corpora (issue 11.4): every rank plans the same small block
table, then loads and deals only its own rows. Not wired into the Loader yet; benchmarks/bench_plan_scale.py
--simulate runs it for 1k..100M rows and 1..1,024 ranks.

    index (duration-sorted) -> blocks: runs of ~`block_s` seconds of audio (a block never mixes over-budget rows
         with others); per block: first row, rows, cost, max cost, bytes       (~30 B per block; 100M rows = ~100 MB
         at 600 s blocks; computed once per dataset, e.g. at pack time)
      -> plan_blocks (pure, identical on every rank; O(blocks), flat arrays, no object per chunk):
           buckets over blocks (equal audio, at least one batch per rank) -> per bucket n chunks (a multiple of
           world_size, <= batches_per_chunk batches each) -> blocks in random order, each to the lightest chunk
           -> groups of world_size chunks; M_g = the most batches any member needs (cost / (budget - its longest),
           so any assignment of its rows fits) -> group order shuffled
      -> rank r: rows of its chunks only (rank_batches) -> deal_chunk: random order, round-robin, or each row to
         the least-loaded batch when that would exceed the budget (list scheduling: mean + longest <= budget)

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


def make_blocks(cost: np.ndarray, size: np.ndarray, block_s: float, budget: float) -> Blocks:
    """Blocks of about `block_s` seconds of duration-sorted rows (`cost` ascending): equal audio, so a chunk of a
    few blocks is balanced whatever the durations; over-budget rows get blocks of their own. O(rows), numpy."""
    n = len(cost)
    cut = int(np.searchsorted(cost, budget, side="right"))  # rows [cut, n) are too long
    cs = np.concatenate([[0.0], np.cumsum(cost)])
    inner = (np.searchsorted(cs[1:cut + 1], np.arange(block_s, cs[cut], block_s), side="left") + 1 if cut
             else np.zeros(0, np.int64))
    starts = np.unique(np.concatenate([[0], inner, np.arange(cut, n, 64)])).astype(np.int64)
    starts = starts[starts < n]
    ends = np.append(starts[1:], n)
    bs = np.concatenate([[0], np.cumsum(size)])
    mx = np.maximum.reduceat(cost, starts) if n else np.zeros(0)
    return Blocks(start=starts, rows=(ends - starts).astype(np.int32), cost=cs[ends] - cs[starts],
                  max_cost=mx.astype(np.float32), nbytes=(bs[ends] - bs[starts]).astype(np.int64),
                  too_long=starts >= cut)


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """Flat arrays, no object per chunk: at 100M rows there are ~700k chunks, and every rank holds the plan."""

    epoch: int
    world_size: int
    seq: np.ndarray
    """Block ids, bucket after bucket, each bucket in this epoch's random order."""
    bounds: np.ndarray
    """Chunk c is seq[bounds[c]:bounds[c + 1]]; a group is world_size consecutive chunks of one bucket."""
    group_first: np.ndarray
    """First chunk of each group, in step order (groups shuffled)."""
    group_m: np.ndarray
    """Batches M_g of each group, in step order."""
    too_long_rows: int
    budget: float
    bucket: np.ndarray
    """Duration bucket of every block (-1: over budget); a group's chunks share one."""

    @property
    def steps(self) -> int:
        return int(self.group_m.sum())

    def chunk(self, g: int, rank: int) -> np.ndarray:
        """Block ids of `rank`'s chunk in group g (step order), ascending."""
        c = int(self.group_first[g]) + rank
        return np.sort(self.seq[self.bounds[c]:self.bounds[c + 1]])

    @property
    def groups(self) -> list[tuple[int, list[np.ndarray]]]:
        """(M_g, every rank's block ids) per group: for tests and small plans (builds an array per chunk)."""
        return [(int(m), [self.chunk(g, r) for r in range(self.world_size)]) for g, m in enumerate(self.group_m)]


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 4242])))


def plan_blocks(blocks: Blocks, *, seed: int, epoch: int, world_size: int, cfg: BucketConfig) -> BlockPlan:
    """Every rank's chunks as block ranges, and each group's batch count. Pure; O(blocks) numpy plus a Python
    loop over buckets only."""
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
    seqs, bounds_all, need_all, base = [], [np.zeros(1, np.int64)], [], 0
    for b in np.unique(bucket):
        ids = ok[bucket == b]
        cost = float(blocks.cost[ids].sum())
        per_chunk = cfg.batches_per_chunk * budget * FILL_TARGET
        n = max(1, math.ceil(cost / per_chunk), math.ceil(float(blocks.nbytes[ids].sum()) / (cfg.chunk_mb * 1e6)))
        n = min(math.ceil(n / world_size) * world_size, max(world_size, (len(ids) // world_size) * world_size))
        seq = ids[rng.permutation(len(ids))]  # blocks in random order, cut into n runs of equal cost
        cum = np.cumsum(blocks.cost[seq])
        bounds = np.concatenate([[0], np.searchsorted(cum, cum[-1] * np.arange(1, n) / n, side="left"), [len(seq)]])
        # per chunk: enough batches that any order of its rows fits, never more than one row per batch
        c_cost = np.diff(np.concatenate([[0.0], cum])[bounds])
        c_rows = np.diff(np.concatenate([[0], np.cumsum(blocks.rows[seq])])[bounds])
        nonempty = bounds[:-1] < bounds[1:]
        c_max = np.zeros(n)
        c_max[nonempty] = np.maximum.reduceat(blocks.max_cost[seq], bounds[:-1][nonempty])
        need = np.ceil(c_cost / np.maximum(budget - c_max, 1e-9) - 1e-9)
        need_all.append(np.maximum(1, np.minimum(need, c_rows)).astype(np.int64).reshape(-1, world_size).max(axis=1))
        seqs.append(seq)
        bounds_all.append(base + bounds[1:])
        base += len(seq)
    group_m = np.concatenate(need_all) if need_all else np.zeros(0, np.int64)
    order = rng.permutation(len(group_m))
    return BlockPlan(epoch=epoch, world_size=world_size, seq=np.concatenate(seqs) if seqs else np.zeros(0, np.int64),
                     bounds=np.concatenate(bounds_all), group_first=(order * world_size).astype(np.int64),
                     group_m=group_m[order], too_long_rows=int(blocks.rows[blocks.too_long].sum()), budget=budget,
                     bucket=np.where(blocks.too_long, -1,
                                     np.searchsorted(edges, blocks.cost / np.maximum(blocks.rows, 1), side="right")))


def chunk_rows(blocks: Blocks, ids: np.ndarray) -> np.ndarray:
    """Index rows of a chunk's blocks, ascending (what a rank loads and reads)."""
    if len(ids) == 0:
        return np.zeros(0, np.int64)
    starts, counts = blocks.start[ids], blocks.rows[ids].astype(np.int64)
    offs = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return offs + np.arange(int(counts.sum()))


def deal_chunk(rows: np.ndarray, cost: np.ndarray, m: int, budget: float,
               rng: np.random.Generator) -> list[np.ndarray]:
    """Rows (with their costs) in random order dealt round-robin into m batches; when one would exceed the budget,
    each row goes to the least-loaded batch instead (list scheduling: every batch stays under mean + longest row,
    which the group's M_g keeps within the budget; a Python loop, so only as a fallback)."""
    p = rng.permutation(len(rows))
    rows, cost = rows[p], cost[p]
    if m == 1:
        return [rows]
    if np.bincount(np.arange(len(rows)) % m, weights=cost, minlength=m).max() <= budget + 1e-9:
        return [rows[i::m] for i in range(m)]
    heap = [(0.0, i) for i in range(m)]
    out: list[list[int]] = [[] for _ in range(m)]
    for r, c in zip(rows.tolist(), cost.tolist()):
        load, i = heapq.heappop(heap)
        out[i].append(r)
        heapq.heappush(heap, (load + c, i))
    return [np.asarray(o, np.int64) for o in out]


def rank_batches(plan: BlockPlan, blocks: Blocks, cost_of, rank: int, seed: int) -> list[np.ndarray]:
    """Rank `rank`'s batches for the epoch; `cost_of(rows)` gives budget costs of index rows (only this rank's
    rows are ever asked for: that is all a rank loads)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, plan.epoch, 4243, rank])))
    out: list[np.ndarray] = []
    for g, m in enumerate(plan.group_m.tolist()):
        rows = chunk_rows(blocks, plan.chunk(g, rank))
        out.extend(deal_chunk(rows, cost_of(rows), m, plan.budget, rng))
    return out
