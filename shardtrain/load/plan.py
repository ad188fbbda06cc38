"""Epoch planning: a pure function from index metadata to every rank's batches. Never opens audio.

    index.parquet (shard, offset, size, audio_offset, audio_size, duration_s; rows sorted by duration)
      -> duration buckets of whole batches: edges where the running cost passes each multiple of k batches per
         rank at UNIT_FILL of the budget, the grid shifted by this epoch's phase (padding.py), k >= 2 and as
         narrow as keeps the variety of `num_buckets` fixed buckets (run_mb=0: equal-audio bins; or `bins_s`;
         both fixed)                                                                  -> contiguous row ranges
      -> chunks: each bucket cut into a multiple of `world_size` pieces in proportion to the whole batches each
         holds (`_chunk_shares`; run_mb=0: equal audio)                               -> [Chunk(rows)]
         (`batches_per_chunk` batches each; a chunk is k runs of ~`run_mb` from random places of its bucket,
         cut at a random phase every epoch, so batch composition changes per epoch; shorter runs, down to
         `min_run_mb`, where a bucket is large against its chunks; run_mb=0: one run)
      -> groups: `world_size` neighbouring chunks of one bucket; group order shuffled per epoch
      -> batches: every chunk of a group is dealt into the same number M_g of batches under the budget,
         the rows of a run into distinct batches (`deal_runs`; a chunk that is its whole bucket: in narrow
         bands of lengths, `padding.local_deal`), then single-row swaps even out seconds where a batch would
         overflow (`_balance`) before M_g grows                                       -> Chunk.batches

Full batches (issue 20): equal-audio buckets hold fractional batches per rank (1.48 on the 4k benchmark), which
deal into part-full ones (0.72 mean fill there, 0.51 over 2 ranks); buckets of whole batches, chunks cut in
proportion and the balancing swaps give 0.94 there (0.90-0.95 on 20k-40k synthetic rows), with the pair repeat
rate of a uniform shuffle in 30 equal-audio buckets (x1.0) and padding ~0.964 (0.972 before: the buckets are a
little wider where k = 2). Padding (issue 20, padding.py): bucket edges that move every epoch part neighbours, so
buckets can be narrower for the same variety, and a chunk that is its whole bucket is dealt in narrow bands of
lengths: 0.974 on the 4k benchmark and 0.976 on the 6k one (fill 0.92 / 0.94, x1.02 / x0.82 of that repeat
rate), 0.970 on 20k synthetic rows over 8 ranks (0.952 before).

Why this shape:
- Lock-step and equal steps by construction: at step k every rank is inside the same group, so draws from the
  same duration band, and every rank has sum(M_g) batches. Nothing is dropped to equalise; a chunk that holds
  fewer samples than M_g yields a short (rarely empty) batch instead (the loader counts an empty one as
  `empty_by_plan` and says so, never as a decode failure).
- Terminates by construction: every bucket holds >= world_size rows (`_at_least`, across budget-table edges if
  need be, then costed by `span_costs` so the budget stays exact), so a bucket cuts into non-empty chunks with
  one move per empty cut; a group's batch count grows at most to its largest chunk's row count, where one row a
  batch fits (tests/load/test_plan_terminates.py: random tables, world sizes 1-64, buckets of 0-3 rows).
- Exactly once: every non-excluded row lands in exactly one chunk and one batch. The only rows left out are
  those that alone exceed the batch budget (counted as `too_long`) or, when the corpus has fewer samples than
  ranks, all of them (refused with an error instead).
- Locality: a chunk is a few contiguous runs of the duration-sorted index (0.25-1 MB each), so a reader fetches
  it with a few large sequential reads; shuffling inside one duration bucket keeps padding small.
- Variety (design invariant 9): the pairs sharing a batch again next epoch are about as few as with a uniform
  shuffle in the same buckets (about B / N for batches of B in a bucket of N rows). The one thing that could
  add to that is run-mates: rows of one run are read together again next epoch with probability ~1/2 (two rows
  d apart: 1 - d / L), so dealt at random they would meet again ~N x L / (2 C^2) times the uniform rate more
  (runs of L rows, chunks of C rows; x2.4 at 200k rows and x7.8 at 1M with 1 MB runs). Hence two measures: the
  deal puts the rows of a run (of a sub-run of <= m rows, m = batches of the chunk) into distinct batches, which
  removes the excess when L <= m; and where N x L / (2 C^2) would exceed VARIETY_SLACK, runs shrink towards m
  rows (not below `min_run_mb`). Measured: x1.0 of the uniform rate from 4k to 1M rows, reads ~0.65 MB instead
  of 1 MB at the large sizes (benchmarks/load/bench_shuffle.py).
- Reader independence: a rank's batch sequence is fixed before any chunk is read; reads run ahead in threads
  and are handed over in plan order.

Cost: O(N) numpy work plus a Python loop over chunks (~N / 500); 1M rows plan in about a second.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.random  # noqa: F401 - numpy 2 imports it lazily on first use, inside the first plan

from shardtrain.format.arrownp import numpy_of
from shardtrain.load.padding import bucket_phase, bucket_width, local_deal, local_sigma, phased_edges, phased_ids

FILL_TARGET = 0.95
"""Planned chunk audio per batch, as a share of max_batch_seconds."""

VARIETY_SLACK = 0.05
"""Run-mate excess (share of the uniform in-bucket pair repeat rate) above which runs shrink below run_mb."""

PLAN_COLUMNS = ("shard", "offset", "size", "audio_offset", "audio_size", "json_offset", "json_size", "duration_s",
                "num_samples", "channels")
CHECK_COLUMNS = ("key", "text")
"""Index columns the reader checks shard bytes against (held as Arrow arrays: ~25 bytes a row for keys, ~100 for
transcripts; StreamConfig.check_transcripts=False leaves the latter out). Measured by benchmarks/load/bench_validate.py:
1M rows read and checked in ~0.45 s more than the unchecked read, 125 MB of Arrow memory for both columns."""
RUN_GAP_BYTES = 1 << 20
"""Rows closer than this in one shard are read as one range (reading through the gap beats another request);
the reader reads so and `shardtrain plan` (preflight) counts so."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketConfig:
    max_batch_seconds: float = 300.0
    """Audio seconds per batch on one rank (summed, or padded length x batch size when `padded_budget`)."""
    max_batch_size: int | None = None
    """Cap on utterances per batch; None for no cap."""
    padded_budget: bool = False
    """Count the budget as max duration x batch size (what the padded tensor costs) instead of the sum."""
    quadratic_duration_s: float | None = None
    """Length penalty for attention models: an utterance costs d + d**2 / quadratic_duration_s seconds."""
    num_buckets: int = 30
    """How varied batches are: as a uniform shuffle inside this many fixed equal-audio duration buckets (pair
    repeat rate across epochs). The rows planner's buckets (whole batches, edges moving every epoch) are as
    narrow as keeps that (~2/3 as wide: ~1.5x as many, padding.bucket_width); the block planner cuts at most this
    many; run_mb=0 cuts this many equal-audio bins (fewer where small). 1: one bucket, no bucketing."""
    bins_s: tuple[float, ...] | None = None
    """Hand-set bucket edges in seconds (ascending, interior edges only)."""
    batches_per_chunk: int = 4
    """Most batches a chunk (what one reader item reads and decodes) holds; fewer, larger chunks mix more, and
    runs of up to this many rows are dealt into distinct batches. 4: the pair repeat rate across epochs of a
    uniform in-bucket shuffle from the 4k-utterance benchmark to 1M rows (x1.0; padding 0.97 on the benchmark),
    with runs of ~4 rows (~0.65 MB of 8 s FLAC utterances) in buckets much larger than their chunks; memory ~
    prefetch_chunks x 4 decoded batches. 8: reads ~1.5x larger, twice the memory. 1: a batch is a chunk, so
    run-mates cannot part (x1.01 on the benchmark, ~x4 at 40k rows). With run_mb=0, 1 is the old contiguous
    batch (padding 0.96, 58% of pairs meet again next epoch)."""
    run_mb: float = 1.0
    """Contiguous bytes per read inside a bucket. A chunk gathers its batches from runs of about this size taken
    from random places of its bucket (re-cut at a random phase every epoch) and deals them with the rows of a
    run in distinct batches, so batch composition changes every epoch (pair repeat rate of a uniform in-bucket
    shuffle) while reads stay large and sequential. Where a bucket is much larger than its chunks, runs shrink
    towards batches_per_chunk rows (see min_run_mb). 0: a chunk is one contiguous run of the duration order
    (the same neighbours every epoch)."""
    min_run_mb: float = 0.25
    """Smallest run (bytes per read) that runs may shrink to in a bucket much larger than its chunks, where runs
    of <= batches_per_chunk rows keep the pair repeat rate at a uniform shuffle's (their rows part in the deal).
    The trade: at 200k-1M rows of ~8 s utterances, ~0.65 MB reads (7.7 per batch) instead of 1 MB (5 per batch)
    for x1.0 instead of x2.4-7.8 of the uniform repeat rate. Short utterances hit the floor first (runs longer
    than m rows: a small excess, x1.15 at 40k rows of 0.5-3 s). Set it to run_mb to keep every run at run_mb."""
    chunk_mb: float = 64.0
    """Upper bound on bytes per chunk, whatever the batch size (caps read size and memory per chunk)."""
    budget_table: tuple[tuple[float, float], ...] | None = None
    """Per-length budgets ((max_duration_s_edge, max_batch_seconds), ...) sorted by edge, replacing
    max_batch_seconds (`shardtrain tune` measures them). Exactly: b(d) = the budget of the first entry whose edge
    is >= d, the last entry's past the last edge; a batch whose longest utterance lasts L holds at most b(L)
    seconds of cost (summed, or L's x size with `padded_budget`); an utterance whose cost alone exceeds b(d) is
    too long (left out, counted), so a last budget of max_batch_seconds keeps max_batch_seconds' too-long rule.
    How: `cost_s` scales costs by max_batch_seconds / b(d) and no batch mixes two entries' lengths (rows: buckets
    cut at the edges; blocks: blocks and buckets cut there); a bucket of fewer rows than ranks merges into its
    neighbour and may then cross an edge (its rows then costed by `span_costs`: the smallest budget from their
    entry to the bucket's longest, so still exact). In the bucket fingerprint: a state resumes mid-epoch only with the same
    table, at an epoch boundary with any."""

    def __post_init__(self) -> None:
        if self.max_batch_seconds <= 0:
            raise ValueError("stream.bucket.max_batch_seconds must be > 0")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError("stream.bucket.max_batch_size must be >= 1 or None")
        if self.num_buckets < 1:
            raise ValueError("stream.bucket.num_buckets must be >= 1")
        if self.chunk_mb <= 0:
            raise ValueError("stream.bucket.chunk_mb must be > 0")
        if self.run_mb < 0:
            raise ValueError("stream.bucket.run_mb must be >= 0")
        if self.min_run_mb < 0:
            raise ValueError("stream.bucket.min_run_mb must be >= 0")
        if self.batches_per_chunk < 1:
            raise ValueError("stream.bucket.batches_per_chunk must be >= 1")
        if self.quadratic_duration_s is not None and self.quadratic_duration_s <= 0:
            raise ValueError("stream.bucket.quadratic_duration_s must be > 0 or None")
        if self.bins_s is not None and list(self.bins_s) != sorted(self.bins_s):
            raise ValueError("stream.bucket.bins_s must be ascending")
        if self.budget_table is not None:
            t = self.budget_table
            if not t or any(len(e) != 2 for e in t):
                raise ValueError("stream.bucket.budget_table must be a non-empty tuple of (edge_s, budget_s) pairs")
            edges = [float(e) for e, _ in t]
            if edges != sorted(edges) or len(set(edges)) != len(edges) or edges[0] <= 0:
                raise ValueError(f"stream.bucket.budget_table edges must be > 0 and strictly ascending, got {edges}")
            if any(not float(b) > 0 for _, b in t):
                raise ValueError("stream.bucket.budget_table budgets must be > 0 seconds")
            object.__setattr__(self, "budget_table", tuple((float(e), float(b)) for e, b in t))


