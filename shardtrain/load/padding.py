"""Padding-aware cuts shared by every planner that buckets (rows: plan.py, blocks: blockplan.py, mixtures through
either): bucket edges that move every epoch, buckets as narrow as that allows, and a local deal where a chunk is
its bucket's only chunk.

Padding is lost where a batch mixes short and long utterances: a batch of B rows padded to its longest wastes
B x (longest - mean). Inside a bucket dealt uniformly every batch spans the whole bucket, so the loss is about
half the bucket's relative width; on the 4k espeak benchmark (23 fixed buckets of two batches) padding was 0.964,
two fifths of the loss in the three tail buckets (a bucket of two batches spans 35% of its duration at the short
end). Narrower buckets leave fewer rows to choose batch-mates from, so less variety (design invariant 9, measured
as the pair repeat rate across epochs against a uniform shuffle in `num_buckets` fixed equal-audio buckets).
Three measures, the first paying for the others:

- Moving edges (`bucket_phase`, `phased_ids`, `phased_edges`): the bucket grid shifts by a golden-ratio step of a
  bucket every epoch. Two rows d apart in a bucket of width w share a bucket next epoch with probability
  1 - d / w instead of 1: ~2/3 of the pair repeat rate of fixed buckets (PHASE_GAIN; 0.63x measured on the 4k
  benchmark), for a part-full bucket at the start (<= one batch per rank and epoch: fill 0.94 -> 0.92 there).
- Narrower buckets (`bucket_width`): as narrow as keeps the fixed buckets' variety with moving edges, ~2/3 as
  wide (20k rows over 8 ranks: padding 0.952 -> 0.970; 40k rows over 4 ranks: 0.970 -> 0.982; 200k rows of
  LibriSpeech-like lengths, one rank: 0.959 -> 0.973), whole batches per rank, at least two.
- Local deal (`local_deal`, `local_sigma`): where the whole width a bucket must have is more than variety needs
  (small corpora: the 4k benchmark wants 1.33 batches and gets 2), a chunk that is its whole bucket is sorted by
  duration rank plus uniform noise of sigma batches and cut into its batches at equal cost, so a batch spans
  ~1 + sigma batches' worth of lengths: 0.974 on the 4k benchmark at x1.02 of the fixed buckets' repeat rate
  (x1.8 of a uniform shuffle in its own, narrower buckets). Only where a chunk holds its whole bucket (one rank,
  a bucket of <= batches_per_chunk batches): elsewhere a chunk is runs from random places of its bucket and
  sorting would put run-mates (read together again next epoch with probability ~1/2) in one batch, so the
  run-aware uniform deal (`plan.deal_runs`) stays.

Cost: one random number per epoch for the phase; one argsort and cumsum per locally dealt chunk (O(rows log rows)
numpy, small corpora only). Plans stay a pure function of (seed, epoch, world size, config).
"""
from __future__ import annotations

import math

import numpy as np

PHASE_GAIN = 2 / 3
"""Pair repeat rate of buckets whose edges move every epoch, as a share of fixed buckets' of the same width:
two rows d apart in a bucket of width w share one again with probability 1 - d / w (2/3 on average)."""
LOCAL_WIDTH = 0.58
"""Width (in batches of a uniformly dealt bucket with moving edges) that the local deal with noise sigma is as
varied as, per 1 + sigma batches: measured 1.15 / (1 + sigma) against 2 / (3 k) on the 4k benchmark."""


def bucket_width(total_cost: float, budget: float, world_size: int, num_buckets: int, floor: int) -> tuple[int, float]:
    """(k, target): batches per rank a bucket holds, and the width (in such batches, maybe fractional) that keeps
    the variety of the reference, a uniform shuffle in `num_buckets` fixed equal-audio buckets, each dealt into
    ceil(its cost / budget) batches (what benchmarks/load/bench_shuffle.py and the tests compare with). A bucket of k
    batches per rank (k x world_size batches) repeats ~PHASE_GAIN / (k x world_size) of its pairs, the reference
    1 / ceil(total / (num_buckets x budget)): so target = PHASE_GAIN x that ceil / world_size, and k the whole
    number at or above it (at least `floor`). The local deal narrows a bucket of k to the target where it can.
    num_buckets=1 asks for no bucketing: one bucket, k = infinity (callers cap it at the epoch)."""
    if num_buckets <= 1:
        return 1 << 62, float(1 << 62)
    ref = max(1, math.ceil(total_cost / (num_buckets * budget) - 1e-9))
    target = PHASE_GAIN * ref / world_size
    return max(floor, math.ceil(target - 1e-9)), target


