"""Planning at block granularity for very large corpora (issue 11.4): every rank plans the same small block
table, then loads and deals only its own rows. The Loader uses it above StreamConfig.block_plan_min_rows (with
the index memory-mapped once per node, load/mapped.py); benchmarks/load/bench_plan_scale.py --simulate runs it for
1k..100M rows and 1..1,024 ranks.

    index (duration-sorted) -> blocks: runs of neighbouring rows ending at `block_s` seconds or `block_rows`
         rows, whichever comes first (block_shape: 30 s / 4 rows while the table allows, ~790 s / ~170 rows at 100M
         rows); over-budget rows in blocks of their own; per block: first row, rows, cost, max cost, bytes (~30 B
         a block; made once per node by a streaming make_blocks and cached beside the memory map)
      -> plan_blocks (pure, identical on every rank; O(blocks), flat arrays, no object per chunk):
           buckets over blocks (equal audio, at least one batch per rank, as narrow as the variety of num_buckets
           fixed ones allows, edges at this epoch's phase: padding.py) -> per bucket n chunks (a multiple of
           world_size, <= batches_per_chunk batches each): blocks in random order cut into n runs of equal cost
           -> per chunk the batches it needs (cost / (budget - its longest), so any assignment of its rows fits)
           -> chunks of similar need grouped world_size at a time, ranks shuffled inside a group; M_g = the
           group's largest need -> group order shuffled
      -> rank r, one group at a time (group_batches): rows of its chunk only -> deal_chunk: plan.deal_runs
         (the rows of a block in distinct batches), or each row to the least-loaded batch when a batch would
         exceed the budget (list scheduling: mean + longest <= budget)

Properties, the same as plan_epoch's: exactly once (each block in one chunk), equal steps (M_g per group),
budget (list-scheduling bound), lock-step duration bands (a group is one bucket), batch composition new every
epoch (blocks re-dealt). Memory per rank: the block table plus its own ~1/world_size of the rows.
Elastic re-striping: wholly consumed groups leave the next plan by block (`exclude`), the one partly consumed
group by row (`exclude_rows`, at most world_size chunks of rows).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from shardtrain.load.padding import bucket_phase, bucket_width, local_deal, local_sigma, phased_edges
from shardtrain.load.plan import FILL_TARGET, BucketConfig, Chunk, cost_s, deal_runs, table_edges


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


MAX_BLOCKS = 1_200_000
"""Audio cuts a table holds at most (row cuts add up to half as many, where utterances are short): every rank
plans all blocks each epoch, ~650 B a block per 8-rank node (measured at 1.5M blocks, bench_block_loader.py)."""
MIN_BLOCK_S = 30.0
"""Smallest automatic block by audio."""


def block_shape(total_audio_s: float, rows: int, batches_per_chunk: int,
                given_s: float | None = None) -> tuple[float, int]:
    """(seconds, rows) a block holds at most: it ends at whichever limit comes first. The smallest the table
    allows: MIN_BLOCK_S and `batches_per_chunk` rows while the corpus is small (block-mates are then no more than
    a chunk's batches and plan.deal_runs never puts two in one batch: variety of a uniform in-bucket shuffle),
    up to ~790 s and ~170 rows at 100M rows of ~9.5 s. `given_s` overrides the seconds."""
    return (given_s if given_s else max(MIN_BLOCK_S, total_audio_s / MAX_BLOCKS),
            max(batches_per_chunk, math.ceil(2 * rows / MAX_BLOCKS)))


WINDOW_ROWS = 1 << 22
"""Rows make_blocks holds at a time (~100 MB of temporaries): the index may be a 100M-row memory map."""


def make_blocks(duration_s, size, block_s: float, budget: float,
                cost_fn: Callable[[np.ndarray], np.ndarray] | None = None, block_rows: int | None = None,
                cuts: np.ndarray | None = None) -> Blocks:
    """Blocks of about `block_s` seconds of duration-sorted rows (`duration_s` ascending; array or memory map),
    also cut every `block_rows` rows when given and before every duration in `cuts` (budget-table edges): equal
    audio, so a chunk of a few blocks is balanced whatever the durations; over-budget rows (cost_fn(d) > budget,
    anywhere: with a budget table cost is not monotone in length) get blocks of their own, 64 rows each. Streams
    the columns WINDOW_ROWS at a time: memory is O(blocks)."""
    cost_fn = cost_fn or (lambda d: d)
    n = len(duration_s)
    base, found = 0.0, [np.zeros(1, np.int64)]
    for a in range(0, n, WINDOW_ROWS):  # block starts where the running audio passes a multiple of block_s
        c = _window_cost(duration_s, cost_fn, a, min(n, a + WINDOW_ROWS))
        # over-budget rows need not be a suffix (a budget table's costs are not monotone in length): blocks
        # start at every change between kept and over-budget rows, and every 64 rows of an over-budget run
        over, pos = c > budget, np.arange(a, a + len(c))
        flip = np.concatenate([[True], over[1:] != over[:-1]])  # a window's start counts as one (harmless)
        run_start = np.maximum.accumulate(np.where(flip, pos, 0))
        long_marks = pos[over & ((pos - run_start) % 64 == 0)]
        cs = base + np.cumsum(np.where(over, 0.0, c))
        marks = np.arange(math.floor(base / block_s) + 1, math.ceil(cs[-1] / block_s)) * block_s
        found.extend([np.searchsorted(cs, marks, side="left") + a + 1, pos[flip], long_marks])
        base = float(cs[-1])
    by_rows = np.arange(0, n, block_rows) if block_rows else np.zeros(0, np.int64)
    at_cuts = np.zeros(0, np.int64) if cuts is None else np.searchsorted(duration_s, np.asarray(cuts), side="right")
    starts = np.unique(np.concatenate([*found, by_rows, at_cuts])).astype(np.int64)
    starts = starts[starts < n]
    ends = np.append(starts[1:], n)
    cost, max_cost, nbytes = np.zeros(len(starts)), np.zeros(len(starts), np.float32), np.zeros(len(starts), np.int64)
    b = 0
    while b < len(starts):  # per-block sums over windows that hold whole blocks (at least one)
        e = max(b + 1, int(np.searchsorted(ends, starts[b] + WINDOW_ROWS, side="right")))
        lo, hi = int(starts[b]), int(ends[e - 1])
        c, rel = _window_cost(duration_s, cost_fn, lo, hi), starts[b:e] - lo
        cost[b:e] = np.add.reduceat(c, rel)
        max_cost[b:e] = np.maximum.reduceat(c, rel)
        nbytes[b:e] = np.add.reduceat(np.asarray(size[lo:hi], np.int64), rel)
        b = e
    first_cost = np.zeros(len(starts))
    for w in range(0, len(starts), WINDOW_ROWS):  # a block is all kept or all over budget: its first row says
        first_cost[w:w + WINDOW_ROWS] = cost_fn(np.asarray(duration_s[starts[w:w + WINDOW_ROWS]], np.float64))
    return Blocks(start=starts, rows=(ends - starts).astype(np.int32), cost=cost, max_cost=max_cost, nbytes=nbytes,
                  too_long=first_cost > budget)


def _window_cost(duration_s, cost_fn: Callable[[np.ndarray], np.ndarray], lo: int, hi: int) -> np.ndarray:
    return cost_fn(np.asarray(duration_s[lo:hi], np.float64))


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """Flat arrays, no object per chunk: at 100M rows there are ~700k chunks, and every rank holds the plan."""

    epoch: int
    world_size: int
    seq: np.ndarray
    """Block ids, bucket after bucket, each bucket in this epoch's random order."""
    bounds: np.ndarray
    """Chunk c is seq[bounds[c]:bounds[c + 1]]."""
    chunk_ids: np.ndarray
    """Chunks in group order: group j is chunk_ids[j * world_size:(j + 1) * world_size] (rank r takes the r-th),
    chunks of one bucket with similar batch counts (sorted by need), ranks shuffled inside every group."""
    group_first: np.ndarray
    """Position in chunk_ids of each group's first chunk, in step order (groups shuffled)."""
    group_m: np.ndarray
    """Batches M_g of each group, in step order."""
    too_long_rows: int
    budget: float
    cap: int | None
    """max_batch_size (None: no cap)."""
    bucket: np.ndarray
    """Duration bucket of every block (-1: over budget); a group's chunks share one."""
    local: np.ndarray
    """Per group in step order: its chunk is its whole bucket (one rank), so it is dealt by padding.local_deal."""
    sigma: float
    """The local deal's noise (padding.local_sigma; unused where no group is local)."""

    @property
    def steps(self) -> int:
        return int(self.group_m.sum())

    def chunk(self, g: int, rank: int) -> np.ndarray:
        """Block ids of `rank`'s chunk in group g (step order), ascending."""
        c = int(self.chunk_ids[int(self.group_first[g]) + rank])
        return np.sort(self.seq[self.bounds[c]:self.bounds[c + 1]])

    @property
    def groups(self) -> list[tuple[int, list[np.ndarray]]]:
        """(M_g, every rank's block ids) per group: for tests and small plans (builds an array per chunk)."""
        return [(int(m), [self.chunk(g, r) for r in range(self.world_size)]) for g, m in enumerate(self.group_m)]


def table_cost_cuts(cfg: BucketConfig) -> np.ndarray:
    """The table's edges in `cost_s` units, for planners that bucket by cost (plan_blocks): per edge, the cost of
    the shortest utterance past it (its budget's scale), so buckets cut there hold one entry's lengths each when
    budgets shrink with length (growing budgets are safe in any batch: b(r) <= b(L))."""
    e = table_edges(cfg)[:-1]
    return cost_s(np.nextafter(e, np.inf), cfg) if len(e) else e


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 4242])))