@dataclass(frozen=True, slots=True)
class PlanIndex:
    """The numeric index columns planning and reading need (~70 bytes a row; texts and keys stay on disk)."""

    shard: np.ndarray  # int32
    offset: np.ndarray  # int64, first tar header of the sample
    size: np.ndarray  # int64, bytes up to the next sample
    audio_offset: np.ndarray  # int64
    audio_size: np.ndarray  # int64
    json_offset: np.ndarray  # int64
    json_size: np.ndarray  # int64
    duration_s: np.ndarray  # float64
    num_samples: np.ndarray  # int64, so a reader can allocate a batch before decoding into it
    channels: np.ndarray  # int16
    key: Any = None
    """Sample keys when the table had them (the reader checks tar member names against them and reports them):
    a pyarrow StringArray (~25 bytes a row in Arrow buffers, shared with forked workers) or a memory-mapped
    `load.mapped.MappedStrings`; None otherwise."""
    text: Any = None
    """Transcripts when read, as `key` (the reader checks each `<key>.json` text against them)."""

    @classmethod
    def from_table(cls, table) -> "PlanIndex":
        col = lambda n, t: np.asarray(numpy_of(table.column(n)), dtype=t)  # noqa: E731 - no pandas import
        opt = lambda n: table.column(n).combine_chunks() if n in table.column_names else None  # noqa: E731
        return cls(
            shard=col("shard", np.int32), offset=col("offset", np.int64), size=col("size", np.int64),
            audio_offset=col("audio_offset", np.int64), audio_size=col("audio_size", np.int64),
            json_offset=col("json_offset", np.int64), json_size=col("json_size", np.int64),
            duration_s=col("duration_s", np.float64), num_samples=col("num_samples", np.int64),
            channels=col("channels", np.int16), key=opt("key"), text=opt("text"),
        )

    def __len__(self) -> int:
        return len(self.duration_s)

    def string_at(self, column: str, row: int) -> str:
        """Row `row` of the `key` or `text` column, whichever of Arrow array or MappedStrings holds it."""
        v = getattr(self, column)[row]
        return v if isinstance(v, str) else v.as_py()

    def fingerprint(self) -> str:
        """Identifies the dataset a saved state belongs to, so resume refuses a different one."""
        h = hashlib.sha1()
        for a in (self.shard, self.offset, self.duration_s):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Chunk:
    rows: np.ndarray
    """Index rows this chunk reads, ascending (so byte ranges are sequential)."""
    batches: tuple[np.ndarray, ...]
    """Rows of each batch, in batch order; together a permutation of `rows`."""


