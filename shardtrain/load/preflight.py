"""A run seen before launch: what the planner will do, from metadata only (`shardtrain plan`).

    Planner (the one build_loader would make: rows, blocks or a mixture) + world size, nodes, target rate
      -> epoch 0 (and 1) of the planner's own EpochView: steps per rank, then the batches of a sample of ranks
         (<= `sample_ranks`, spread over the world) -> fill, padding, reads per chunk, first batch
      -> the selection (Planner.selection) -> mixture shares against the weights, epochs until a dataset repeats
      -> memory per node (index arrays held per rank, block table, mapped index on disk), start-up estimate,
         bytes and requests per second per node at the target rate, pair repeat rate vs a uniform in-bucket shuffle

Why a sample of ranks: every rank's batches of a 100M-row epoch are the whole deal (minutes), while a few ranks
give fill, padding and reads to within a percent (ranks are dealt alike); steps are exact for all ranks.
Estimates say what they rest on: DECODE_AUDIO_S_PER_CORE and READ_MB_S are measured figures of this project's
benchmarks (stack.md: FLAC decode ~4,900 audio s/s per core; loopback S3 streaming ~100-600 MB/s).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from shardtrain.load.plan import PlanIndex, batch_budget_s, cost_s
from shardtrain.load.planner import Planner
from shardtrain.load.plan import RUN_GAP_BYTES

DECODE_AUDIO_S_PER_CORE = 4_900.0
"""FLAC 16 kHz mono decode rate of one core (stack.md: 2.04 ms per 10 s clip with soundfile)."""
READ_MB_S = 200.0
"""Sequential read rate assumed for the first chunk (local disk and loopback S3 measure 100-600 MB/s here)."""
FIRST_BYTE_S = 0.03
"""Latency of a ranged read's first byte on object storage (per request)."""
MAP_BUILD_S_PER_MROW = 6.0
"""Seconds to build the node's memory-mapped index per million rows, key and text columns included
(bench_block_loader.py, 1M and 10M synthetic rows on 2 cores)."""
VARIETY_MAX_ROWS = 500_000
"""Above this many rows the pair repeat rate is not computed (it needs every rank's batches of two epochs)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PreflightConfig:
    world_size: int
    nodes: int = 1
    target_audio_s_per_s: float = 1_000.0
    """Audio seconds per second each rank trains on (sets the read rate the storage must sustain)."""
    sample_ranks: int = 8
    variety: bool = True

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.nodes < 1 or self.world_size % self.nodes:
            raise ValueError(f"--world-size {self.world_size} must be a positive multiple of --nodes {self.nodes}")
        if self.target_audio_s_per_s <= 0:
            raise ValueError("--target-audio-s-per-s must be > 0")


def _ranks(world: int, k: int) -> list[int]:
    return sorted(set(np.linspace(0, world - 1, min(world, k)).round().astype(int).tolist()))


def _reads(index: PlanIndex, rows: np.ndarray) -> tuple[int, int]:
    """(ranged reads, bytes) of one chunk: rows of one shard closer than RUN_GAP_BYTES share a read."""
    if not len(rows):
        return 0, 0
    shard, start = index.shard[rows], index.offset[rows]
    end = start + index.size[rows]
    new = np.ones(len(rows), bool)
    new[1:] = (shard[1:] != shard[:-1]) | (start[1:] - end[:-1] > RUN_GAP_BYTES) | (start[1:] < end[:-1])
    return int(new.sum()), int(index.size[rows].sum())


def batch_figures(planner: Planner, pc: PreflightConfig, bucket, epoch: int = 0) -> dict:
    """Steps, fill, padding, reads and the first batch of epoch `epoch`, over a sample of ranks."""
    t0 = time.perf_counter()
    view = planner.epoch(epoch, pc.world_size)
    plan_s = time.perf_counter() - t0
    audio = padded = cost = budget = 0.0
    n_batches = empty = reads = nbytes = chunks = 0
    first: dict = {}
    durations: list[np.ndarray] = []
    ranks = _ranks(pc.world_size, pc.sample_ranks)
    for rank in ranks:
        for rc in view.chunks(rank):
            r, b = _reads(rc.index, rc.chunk.rows)
            reads, nbytes, chunks = reads + r, nbytes + b, chunks + 1
            for rows in rc.chunk.batches:
                d = np.asarray(rc.index.duration_s[rows], np.float64)
                if not len(d):
                    empty += 1
                    continue
                n_batches += 1
                durations.append(d)
                audio += float(d.sum())
                padded += float(d.max()) * len(d)
                cost += float(cost_s(d, bucket).sum())
                budget += bucket.max_batch_seconds
                if rank == ranks[0] and not first:
                    first = {"utterances": int(len(d)), "audio_s": float(d.sum()),
                             "bytes": int(rc.index.size[rows].sum()), "reads": _reads(rc.index, np.sort(rows))[0]}
    return {"steps_per_epoch": int(view.steps), "rows_per_epoch": int(view.rows), "plan_s": plan_s,
            "sampled_ranks": ranks, "batches_sampled": n_batches, "empty_batches": empty,
            "fill": cost / budget if budget else 0.0, "padding_efficiency": audio / padded if padded else 0.0,
            "mean_batch_audio_s": audio / n_batches if n_batches else 0.0, "reads_per_chunk": reads / max(chunks, 1),
            "mb_per_read": nbytes / max(reads, 1) / 1e6, "first_batch": first,
            "batch_durations": durations}


def pair_repeat(planner: Planner, world_size: int, rows: int) -> dict:
    """Pairs sharing a batch in epoch 0 that share one again in epoch 1, against a uniform shuffle of the same
    epoch-1 batches' rows inside each lock-step group (the duration band the planner deals in)."""
    if rows > VARIETY_MAX_ROWS:
        return {"skipped": f"{rows} rows > {VARIETY_MAX_ROWS}: run benchmarks/load/bench_shuffle.py on a sample"}
    pairs = again = 0
    ref = 0.0
    batch_of: dict[int, int] = {}
    group_of: dict[int, int] = {}
    group_sizes: list[np.ndarray] = []
    nxt = planner.epoch(1, world_size)
    bid = 0
    for rank in range(world_size):  # every rank's epoch-1 batches: batch id and band of every (dataset, row)
        for g, rc in enumerate(nxt.chunks(rank)):
            for b in rc.chunk.batches:
                src, row = rc.origin(b)
                for key in (src.astype(np.int64) << 40 | row).tolist():
                    batch_of[key] = bid
                    group_of[key] = g
                bid += 1
    sizes: dict[int, list[int]] = {}
    for key, batch_id in batch_of.items():
        sizes.setdefault(group_of[key], []).append(batch_id)
    p_same = {}
    for g, bs in sizes.items():  # uniform shuffle inside a band: P(same batch) = sum n_b (n_b - 1) / (N (N - 1))
        n_b = np.bincount(np.asarray(bs))
        n_b = n_b[n_b > 0]
        n = n_b.sum()
        p_same[g] = float((n_b * (n_b - 1)).sum() / (n * (n - 1))) if n > 1 else 0.0
    cur = planner.epoch(0, world_size)
    for rank in range(world_size):
        for rc in cur.chunks(rank):
            for b in rc.chunk.batches:
                src, row = rc.origin(b)
                keys = (src.astype(np.int64) << 40 | row).tolist()
                ids = np.array([batch_of.get(k, -1 - i) for i, k in enumerate(keys)])
                _, c = np.unique(ids, return_counts=True)
                k = len(keys)
                pairs += k * (k - 1) // 2
                again += int((c * (c - 1) // 2).sum())
                gs = [group_of.get(x, -1) for x in keys]
                _, gc = np.unique(gs, return_counts=True)
                ref += sum(float(p_same.get(g, 0.0)) * n * (n - 1) / 2 for g, n in zip(np.unique(gs), gc))
    rate, uni = (again / pairs, ref / pairs) if pairs else (0.0, 0.0)
    return {"pair_repeat_rate": rate, "uniform_in_band": uni, "x_uniform": rate / uni if uni else None}


def mixture_figures(planner: Planner, weights: list[float], epochs: int = 3) -> list[dict]:
    """Per dataset: audio share of each of the first `epochs` epochs against its weight share, and the epochs until
    it repeats (its audio over its per-epoch share; < 1 means rows repeat inside one epoch)."""
    indexes: list[PlanIndex] = getattr(planner, "indexes", None) or [getattr(planner, "idx")]
    bucket = getattr(planner, "bucket")
    wsum = float(sum(weights))
    shares = []
    for e in range(epochs):
        src, row = planner.selection(e)
        sec = np.zeros(len(indexes))
        for i, ix in enumerate(indexes):
            sec[i] = float(np.asarray(ix.duration_s, np.float64)[row[src == i]].sum())
        shares.append(sec)
    out = []
    for i, ix in enumerate(indexes):
        per_epoch = float(np.mean([s[i] for s in shares]))
        dur = np.asarray(ix.duration_s, np.float64)
        total = float(dur[cost_s(dur, bucket) <= bucket.max_batch_seconds].sum())
        out.append({"dataset": planner.datasets[i], "weight_share": weights[i] / wsum,
                    "share_per_epoch": [float(s[i] / s.sum()) if s.sum() else 0.0 for s in shares],
                    "audio_s_per_epoch": per_epoch, "audio_s": total,
                    "epochs_until_repeat": total / per_epoch if per_epoch else None})
    return out


def memory_figures(planner: Planner, pc: PreflightConfig) -> dict:
    """Bytes each rank holds for planning, bytes per node, and the mapped index on disk (blocks planner)."""
    per_node = pc.world_size // pc.nodes
    held = 0
    indexes = getattr(planner, "indexes", None) or [getattr(planner, "idx", None)]
    mapped = planner.name == "blocks"
    for ix in indexes:
        if ix is None:
            continue
        for f in ("shard", "offset", "size", "audio_offset", "audio_size", "json_offset", "json_size", "duration_s",
                  "num_samples", "channels", "key", "text"):
            a = getattr(ix, f, None)
            if a is None:
                continue
            held += int(getattr(a, "nbytes", 0) or 0)
    blocks = getattr(planner, "blocks", None)
    table = 0
    for b in (blocks if isinstance(blocks, list) else [blocks] if blocks is not None else []):
        table += sum(int(getattr(b, f).nbytes) for f in ("start", "rows", "cost", "max_cost", "nbytes", "too_long"))
    if mapped:  # the map is one copy per node in the page cache; each rank holds the block table
        return {"per_rank_bytes": table, "per_node_bytes": held + table * per_node, "mapped_index_bytes": held,
                "map_build_s_estimate": MAP_BUILD_S_PER_MROW * sum(len(ix.duration_s) for ix in indexes
                                                                   if ix is not None) / 1e6}
    return {"per_rank_bytes": held, "per_node_bytes": held * per_node, "mapped_index_bytes": 0,
            "map_build_s_estimate": 0.0}


def io_figures(planner: Planner, pc: PreflightConfig, figures: dict, decode_threads: int) -> dict:
    """Bytes and requests per second per node at the target rate, and the time to the first batch."""
    shards = planner.data.shards
    total_bytes = float(sum(s.bytes for s in shards))
    total_s = float(sum(s.seconds for s in shards))
    bytes_per_audio_s = total_bytes / total_s if total_s else 0.0
    per_node = pc.world_size // pc.nodes
    bps = pc.target_audio_s_per_s * per_node * bytes_per_audio_s
    mb_per_read = max(figures["mb_per_read"], 1e-6)
    first = figures["first_batch"] or {"audio_s": 0.0, "bytes": 0, "reads": 0}
    first_s = (first["reads"] * FIRST_BYTE_S + first["bytes"] / (READ_MB_S * 1e6)
               + first["audio_s"] / (DECODE_AUDIO_S_PER_CORE * max(1, min(decode_threads, 2))))
    return {"bytes_per_audio_s": bytes_per_audio_s, "node_read_mb_s": bps / 1e6,
            "node_requests_per_s": bps / (mb_per_read * 1e6), "first_batch_read_decode_s": first_s}