def plan_blocks(blocks: Blocks, *, seed: int, epoch: int, world_size: int, cfg: BucketConfig,
                exclude: np.ndarray | None = None) -> BlockPlan:
    """Every rank's chunks as block ranges, and each group's batch count. Pure; O(blocks) numpy plus a Python
    loop over buckets only. `exclude` (bool per block) leaves out blocks consumed before an elastic re-stripe."""
    rng = _rng(seed, epoch)
    ok = np.flatnonzero(~blocks.too_long if exclude is None else ~blocks.too_long & ~exclude)
    if 0 < int(blocks.rows[ok].sum()) < world_size:
        if exclude is None:
            raise ValueError(f"{int(blocks.rows[ok].sum())} samples for {world_size} ranks: use fewer ranks")
        ok = ok[:0]  # an epoch's rest after a resume on more ranks: too few for equal steps (plan.plan_epoch)
    budget = cfg.max_batch_seconds
    mean = blocks.cost[ok] / np.maximum(blocks.rows[ok], 1)
    total = float(blocks.cost[ok].sum())
    fill = total / (world_size * budget)
    # at most num_buckets - 1 whole buckets (the phase cuts one more): narrower buckets of few blocks repeat
    # block-mates (fixed across epochs) more than moving edges part them (90 rows: 0.69 of pairs against 0.63)
    k, target = bucket_width(total, budget, world_size, cfg.num_buckets, 1)
    nb = max(1, min(cfg.num_buckets - 1, int(fill / k), len(ok) // world_size))  # >= a batch and a block per rank
    edges = _phased_block_edges(mean, nb, bucket_phase(seed, epoch) if nb > 1 else 0.0, world_size)
    if cfg.budget_table is not None:  # buckets end at the table's edges (blocks do too: make_blocks `cuts`)
        edges = np.union1d(edges, table_cost_cuts(cfg))
    bucket = np.searchsorted(edges, mean, side="right")
    sigma = local_sigma(max(k, int(fill / nb)), target)
    seqs, bounds_all, need_all, ids_all, local_all, base, nchunks = [], [np.zeros(1, np.int64)], [], [], [], 0, 0
    for b in np.unique(bucket):
        ids = ok[bucket == b]
        cost = float(blocks.cost[ids].sum())
        per_chunk = cfg.batches_per_chunk * budget * FILL_TARGET
        n = max(1, math.ceil(cost / per_chunk), math.ceil(float(blocks.nbytes[ids].sum()) / (cfg.chunk_mb * 1e6)))
        n = min(math.ceil(n / world_size) * world_size, max(world_size, (len(ids) // world_size) * world_size))
        seq = ids[rng.permutation(len(ids))]  # blocks in random order, cut into n runs of equal cost
        cum = np.cumsum(blocks.cost[seq])
        bounds = np.concatenate([[0], np.searchsorted(cum, cum[-1] * np.arange(1, n) / n, side="left"), [len(seq)]])
        c_cost = np.diff(np.concatenate([[0.0], cum])[bounds])
        need = _chunk_needs(blocks, seq, bounds, c_cost, budget, cfg.max_batch_size)
        # chunks of similar need share a group (M_g is the group's largest), ranks at random inside each group
        grouped = rng.permuted(np.lexsort((c_cost, need)).reshape(-1, world_size), axis=1)
        need_all.append(need[grouped].max(axis=1))
        local_all.append(np.full(len(grouped), n == 1 and sigma is not None))
        ids_all.append(nchunks + grouped.ravel())
        seqs.append(seq)
        bounds_all.append(base + bounds[1:])
        base, nchunks = base + len(seq), nchunks + n
    group_m = np.concatenate(need_all) if need_all else np.zeros(0, np.int64)
    order = rng.permutation(len(group_m))
    local = np.concatenate(local_all)[order] if local_all else np.zeros(0, bool)
    return BlockPlan(epoch=epoch, world_size=world_size, seq=np.concatenate(seqs) if seqs else np.zeros(0, np.int64),
                     bounds=np.concatenate(bounds_all),
                     chunk_ids=np.concatenate(ids_all) if ids_all else np.zeros(0, np.int64),
                     group_first=(order * world_size).astype(np.int64),
                     group_m=group_m[order], too_long_rows=int(blocks.rows[blocks.too_long].sum()), budget=budget,
                     cap=cfg.max_batch_size,
                     bucket=np.where(blocks.too_long, -1,
                                     np.searchsorted(edges, blocks.cost / np.maximum(blocks.rows, 1), side="right")),
                     local=local, sigma=0.0 if sigma is None else sigma)


def _chunk_needs(blocks: Blocks, seq: np.ndarray, bounds: np.ndarray, c_cost: np.ndarray, budget: float,
                 cap: int | None) -> np.ndarray:
    """Batches per chunk (chunk i = seq[bounds[i]:bounds[i+1]]): enough that any order of its rows fits the budget
    beside its costliest block's longest row, never more than one row per batch, at least `cap`-sized batches."""
    c_rows = np.diff(np.concatenate([[0], np.cumsum(blocks.rows[seq])])[bounds])
    nonempty = bounds[:-1] < bounds[1:]
    c_max = np.zeros(len(bounds) - 1)
    c_max[nonempty] = np.maximum.reduceat(blocks.max_cost[seq], bounds[:-1][nonempty])
    need = np.minimum(np.ceil(c_cost / np.maximum(budget - c_max, 1e-9) - 1e-9), c_rows)
    if cap is not None:
        need = np.maximum(need, np.ceil(c_rows / cap))
    return np.maximum(1, need).astype(np.int64)


def _phased_block_edges(mean: np.ndarray, nb: int, phase: float, world_size: int) -> np.ndarray:
    """Edges of nb equal bins of the blocks' mean costs, shifted by this epoch's phase (padding.phased_edges);
    an end piece with fewer blocks than ranks joins its neighbour (every rank needs a block of each bucket)."""
    edges = phased_edges(mean, nb, phase)
    if len(edges):
        counts = np.bincount(np.searchsorted(edges, mean, side="right"), minlength=len(edges) + 1)
        edges = edges[int(counts[0] < world_size):len(edges) - int(counts[-1] < world_size)]
    return edges


def chunk_rows(blocks: Blocks, ids: np.ndarray) -> np.ndarray:
    """Index rows of a chunk's blocks, ascending (what a rank loads and reads)."""
    if len(ids) == 0:
        return np.zeros(0, np.int64)
    starts, counts = blocks.start[ids], blocks.rows[ids].astype(np.int64)
    offs = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return offs + np.arange(int(counts.sum()))


def deal_chunk(rows: np.ndarray, cost: np.ndarray, m: int, budget: float, rng: np.random.Generator,
               cap: int | None = None, run_of: np.ndarray | None = None,
               sigma: float | None = None) -> list[np.ndarray]:
    """Rows (ascending, with their costs) dealt into m batches by plan.deal_runs: the rows of one block
    (`run_of`, else every m neighbouring rows) land in distinct batches, other pairs meet with probability ~1/m,
    sizes differ by at most one (so `cap`, max_batch_size, holds: the group's M_g is at least rows / cap). When a
    batch would exceed the budget, rows in random order each go to the least-loaded batch instead (list
    scheduling: every batch stays under mean + longest row, which the group's M_g keeps within the budget; a
    Python loop, so only as a fallback; it passes over full batches). `sigma`: the chunk is its whole bucket,
    dealt by padding.local_deal with that noise instead where the result keeps the budget and `cap`."""
    if m == 1:
        return [rows[rng.permutation(len(rows))]]
    if sigma is not None:  # the chunk is its whole bucket: narrow bands of lengths (ranked by cost)
        at = np.arange(len(rows))
        local = [rows[b] for b in local_deal(at, cost, cost, m, rng, sigma)]
        if max(float(cost[np.searchsorted(rows, b)].sum()) for b in local) <= budget + 1e-9 and \
                (cap is None or max(len(b) for b in local) <= cap):
            return local
    dealt = deal_runs(rows, np.arange(len(rows)) // m if run_of is None else run_of, m, rng)
    if max((float(cost[np.searchsorted(rows, b)].sum()) for b in dealt), default=0.0) <= budget + 1e-9:
        return dealt
    p = rng.permutation(len(rows))
    rows, cost = rows[p], cost[p]
    heap = [(0.0, i) for i in range(m)]
    out: list[list[int]] = [[] for _ in range(m)]
    for r, c in zip(rows.tolist(), cost.tolist()):
        load, i = heapq.heappop(heap)
        out[i].append(r)
        if cap is None or len(out[i]) < cap:
            heapq.heappush(heap, (load + c, i))
    return [np.asarray(o, np.int64) for o in out]


def group_batches(plan: BlockPlan, blocks: Blocks, cost_of: Callable[[np.ndarray], np.ndarray], g: int, rank: int,
                  seed: int, exclude_rows: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """(rows, batches) of `rank`'s chunk in group g (step order): its blocks' rows, less `exclude_rows` (sorted;
    rows consumed before an elastic re-stripe), dealt into the group's M_g batches. Pure and independent per group
    (its own random stream), so a resume deals only the groups it still needs. `cost_of(rows)` gives budget costs
    of index rows: a rank only ever loads its own."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, plan.epoch, 4243, rank, g])))
    ids = plan.chunk(g, rank)
    rows = chunk_rows(blocks, ids)
    run_of = np.repeat(np.arange(len(ids)), blocks.rows[ids])  # block-mates part (plan.deal_runs)
    if exclude_rows is not None and len(exclude_rows):
        keep = ~np.isin(rows, exclude_rows, assume_unique=True)
        rows, run_of = rows[keep], run_of[keep]
    return rows, deal_chunk(rows, cost_of(rows), int(plan.group_m[g]), plan.budget, rng, plan.cap, run_of,
                            plan.sigma if plan.local[g] else None)


def rank_batches(plan: BlockPlan, blocks: Blocks, cost_of, rank: int, seed: int) -> list[np.ndarray]:
    """Rank `rank`'s batches for the whole epoch (the simulator's view; the Loader deals group by group)."""
    return [b for g in range(len(plan.group_m)) for b in group_batches(plan, blocks, cost_of, g, rank, seed)[1]]


def consumed(plan: BlockPlan, blocks: Blocks, cost_of, steps: int, seed: int,
             exclude_rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """What the first `steps` steps of `plan` delivered on all ranks, for an elastic re-stripe: (bool per block:
    wholly consumed, sorted rows of the partly consumed group). Deals only the one partly consumed group."""
    done = np.zeros(len(blocks), bool)
    rows: list[np.ndarray] = []
    left = steps
    for g, m in enumerate(plan.group_m.tolist()):
        if left <= 0:
            break
        if left >= m:
            for r in range(plan.world_size):
                done[plan.chunk(g, r)] = True
        else:
            for r in range(plan.world_size):
                rows.extend(group_batches(plan, blocks, cost_of, g, r, seed, exclude_rows)[1][:left])
        left -= m
    part = np.sort(np.concatenate(rows)) if rows else np.zeros(0, np.int64)
    return done, part


def block_epoch(blocks: Blocks, cost_of, *, seed: int, epoch: int, world_size: int, cfg: BucketConfig,
                chain: list | tuple = ()) -> tuple[BlockPlan, np.ndarray]:
    """(plan, rows to leave out) for `epoch` after the steps of `chain` ([world size, steps] pairs: earlier
    segments of this epoch under other world sizes): each segment's wholly consumed groups leave by block, its
    partly consumed group by row. Re-deals one group per segment, so an elastic resume costs O(blocks)."""
    exclude: np.ndarray | None = None
    rows = np.zeros(0, np.int64)
    for ws, steps in chain:
        prev = plan_blocks(blocks, seed=seed, epoch=epoch, world_size=int(ws), cfg=cfg, exclude=exclude)
        done, part = consumed(prev, blocks, cost_of, int(steps), seed, rows)
        exclude = done if exclude is None else exclude | done
        rows = np.union1d(rows, part)
    return plan_blocks(blocks, seed=seed, epoch=epoch, world_size=world_size, cfg=cfg, exclude=exclude), rows


def chunks_from(plan: BlockPlan, blocks: Blocks, cost_of, rank: int, seed: int, exclude_rows: np.ndarray,
                step: int) -> Iterator[tuple[int, Chunk]]:
    """(first step, Chunk) of `rank`'s groups that end after `step`, dealt one at a time as the reader asks."""
    first = 0
    for g, m in enumerate(plan.group_m.tolist()):
        if first + m > step:
            rows, batches = group_batches(plan, blocks, cost_of, g, rank, seed, exclude_rows)
            yield first, Chunk(rows=rows, batches=tuple(batches))
        first += m