@dataclass(frozen=True, slots=True)
class EpochPlan:
    epoch: int
    world_size: int
    groups: list[list[Chunk]]
    """groups[g][r]: the chunk rank r reads in group g; every chunk of a group has the same batch count."""
    too_long: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Rows left out because one of them alone exceeds the batch budget."""

    @property
    def steps(self) -> int:
        return sum(len(g[0].batches) for g in self.groups)

    def rank_chunks(self, rank: int) -> list[Chunk]:
        return [g[rank] for g in self.groups]


def _rng(seed: int, epoch: int, salt: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, salt])))


def cost_s(duration_s: np.ndarray, cfg: BucketConfig) -> np.ndarray:
    """Budget cost per utterance (seconds, with the optional quadratic penalty), in units of max_batch_seconds:
    with `budget_table` scaled by max_batch_seconds / b(d) (see BucketConfig.budget_table), so every planner
    keeps its one budget and honours the table."""
    c = duration_s if cfg.quadratic_duration_s is None else duration_s + duration_s**2 / cfg.quadratic_duration_s
    if cfg.budget_table is None:
        return c
    edges = table_edges(cfg)
    scale = cfg.max_batch_seconds / np.array([b for _, b in cfg.budget_table])
    return c * scale[np.minimum(np.searchsorted(edges, duration_s, side="left"), len(edges) - 1)]


def table_edges(cfg: BucketConfig) -> np.ndarray:
    """The budget table's duration edges (empty without a table): no batch mixes lengths across one."""
    return np.zeros(0) if cfg.budget_table is None else np.array([e for e, _ in cfg.budget_table])


def batch_budget_s(longest_s: float, cfg: BucketConfig) -> float:
    """The budget of a batch whose longest utterance lasts `longest_s` (max_batch_seconds without a table)."""
    if cfg.budget_table is None:
        return cfg.max_batch_seconds
    for edge, budget in cfg.budget_table:
        if longest_s <= edge:
            return budget
    return cfg.budget_table[-1][1]