def local_sigma(k: int, target: float) -> float | None:
    """The local deal's noise (in batches) that makes a bucket of k batches as varied as `target` wide, or None
    where the uniform deal is as narrow (the noise would span the bucket: no padding to win)."""
    sigma = max(0.0, target / LOCAL_WIDTH - 1.0)
    return sigma if sigma < k - 0.5 else None


GOLDEN = (5 ** 0.5 - 1) / 2
"""Phase step from one epoch to the next (a fraction of a bucket)."""


def bucket_phase(seed: int, epoch: int) -> float:
    """Where this epoch's bucket grid starts, as a fraction of a bucket in [0, 1): a random start per seed, then
    GOLDEN further each epoch (mod 1). Why not a fresh draw per epoch: two epochs whose draws fell close together
    would cut nearly the same buckets (on the 4k benchmark one epoch pair in ~5 repeated x1.2 of the uniform rate);
    a golden-ratio step moves the edges 0.38 of a bucket between consecutive epochs, and the phases of any
    stretch of epochs spread evenly over the bucket. Its own random stream: the planners' others are unchanged."""
    start = float(np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 77]))).random())
    return (start + epoch * GOLDEN) % 1.0


def phased_ids(mid_cost: np.ndarray, step: float, phase: float) -> np.ndarray:
    """Bucket number of each row on a grid of `step` cost shifted by `phase` of a step (`mid_cost`: the running
    cost at the row's middle, so a row goes where most of it is). Non-decreasing where mid_cost is."""
    return np.floor(mid_cost / step + phase).astype(np.int64)


def phased_edges(values: np.ndarray, num_buckets: int, phase: float) -> np.ndarray:
    """Interior edges (values) of `num_buckets` equal-sum bins of `values` with the grid shifted by `phase` of a
    bin: phase 0 is plan.estimate_bins; otherwise the first bin holds (1 - phase) of one, and there is one more
    edge. Equal values never straddle an edge (edges are values, searchsorted with side="right")."""
    k = np.arange(1, num_buckets + 1) - phase
    k = k[(k > 0) & (k < num_buckets)]
    if len(values) == 0 or len(k) == 0:
        return np.zeros(0)
    d = np.sort(values)
    cum = np.cumsum(d)
    at = np.searchsorted(cum, cum[-1] * k / num_buckets, side="right")
    return np.unique(d[at[at < len(d)]])


def local_deal(rows: np.ndarray, duration_s: np.ndarray, costs: np.ndarray, m: int, rng: np.random.Generator,
               sigma: float) -> list[np.ndarray]:
    """Deal a chunk's rows into m batches that each span a narrow band of lengths: sort by duration rank (in
    batches: rank / rows x m) plus U(0, sigma) noise, cut where the running budget cost passes each multiple of
    1/m of the chunk's (a row goes where its middle is), batches in random order. Batch costs come out within one
    row of the mean; the caller checks the budget and `max_batch_size` (a batch of short rows holds more of
    them) and falls back to the uniform deal or one batch more. O(rows log rows) numpy."""
    n = len(rows)
    if m == 1 or n == 0:
        return [rows] + [rows[:0]] * (m - 1)
    rank = np.empty(n)
    rank[np.argsort(duration_s[rows], kind="stable")] = np.arange(n)
    seq = rows[np.argsort((rank + 0.5) * (m / n) + sigma * rng.random(n), kind="stable")]
    c = costs[seq]
    mid = np.cumsum(c) - 0.5 * c
    cuts = np.searchsorted(mid, float(c.sum()) * np.arange(1, m) / m, side="left")
    batches = np.split(seq, cuts)
    return [batches[i] for i in rng.permutation(m)]