def estimate_bins(duration_s: np.ndarray, num_buckets: int) -> np.ndarray:
    """Interior bucket edges so each bucket holds about equal total audio (lhotse-style, from metadata only)."""
    return phased_edges(duration_s, num_buckets, 0.0)


def batch_cost(costs: np.ndarray, cfg: BucketConfig) -> float:
    if len(costs) == 0:
        return 0.0
    return float(costs.max() * len(costs)) if cfg.padded_budget else float(costs.sum())


UNIT_FILL = 0.96
"""Mixed chunks: planned audio per batch as a share of max_batch_seconds. Buckets hold whole numbers of such
batches per rank, and the deal balances batch costs (`_balance`), so batches come out ~0.95 full."""


MIN_BUCKET_BATCHES = 2
"""Batches per rank a bucket holds at least (where the epoch has that many): a bucket of one batch per rank
would give every rank the same batch-mates every epoch, whatever the deal."""


def _bucket_units(total_cost: float, world_size: int, cfg: BucketConfig) -> tuple[int, int, float]:
    """(K, k, target): the epoch holds K batches per rank at ~UNIT_FILL of the budget, and a bucket k of them (the
    first and last buckets, cut by the epoch's phase, the remainders), k the narrowest that keeps the variety of
    `num_buckets` fixed buckets with edges that move every epoch (`padding.bucket_width`; target: the width that
    does exactly, <= k), and at least MIN_BUCKET_BATCHES. Why whole batches: a bucket of 1.48 batches per rank
    deals into 2 batches of 74%; bucket edges at whole batches leave only the end buckets part-full."""
    units = max(1, math.ceil(total_cost / (world_size * cfg.max_batch_seconds * UNIT_FILL) - 1e-9))
    k, target = bucket_width(total_cost, cfg.max_batch_seconds, world_size, cfg.num_buckets,
                             min(units, MIN_BUCKET_BATCHES))
    return units, min(k, units), target


def _bucket_ranges(rows: np.ndarray, dur: np.ndarray, cfg: BucketConfig, world_size: int,
                   phase: float = 0.0) -> list[np.ndarray]:
    """Split duration-sorted `rows` into buckets, merging any bucket with fewer than world_size rows.

    Mixed chunks (run_mb > 0): edges where the running budget cost passes each multiple of k batches per rank
    (`_bucket_units`) shifted by `phase` of a bucket (the epoch's `padding.bucket_phase`: edges move every epoch,
    so neighbours part; none where k covers the epoch), so every bucket but the first and last deals into full
    batches. Contiguous chunks (run_mb=0, the same neighbours every epoch by choice): fixed equal-audio bins
    capped so a bucket holds at least eight batches per rank (chunks are cut inside a bucket, so a small bucket
    quantises them into part-full batches). `bins_s` (fixed) overrides both.
    """
    if cfg.bins_s is not None:
        ids = np.searchsorted(np.asarray(cfg.bins_s, float), dur[rows], side="right")
    elif cfg.run_mb > 0:
        cum = np.cumsum(cost_s(dur[rows], cfg))
        units, k, _ = _bucket_units(float(cum[-1]) if len(cum) else 0.0, world_size, cfg)
        step = float(cum[-1]) / units * k if len(cum) else 1.0
        ids = phased_ids(cum - 0.5 * cost_s(dur[rows], cfg), step, phase if k < units else 0.0)
    else:
        fill = float(cost_s(dur[rows], cfg).sum()) / (8 * world_size * cfg.max_batch_seconds)
        ids = np.searchsorted(estimate_bins(dur[rows], max(1, min(cfg.num_buckets, int(fill)))), dur[rows],
                              side="right")
    entry = np.zeros(len(rows), np.int64)
    if cfg.budget_table is not None:  # no bucket (so no batch) holds lengths of two budget entries
        entry = np.searchsorted(np.nextafter(table_edges(cfg), np.inf), dur[rows], side="right")
        ids = ids * (len(cfg.budget_table) + 1) + entry
    # rows are sorted by duration, so bucket ids are non-decreasing: split at changes
    cuts = np.flatnonzero(np.diff(ids)) + 1
    buckets = [b for b in np.split(rows, cuts) if len(b)]
    entries = [int(e[0]) for e in np.split(entry, cuts) if len(e)]
    # a bucket with fewer rows than ranks joins its neighbour, never across a budget-table edge (a batch's budget
    # is its longest utterance's entry, so mixing entries could overrun it); one left alone deals short batches
    merged: list[np.ndarray] = []
    kinds: list[int] = []
    for b, e in zip(buckets, entries):
        if merged and len(merged[-1]) < world_size and kinds[-1] == e:
            merged[-1] = np.concatenate([merged[-1], b])
        else:
            merged.append(b)
            kinds.append(e)
    if len(merged) > 1 and len(merged[-1]) < world_size and kinds[-2] == kinds[-1]:
        tail = merged.pop()
        kinds.pop()
        merged[-1] = np.concatenate([merged[-1], tail])
    return _at_least(merged, world_size)


def _at_least(buckets: list[np.ndarray], world_size: int) -> list[np.ndarray]:
    """Buckets merged with their neighbours, across budget-table edges if need be, until every one holds at least
    world_size rows (so it cuts into a multiple of world_size non-empty chunks). One pass: a bucket is closed only
    once it holds world_size rows, and a short last one joins the one before; with >= world_size rows in all,
    every bucket ends with >= world_size. A bucket that spans table entries is costed by `span_costs`."""
    out: list[np.ndarray] = []
    for b in buckets:
        if out and len(out[-1]) < world_size:
            out[-1] = np.concatenate([out[-1], b])
        else:
            out.append(b)
    if len(out) > 1 and len(out[-1]) < world_size:
        tail = out.pop()
        out[-1] = np.concatenate([out[-1], tail])
    return out


def span_costs(duration_s: np.ndarray, cfg: BucketConfig) -> np.ndarray:
    """Budget costs of one bucket's rows when the bucket may span several budget-table entries: each row scaled by
    the smallest budget among the entries from its own to the bucket's longest that hold rows (`cost_s` scales by
    its own). Exact for any batch of the bucket: its longest row L's entry is among those, so the summed raw cost
    <= b(L) (padded: L's cost, scaled at least as much, x size). Never makes a kept row too long: a longer entry
    that holds a row d' has b >= raw(d') >= raw(d) (raw cost grows with length). Equal to `cost_s` inside one
    entry. O(rows)."""
    if cfg.budget_table is None:
        return cost_s(duration_s, cfg)
    d = np.asarray(duration_s, np.float64)
    raw = d if cfg.quadratic_duration_s is None else d + d**2 / cfg.quadratic_duration_s
    edges = table_edges(cfg)
    entry = np.minimum(np.searchsorted(edges, d, side="left"), len(edges) - 1)
    present = np.unique(entry)
    budgets = np.array([b for _, b in cfg.budget_table])[present]
    suffix_min = np.minimum.accumulate(budgets[::-1])[::-1]
    return raw * (cfg.max_batch_seconds / suffix_min[np.searchsorted(present, entry)])


def _chunk_count(cost: float, nbytes: float, rows: int, world_size: int, cfg: BucketConfig,
                 row_max: float = 0.0) -> int:
    """How many equal chunks to cut a bucket into: a multiple of world_size, at most `batches_per_chunk` batches
    and `chunk_mb` each, and among the few counts that allows, the one whose batches come closest to full
    (a bucket of 2.1 batches cut in 2 gives four half batches; cut in 3 gives three 70% ones)."""
    per_batch = cfg.max_batch_seconds * FILL_TARGET
    lo = max(1, math.ceil(cost / (cfg.batches_per_chunk * per_batch)), math.ceil(nbytes / (cfg.chunk_mb * 1e6)))
    first = math.ceil(lo / world_size) * world_size
    mixed = cfg.run_mb > 0
    if mixed:  # a random deal gives some batch one row more than the mean: leave room for the longest
        per_batch = max(cfg.max_batch_seconds - row_max, 0.5 * cfg.max_batch_seconds)
    best_fill, best_n = -1.0, (rows // world_size) * world_size
    for n in range(first, min(first + 4 * world_size, rows) + 1, world_size):
        per_chunk = cost / n
        fill = per_chunk / (math.ceil(per_chunk / per_batch - 1e-9) * cfg.max_batch_seconds)
        # mixed chunks: fewer, larger chunks mix more, so more of them must buy clearly fuller batches
        if fill > best_fill + (0.02 if mixed else 1e-9):
            best_fill, best_n = fill, n
    return best_n


def _chunk_shares(c: np.ndarray, nbytes: float, world_size: int, cfg: BucketConfig) -> np.ndarray | None:
    """Batches of each chunk, for a bucket of whole batches (`_bucket_ranges` with mixed chunks): the bucket's u
    batches per rank spread over the fewest chunks of <= batches_per_chunk batches and <= chunk_mb (18 -> 4, 4, 4,
    3, 3), each repeated for the world_size chunks of its group. Chunks are then cut in proportion, so every one
    deals into full batches. u counts batches of UNIT_FILL, or of what fits where rows are coarse against the
    budget (15 s rows: 7 to a 120 s batch, 89%). None where buckets are not cut in whole batches (bins_s,
    padded_budget, run_mb=0). `c`: the bucket's budget costs."""
    if cfg.run_mb <= 0 or cfg.bins_s is not None or cfg.padded_budget:
        return None
    cost, rows, budget = float(c.sum()), len(c), cfg.max_batch_seconds
    fill = min(UNIT_FILL, (budget // float(c.max())) * float(c.mean()) / budget)
    units = max(1, math.ceil(cost / (world_size * budget * fill) - 0.02))
    per_rank = max(math.ceil(units / cfg.batches_per_chunk), math.ceil(nbytes / (cfg.chunk_mb * 1e6) / world_size))
    per_rank = max(1, min(per_rank, rows // world_size))
    shares = np.full(per_rank, units // per_rank) + (np.arange(per_rank) < units % per_rank)
    return np.repeat(np.maximum(shares, 1), world_size).astype(np.float64)


def _cut_runs(bucket: np.ndarray, weights: np.ndarray, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Cut a bucket into n contiguous pieces of equal weight (`weights[i]`: the budget cost of `bucket[i]`),
    boundaries shifted by a random phase (some may be empty). The piece that wraps past the end joins the
    bucket's first rows: two byte ranges, still one piece."""
    cum = np.cumsum(weights)
    total = cum[-1]
    phase = rng.random()
    bounds = np.searchsorted(cum, total * (np.arange(n) + phase) / n, side="left")
    bounds = np.maximum.accumulate(np.clip(bounds, 0, len(bucket)))
    pieces = [bucket[bounds[i]:bounds[i + 1]] for i in range(n - 1)]
    pieces.append(np.concatenate([bucket[bounds[-1]:], bucket[:bounds[0]]]))
    return pieces


def _shuffled_runs(bucket: np.ndarray, n_runs: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The bucket cut into n_runs contiguous runs of equal row count (they differ by at most one row) at a random
    phase, the one past the end wrapping to the bucket's first rows, laid end to end in random order: (rows, run
    id of each row). Flat numpy, no array per run (a 1M-row corpus has ~250k runs)."""
    size = len(bucket)
    bounds = np.floor((np.arange(n_runs) + rng.random()) * size / n_runs).astype(np.int64)
    lens = np.diff(np.append(bounds, bounds[0] + size))
    order = rng.permutation(n_runs)
    lens = lens[order]
    pos = np.repeat(bounds[order] - (np.cumsum(lens) - lens), lens) + np.arange(size)
    return bucket[pos % size], np.repeat(np.arange(n_runs), lens)


def _run_count(bucket: np.ndarray, nbytes: float, costs: np.ndarray, n: int, cfg: BucketConfig) -> int:
    """How many runs of equal row count to cut a bucket into (n: one run per chunk, the contiguous layout).

    Runs of ~`run_mb`, unless the bucket is large against its chunks: run-mates (rows of one run) are read
    together again next epoch with probability ~1/2, so with a deal that ignores runs they meet again in a batch
    more often than a uniform in-bucket shuffle pairs anything, by ~N x L / (2 C^2) of the uniform rate (bucket
    rows N, run rows L, chunk rows C). Where that exceeds VARIETY_SLACK, runs shrink to the length at which it
    does not, but not below m rows (batches per chunk: `deal_runs` puts a run of <= m rows into distinct
    batches, which removes the excess altogether) nor below `min_run_mb` bytes (what it costs: smaller reads)."""
    rows = len(bucket)
    if cfg.run_mb <= 0:
        return n
    row_bytes = max(nbytes / rows, 1.0)
    run_rows = cfg.run_mb * 1e6 / row_bytes
    chunk_rows = rows / n
    ok_rows = 2 * VARIETY_SLACK * chunk_rows**2 / rows
    if run_rows > ok_rows:
        c = costs[bucket]
        per_chunk = float(c.max()) * chunk_rows if cfg.padded_budget else float(c.sum()) / n
        m = max(1, math.ceil(per_chunk / cfg.max_batch_seconds - 1e-9))
        if cfg.max_batch_size is not None:
            m = max(m, math.ceil(chunk_rows / cfg.max_batch_size))
        run_rows = min(run_rows, max(ok_rows, m, cfg.min_run_mb * 1e6 / row_bytes))
    return max(n, min(rows, math.ceil(rows / max(run_rows, 1.0))))


def _cut_chunks(bucket: np.ndarray, idx: PlanIndex, costs: np.ndarray, world_size: int, cfg: BucketConfig,
                rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cut a bucket into n (a multiple of world_size) chunks of equal audio: per chunk (rows, run id of each row),
    runs contiguous and each in duration order (what `deal_runs` needs to keep run-mates apart).

    n is chosen so a chunk holds `batches_per_chunk` batches filled to ~95% of the budget (the headroom absorbs
    the spread of dealing shuffled utterances), and no more than `chunk_mb` bytes. Each chunk is k contiguous runs
    (`_run_count`: ~`run_mb`, or shorter for variety; runs of equal rows cut at a random phase, shuffled, cut
    into n of equal audio), so which utterances meet in a chunk changes every epoch while every read stays a
    large sequential one (k = 1 with run_mb=0: n equal-audio pieces, the contiguous layout).
    """
    nbytes = float(idx.size[bucket].sum())
    shares = _chunk_shares(costs[bucket], nbytes, world_size, cfg)
    n = len(shares) if shares is not None else \
        _chunk_count(float(costs[bucket].sum()), nbytes, len(bucket), world_size, cfg, float(costs[bucket].max()))
    n_runs = _run_count(bucket, nbytes, costs, n, cfg)
    if n_runs > n or (shares is not None and n > 1):  # runs in random order, cut into n chunks of their shares
        seq, run_of = _shuffled_runs(bucket, n_runs, rng)
        cum = np.cumsum(costs[seq])
        share = np.cumsum(shares)[:-1] / shares.sum() if shares is not None else np.arange(1, n) / n
        cuts = np.searchsorted(cum, cum[-1] * share, side="left")
        pieces = list(zip(np.split(seq, cuts), np.split(run_of, cuts)))
    else:  # one run per chunk (ascending: the wrap-around piece's two byte ranges in order)
        runs = _cut_runs(bucket, costs[bucket], n, rng)
        pieces = [(np.sort(r), np.zeros(len(r), np.int64)) for r in runs]
    # equal-audio cuts can leave a piece empty when a few long rows dominate: each empty piece takes one row from
    # the largest. Bounded: n <= rows (_bucket_ranges gives >= world_size rows, the counts cap n at rows), so
    # while a piece is empty the largest holds >= 2 rows and is never emptied; one move per empty piece.
    if n > len(bucket):
        raise RuntimeError(f"planner: {n} chunks for a bucket of {len(bucket)} rows")
    for empty in [i for i, (p, _) in enumerate(pieces) if len(p) == 0]:
        donor = max(range(n), key=lambda i: len(pieces[i][0]))
        (p, r) = pieces[donor]
        pieces[empty], pieces[donor] = (p[-1:], r[-1:]), (p[:-1], r[:-1])
    return pieces


def _deal_chunk(rows: np.ndarray, run_of: np.ndarray, m: int, dur: np.ndarray, costs: np.ndarray, cfg: BucketConfig,
                rng: np.random.Generator, local: float | None) -> list[np.ndarray]:
    """A chunk dealt into m batches: `padding.local_deal` with noise `local` where set (and it keeps
    max_batch_size), else the run-aware uniform deal (`deal_runs`), or with run_mb=0 a plain shuffle."""
    if local is not None:
        dealt = local_deal(rows, dur, costs, m, rng, local)
        if cfg.max_batch_size is None or max(len(b) for b in dealt) <= cfg.max_batch_size:
            return dealt
    return _deal(rows, m, rng) if cfg.run_mb <= 0 else deal_runs(rows, run_of, m, rng)


def _deal_group(members: list[tuple[np.ndarray, np.ndarray]], dur: np.ndarray, costs: np.ndarray, cfg: BucketConfig,
                rng: np.random.Generator, local: float | None) -> list[list[np.ndarray]]:
    """A group's chunks dealt into the same number M_g of batches, each within the budget: the fewest batches
    (from what the largest chunk needs) at which every chunk's deal fits, after balancing swaps. Bounded by
    construction: at M_g = the largest chunk's row count the run-aware deal puts every row in a batch of its own,
    which fits (every kept row costs <= the budget, and max_batch_size >= 1), so the search stops there."""
    m = max(_batches_needed(p, costs, cfg) for p, _ in members)
    last = max(m, max(len(p) for p, _ in members))
    budget = cfg.max_batch_seconds + 1e-9
    for m in range(m, last + 1):
        if m == last:  # one row a batch at most: fits by construction
            return [_deal(p, m, rng) if cfg.run_mb <= 0 else deal_runs(p, r, m, rng) for p, r in members]
        dealt = [_deal_chunk(p, r, m, dur, costs, cfg, rng, local) for p, r in members]
        fits = [all(batch_cost(costs[b], cfg) <= budget for b in d) for d in dealt]
        if not all(fits) and cfg.run_mb > 0 and not cfg.padded_budget:  # even out seconds, not counts
            for i in (i for i, f in enumerate(fits) if not f):
                fixed = _balance(dealt[i], costs, dict(zip(members[i][0].tolist(), members[i][1].tolist())),
                                 cfg.max_batch_seconds)
                if fixed is not None and all(batch_cost(costs[b], cfg) <= budget for b in fixed):  # checked
                    dealt[i], fits[i] = fixed, True
        if all(fits):
            return dealt
    raise RuntimeError("planner: unreachable")  # the loop returns at m == last


def _deal(rows: np.ndarray, m: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle rows and deal them round-robin into m batches (sizes differ by at most one)."""
    perm = rows[rng.permutation(len(rows))]
    return [perm[i::m] for i in range(m)]


def deal_runs(rows: np.ndarray, run_of: np.ndarray, m: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Deal a chunk into m batches so that run-mates (neighbours in duration order, read together) part.

    Each run (contiguous in `rows`, in duration order) is cut into ceil(L / m) contiguous sub-runs of <= m rows;
    the sub-runs are laid end to end in random order (rows inside each in random order) and position p goes to
    batch p mod m. So the rows of a sub-run always land in distinct batches, rows of different sub-runs meet with
    probability ~1/m (as in a uniform shuffle of the chunk), batch sizes differ by at most one, and the batches
    come out in random order. Why: the rows that stay together across epochs are run-mates (a run is re-cut at a
    random phase each epoch, so two rows d apart share a run again with probability ~1 - d/L); keeping the close
    ones in distinct batches removes the run-mate excess over a uniform shuffle when runs hold <= m rows.
    Public so any planner whose chunks are made of contiguous runs (blockplan's blocks) can deal the same way.
    O(rows) numpy."""
    n = len(rows)
    if m == 1 or n == 0:
        return [rows] + [rows[:0]] * (m - 1)
    bounds = np.flatnonzero(np.concatenate(([True], run_of[1:] != run_of[:-1], [True])))
    lens = np.diff(bounds)
    if lens.max() <= m:  # the usual case where runs shrank for variety: a sub-run is a run
        sub, n_sub = np.repeat(np.arange(len(lens)), lens), len(lens)
    else:  # near-equal contiguous pieces of <= m rows
        q = -(-lens // m)
        pos = np.arange(n) - np.repeat(bounds[:-1], lens)
        sub, n_sub = np.repeat(np.cumsum(q) - q, lens) + pos * np.repeat(q, lens) // np.repeat(lens, lens), int(q.sum())
    key = rng.permutation(n_sub)[sub] + rng.random(n)  # sub-runs in random order, rows shuffled inside each
    dealt = rows[np.argsort(key)]
    return [dealt[i::m] for i in rng.permutation(m)]


def _batches_needed(rows: np.ndarray, costs: np.ndarray, cfg: BucketConfig) -> int:
    c = costs[rows]
    m = math.ceil(batch_cost(c, cfg) / cfg.max_batch_seconds) if len(c) else 1
    if cfg.max_batch_size is not None:
        m = max(m, math.ceil(len(c) / cfg.max_batch_size))
    return max(m, 1)


def _balance(batches: list[np.ndarray], costs: np.ndarray, run_of: dict[int, int] | None, budget: float,
             tries: int = 64) -> list[np.ndarray] | None:
    """Swap single rows between the heaviest batch and a lighter one until every batch fits the budget (None if
    it cannot). A random deal gives equal row counts, not equal seconds: a batch can land a few percent over the
    mean and cost the whole group one more, part-full batch (the fill lost before whole-batch buckets). A swap
    keeps both batch sizes, and never puts a row beside a run-mate (`run_of`: row -> run) when another swap
    would do. A few swaps per chunk, each O(batch rows)."""
    out = [b.copy() for b in batches]
    loads = np.array([float(costs[b].sum()) for b in out])
    for _ in range(tries):
        h = int(np.argmax(loads))
        if loads[h] <= budget + 1e-9:
            return out
        for lo in np.argsort(loads).tolist():  # the lightest first: the swap that evens the two
            if lo == h:
                return None
            swap = _best_swap(out[h], out[lo], costs, run_of, 0.5 * (loads[h] - loads[lo]), budget - loads[lo])
            if swap is not None:
                break
        else:
            return None
        i, k, gain = swap
        out[h][i], out[lo][k] = out[lo][k], out[h][i]
        loads[h] -= gain
        loads[lo] += gain
    return out if loads.max() <= budget + 1e-9 else None


def _best_swap(heavy: np.ndarray, light: np.ndarray, costs: np.ndarray, run_of: dict[int, int] | None,
               want: float, room: float) -> tuple[int, int, float] | None:
    """(i, k, seconds moved) of the swap of heavy[i] with light[k] that moves closest to `want` seconds, more
    than none and at most `room`, run-mates kept apart where possible; None if there is none."""
    ch, cl = costs[heavy], costs[light]
    if len(ch) == 0 or len(cl) == 0:
        return None
    order = np.argsort(cl)
    j = np.clip(np.searchsorted(cl[order], ch - want), 0, len(cl) - 1)
    j = np.where((ch - cl[order][j] > room) & (j + 1 < len(cl)), j + 1, j)  # the next lighter row if too much
    gain = ch - cl[order][j]
    bad = (gain <= 1e-12) | (gain > room + 1e-9)
    if run_of is not None and (~bad).any():
        runs_lo = {run_of[int(r)] for r in light}
        runs_h = {run_of[int(r)] for r in heavy}
        mates = np.array([run_of[int(r)] in runs_lo for r in heavy]) | \
            np.array([run_of[int(light[order[x]])] in runs_h for x in j])
        if (~bad & ~mates).any():
            bad |= mates
    if bad.all():
        return None
    i = int(np.argmin(np.where(bad, np.inf, np.abs(gain - want))))
    return i, int(order[j[i]]), float(gain[i])


def plan_epoch(idx: PlanIndex, *, seed: int, epoch: int, world_size: int, cfg: BucketConfig,
               exclude: np.ndarray | None = None) -> EpochPlan:
    """Every rank's batches for one epoch. Pure: the same arguments always give the same plan.

    `exclude` (boolean mask over rows) removes rows already consumed, which is how a resume with a different
    world size re-stripes the rest of an epoch. A rest of fewer rows than ranks (a resume on more ranks just
    before an epoch's end) is left out, as the equal-steps tail is: the epoch ends there for every rank.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    costs = cost_s(idx.duration_s, cfg)
    keep = np.ones(len(idx), bool) if exclude is None else ~exclude
    too_long = np.flatnonzero(keep & (costs > cfg.max_batch_seconds))
    keep[too_long] = False
    rows = np.flatnonzero(keep)
    if 0 < len(rows) < world_size:
        if exclude is None:
            raise ValueError(
                f"{len(rows)} samples left for {world_size} ranks: every rank needs at least one; "
                "use fewer ranks or a larger dataset")
        rows = rows[:0]  # an epoch's rest after a resume on more ranks: too few for equal steps, left out like a tail
    # rows sorted by duration (the index is globally sorted; stable re-sort guards hand-made indexes)
    rows = rows[np.argsort(idx.duration_s[rows], kind="stable")]
    rng = _rng(seed, epoch, 1)
    groups: list[list[Chunk]] = []
    phase = bucket_phase(seed, epoch)
    _, k, target = _bucket_units(float(costs[rows].sum()), world_size, cfg)
    sigma = local_sigma(k, target) if cfg.run_mb > 0 and not cfg.padded_budget and cfg.bins_s is None else None
    for bucket in (_bucket_ranges(rows, idx.duration_s, cfg, world_size, phase) if len(rows) else []):
        costs[bucket] = span_costs(idx.duration_s[bucket], cfg)  # a bucket may span table entries
        pieces = _cut_chunks(bucket, idx, costs, world_size, cfg, rng)
        # a chunk that is its whole bucket has no run-mates to part from: deal it into narrow bands of lengths
        local = sigma if len(pieces) == 1 else None
        for g0 in range(0, len(pieces), world_size):
            members = pieces[g0:g0 + world_size]
            dealt = _deal_group(members, idx.duration_s, costs, cfg, rng, local)
            rot = (g0 // world_size) % world_size  # rotate so no rank always gets a bucket's shortest chunk
            chunks = [Chunk(rows=np.sort(members[i][0]), batches=tuple(dealt[i])) for i in range(world_size)]
            groups.append(chunks[rot:] + chunks[:rot])
    order = rng.permutation(len(groups))
    return EpochPlan(epoch=epoch, world_size=world_size, groups=[groups[i] for i in order], too_long=too_long)


def consumed_rows(plan: EpochPlan, steps: int) -> np.ndarray:
    """Rows delivered to all ranks by the first `steps` batches of this plan (for elastic re-striping)."""
    out: list[np.ndarray] = []
    left = steps
    for g in plan.groups:
        m = len(g[0].batches)
        take = min(m, left)
        for c in g:
            out.extend(c.batches[:take])
        left -= take
        if left <= 0:
            break
    return np.concatenate(out) if out else np.zeros(0, np.int64)
