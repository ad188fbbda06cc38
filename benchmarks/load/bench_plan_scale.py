"""Scale check: planning time and memory vs corpus size, index read cost, real-audio loader throughput.

    synthetic index rows (1k, 10k, 100k, 1M; LibriSpeech-like durations, 256 MB shards), numpy -> PlanIndex
      -> plan_epoch(world_size 1 and 64): wall s (median of --repeats), numpy/Python heap peak (tracemalloc),
         peak RSS growth over the imports (fresh interpreter per size), batches and chunks
    index.parquet with the real column set (shardtrain.format.manifest.INDEX_SCHEMA, zstd) for the largest size
      -> pyarrow read with the planner's column projection vs all columns, and PlanIndex.from_table
    real audio (espeak-ng speech packed by `shardtrain pack`, cached in --work-dir): 1k and 4k utterances
      -> one epoch of the loader (local disk, num_workers 0): audio-s/s, first batch s, peak RSS

Planning cost should grow linearly in rows (numpy sort/cumsum plus a Python loop over ~rows/500 chunks), and
loader RSS should not grow with corpus size (only the ~40 B/row PlanIndex does). Run:

    .venv/bin/python -m benchmarks.load.bench_plan_scale                 # 1k..1M rows + 1k/4k real audio (~2-3 min)
    .venv/bin/python -m benchmarks.load.bench_plan_scale --quick         # 1k..100k rows, 400 utterances of audio
    .venv/bin/python -m benchmarks.load.bench_plan_scale --simulate      # block planner, 1k..100M rows x 1..1,024 ranks
"""
from __future__ import annotations

import argparse
import logging
import resource
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from benchmarks import common

log = logging.getLogger("bench")
SHARD_BYTES = 256 << 20


def synthetic_columns(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Index columns of n duration-sorted FLAC samples (16 kHz, ~0.55 compression) laid out in 256 MB shards."""
    rng = np.random.default_rng(seed)
    dur = np.sort(np.clip(rng.lognormal(np.log(8.0), 0.6, n), 0.5, 35.0))
    audio_size = (dur * 16000 * 2 * 0.55).astype(np.int64)
    json_size = np.full(n, 220, np.int64)
    pad = lambda x: (x + 511) // 512 * 512  # noqa: E731 - tar data padding
    size = 512 + pad(audio_size) + 512 + pad(json_size)
    shard = (np.cumsum(size) - size) // SHARD_BYTES
    offset = np.zeros(n, np.int64)
    for s in np.unique(shard):  # offsets restart in every shard
        m = shard == s
        offset[m] = np.cumsum(size[m]) - size[m]
    return {"shard": shard.astype(np.int32), "offset": offset, "size": size, "audio_offset": offset + 512,
            "audio_size": audio_size, "json_offset": offset + 512 + pad(audio_size) + 512, "json_size": json_size,
            "duration_s": dur, "num_samples": (dur * 16000).astype(np.int64), "channels": np.ones(n, np.int16)}


def plan_scale_one(n: int, world_sizes: list[int], max_batch_seconds: float, repeats: int) -> dict:
    """Run in a fresh interpreter: planning figures for one corpus size."""
    from shardtrain.load.plan import BucketConfig, PlanIndex, plan_epoch

    maxrss_mb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731
    rss_imports = maxrss_mb()  # `import shardtrain` pulls in torch (~700 MB), so report growth over it
    t0 = time.perf_counter()
    idx = PlanIndex(**synthetic_columns(n))
    build_s = time.perf_counter() - t0
    cfg = BucketConfig(max_batch_seconds=max_batch_seconds)
    out: dict = {"rows": n, "index_mb": round(sum(getattr(idx, f).nbytes for f in idx.__slots__) / 2**20, 2),
                 "build_index_s": round(build_s, 3), "audio_hours": round(float(idx.duration_s.sum()) / 3600, 1)}
    for ws in world_sizes:
        times = []
        for rep in range(repeats):
            t0 = time.perf_counter()
            plan = plan_epoch(idx, seed=0, epoch=rep, world_size=ws, cfg=cfg)
            times.append(time.perf_counter() - t0)
        tracemalloc.start()
        plan_epoch(idx, seed=0, epoch=0, world_size=ws, cfg=cfg)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out[f"ws{ws}"] = {"plan_s": round(statistics.median(times), 4), "plan_s_min": round(min(times), 4),
                          "plan_s_max": round(max(times), 4), "heap_peak_mb": round(peak / 2**20, 1),
                          "steps": plan.steps, "chunks": sum(len(g) for g in plan.groups),
                          "rows_per_s": round(n / statistics.median(times))}
    out["rss_after_imports_mb"] = round(rss_imports, 1)
    out["peak_rss_growth_mb"] = round(maxrss_mb() - rss_imports, 1)
    return out


def index_read_one(n: int) -> dict:
    """Write a synthetic index.parquet of n rows (all columns, real types) and time reading it back."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardtrain.format.manifest import INDEX_SCHEMA, index_bytes
    from shardtrain.load.plan import PLAN_COLUMNS, PlanIndex

    cols = synthetic_columns(n)
    keys = np.char.add("spk123-chapter4567-utt", np.arange(n).astype("U8"))
    table = pa.table({
        "key": pa.array(keys), "codec": pa.array(np.full(n, "flac")),
        "num_samples": (cols["duration_s"] * 16000).astype(np.int64),
        "sample_rate_hz": np.full(n, 16000, np.int32), "channels": np.full(n, 1, np.int16),
        "text": pa.array(np.full(n, "the quick brown fox jumps over the lazy dog near the riverbank at dawn")),
        "speaker": pa.array(np.full(n, "spk123")), "language": pa.array(np.full(n, "en")),
        "source": pa.array(np.char.add("/data/librispeech/train/", keys)), **cols,
    }).select(INDEX_SCHEMA.names).cast(INDEX_SCHEMA)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "index.parquet"
        t0 = time.perf_counter()
        path.write_bytes(index_bytes(table))
        write_s = time.perf_counter() - t0
        del table
        res = {"rows": n, "parquet_mb": round(path.stat().st_size / 2**20, 1), "write_s": round(write_s, 2)}
        for name, columns in (("projected", list(PLAN_COLUMNS) + ["sample_rate_hz"]), ("all_columns", None)):
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                t = pq.read_table(path, columns=columns)
                times.append(time.perf_counter() - t0)
            res[f"read_{name}_s"] = round(statistics.median(times), 3)
            res[f"read_{name}_mb"] = round(t.nbytes / 2**20, 1)
            if name == "projected":
                t0 = time.perf_counter()
                PlanIndex.from_table(t)
                res["plan_index_from_table_s"] = round(time.perf_counter() - t0, 3)
            del t
    return res


def simulate_one(n: int, world_sizes: list[int], max_batch_seconds: float, block_s: float | None,
                 sim_ranks: int, seed: int = 0) -> dict:
    """Run in a fresh interpreter: the block-level planner (load/blockplan.py) at n rows for each world size.

    Every rank runs plan_blocks on the same block table (timed once: it is the same on all ranks), then loads
    and deals only its own rows; `sim_ranks` ranks (first, last, and evenly spaced) are dealt for real, the
    others are checked at block level (every block in exactly one chunk, ws members per group = equal steps).
    Memory per rank = the block table + plan (tracemalloc peak of plan_blocks) + its rows x 70 B (the
    PlanIndex columns it would load) + the deal's peak; per node = 8 ranks. Times are taken without tracemalloc.
    """
    from shardtrain.load.blockplan import block_shape, make_blocks, plan_blocks, rank_batches
    from shardtrain.load.plan import BucketConfig

    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    dur = np.sort(np.clip(rng.lognormal(np.log(8.0), 0.6, n), 0.5, 35.0))  # as synthetic_columns
    size = (dur * 16000 * 2 * 0.55).astype(np.int64) + 1536
    block_s, block_rows = block_shape(float(dur.sum()), n, BucketConfig().batches_per_chunk, block_s)
    blocks = make_blocks(dur, size, block_s, max_batch_seconds, block_rows=block_rows)
    del size
    out: dict = {"rows": n, "blocks": len(blocks), "block_s": round(block_s, 1), "block_rows": block_rows,
                 "gen_and_block_s": round(time.perf_counter() - t0, 2),
                 "block_table_mb": round(sum(getattr(blocks, f).nbytes for f in blocks.__slots__) / 2**20, 1)}
    cfg = BucketConfig(max_batch_seconds=max_batch_seconds)
    for ws in world_sizes:
        t0 = time.perf_counter()
        plan = plan_blocks(blocks, seed=seed, epoch=1, world_size=ws, cfg=cfg)
        plan_s = time.perf_counter() - t0  # timed without tracemalloc (it slows numpy allocations several-fold)
        tracemalloc.start()
        plan_blocks(blocks, seed=seed, epoch=1, world_size=ws, cfg=cfg)
        _, plan_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        once = len(plan.seq) == len(np.unique(plan.seq)) == int((~blocks.too_long).sum())
        equal = len(plan.bounds) - 1 == len(plan.group_m) * ws  # every group has a chunk for every rank
        ranks = sorted({int(r) for r in np.linspace(0, ws - 1, min(ws, sim_ranks))})
        deal_s, rank_rows, over, deal_peak = [], [], 0, 0
        for r in ranks:
            t0 = time.perf_counter()
            batches = rank_batches(plan, blocks, lambda x: dur[x], r, seed)
            deal_s.append(time.perf_counter() - t0)
            if r == ranks[0]:
                tracemalloc.start()
                rank_batches(plan, blocks, lambda x: dur[x], r, seed)
                deal_peak = max(deal_peak, tracemalloc.get_traced_memory()[1])
                tracemalloc.stop()
            rank_rows.append(sum(len(b) for b in batches))
            over += sum(float(dur[b].sum()) > max_batch_seconds + 1e-9 for b in batches)
            equal = equal and len(batches) == plan.steps
        rows_mb = max(rank_rows) * 70 / 2**20
        per_rank_mb = out["block_table_mb"] + plan_peak / 2**20 + rows_mb + deal_peak / 2**20
        real = sum(float(dur[b].sum()) for b in batches)
        out[f"ws{ws}"] = {"plan_s": round(plan_s, 3), "deal_s": round(statistics.median(deal_s), 3),
                          "epoch_plan_s": round(plan_s + max(deal_s), 3), "steps": plan.steps,
                          "rows_per_rank": max(rank_rows), "ranks_dealt": len(ranks),
                          "plan_heap_mb": round(plan_peak / 2**20, 1), "rank_rows_mb": round(rows_mb, 1),
                          "per_rank_mb": round(per_rank_mb, 1), "per_node_mb": round(8 * per_rank_mb, 1),
                          "fill": round(real / (len(batches) * max_batch_seconds), 3), "exactly_once": bool(once),
                          "equal_steps": bool(equal), "over_budget_batches": int(over)}
        log.info("simulate %d rows ws=%d: %s", n, ws, out[f"ws{ws}"])
    return out


def simulate(args: argparse.Namespace) -> dict:
    rows = []
    for n in args.rows:
        wss = [w for w in args.world_sizes if n * 8.0 / (args.block_s or 30.0) >= 2 * w and (w > 1 or n <= 2_000_000)]
        rows.append(common.run_isolated("bench_plan_scale", "simulate_one", {
            "n": n, "world_sizes": wss, "max_batch_seconds": args.max_batch_seconds,
            "block_s": args.block_s, "sim_ranks": args.sim_ranks}, timeout_s=3600))
    table = [{"rows": f"{r['rows']:,}", "blocks": f"{r['blocks']:,}", "table": r["block_table_mb"], "ws": ws,
              **{k: r[f"ws{ws}"][k] for k in ("plan_s", "deal_s", "epoch_plan_s", "steps", "rows_per_rank",
                                              "per_node_mb", "fill", "exactly_once", "equal_steps",
                                              "over_budget_batches", "ranks_dealt")}}
             for r in rows for ws in args.world_sizes if f"ws{ws}" in r]
    md = common.markdown_table(table, [
        ("rows", "index rows"), ("blocks", "blocks"), ("table", "block table MB"), ("ws", "ranks"),
        ("plan_s", "plan_blocks s"), ("deal_s", "rank deal s"), ("epoch_plan_s", "plan per epoch s"),
        ("steps", "steps"), ("rows_per_rank", "rows per rank"), ("per_node_mb", "planning MB per node (8 ranks)"),
        ("fill", "batch fill"), ("exactly_once", "exactly once"), ("equal_steps", "equal steps"),
        ("over_budget_batches", "over budget"), ("ranks_dealt", "ranks dealt")])
    result = {"benchmark": "bench_plan_scale --simulate", "git_sha": common.git_sha(), "machine": common.machine(),
              "config": vars(args), "simulate": rows}
    out_dir = Path(args.out_dir)
    common.write_json(out_dir / "plan_scale_simulate.json", result)
    (out_dir / "plan_scale_simulate.md").write_text(md + "\n")
    print(md)
    print(common.json_line({"git_sha": result["git_sha"], "simulate": rows}))
    return result


def main(args: argparse.Namespace) -> dict:
    if args.simulate:
        return simulate(args)
    work = Path(args.work_dir)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan_rows = []
    for n in args.rows:
        r = common.run_isolated("bench_plan_scale", "plan_scale_one",
                                {"n": n, "world_sizes": args.world_sizes, "max_batch_seconds": args.max_batch_seconds,
                                 "repeats": args.repeats})
        log.info("plan %d rows: %s", n, r)
        plan_rows.append(r)
    idx_read = common.run_isolated("bench_plan_scale", "index_read_one", {"n": max(args.rows)})
    log.info("index read: %s", idx_read)
    audio_rows = []
    for n in args.audio_sizes:
        corpus = common.prepare_corpus(work, n, kind=args.corpus)
        ds = common.prepare_dataset(work, corpus)
        r = common.run_isolated("bench_loader", "run_shardtrain",
                                {"url": str(ds), "workers": 0, "max_batch_seconds": args.max_batch_seconds})
        audio_rows.append({"utterances": n, **{k: r[k] for k in ("audio_seconds", "audio_s_per_s", "samples_per_s",
                                                                  "first_batch_s", "peak_rss_mb", "batches",
                                                                  "padding_efficiency")}})
        log.info("loader %d utterances: %s", n, audio_rows[-1])

    t1 = common.markdown_table(
        [{"rows": f"{r['rows']:,}", "hours": r["audio_hours"], "index_mb": r["index_mb"],
          **{f"plan{ws}": f"{r[f'ws{ws}']['plan_s']:.3f}" for ws in args.world_sizes},
          **{f"heap{ws}": r[f"ws{ws}"]["heap_peak_mb"] for ws in args.world_sizes},
          **{f"steps{ws}": r[f"ws{ws}"]["steps"] for ws in args.world_sizes},
          "rss": r["peak_rss_growth_mb"]} for r in plan_rows],
        [("rows", "index rows"), ("hours", "audio h"), ("index_mb", "PlanIndex MB"),
         *[(f"plan{ws}", f"plan s (ws={ws})") for ws in args.world_sizes],
         *[(f"heap{ws}", f"plan heap peak MB (ws={ws})") for ws in args.world_sizes],
         *[(f"steps{ws}", f"steps (ws={ws})") for ws in args.world_sizes], ("rss", "peak RSS growth MB")])
    t2 = common.markdown_table(
        [{"what": "projected (planner columns + sample_rate_hz)", "s": idx_read["read_projected_s"],
          "mb": idx_read["read_projected_mb"]},
         {"what": "all 17 columns", "s": idx_read["read_all_columns_s"], "mb": idx_read["read_all_columns_mb"]},
         {"what": "PlanIndex.from_table (projected)", "s": idx_read["plan_index_from_table_s"], "mb": "-"}],
        [("what", f"read index.parquet, {idx_read['rows']:,} rows ({idx_read['parquet_mb']} MB on disk)"),
         ("s", "seconds"), ("mb", "Arrow MB in memory")])
    t3 = common.markdown_table(
        [{**r, "utterances": f"{r['utterances']:,}", "audio_seconds": f"{r['audio_seconds']:,.0f}",
          "audio_s_per_s": f"{r['audio_s_per_s']:,.0f}", "samples_per_s": f"{r['samples_per_s']:,.0f}",
          "padding_efficiency": f"{r['padding_efficiency']:.2f}", "first_batch_s": f"{r['first_batch_s']:.2f}",
          "peak_rss_mb": f"{r['peak_rss_mb']:,.0f}"} for r in audio_rows],
        [("utterances", "utterances"), ("audio_seconds", "audio s"), ("audio_s_per_s", "audio-s/s"),
         ("samples_per_s", "samples/s"), ("padding_efficiency", "padding eff."), ("first_batch_s", "first batch s"),
         ("peak_rss_mb", "peak RSS MB")])
    md = "\n\n".join([t1, t2, t3])
    result = {"benchmark": "bench_plan_scale", "git_sha": common.git_sha(), "machine": common.machine(),
              "config": vars(args), "plan": plan_rows, "index_read": idx_read, "loader": audio_rows}
    common.write_json(out_dir / "plan_scale.json", result)
    (out_dir / "plan_scale.md").write_text(md + "\n")
    print(md)
    print(common.json_line({"git_sha": result["git_sha"], "config": result["config"],
                            "plan_s": {r["rows"]: {ws: r[f"ws{ws}"]["plan_s"] for ws in args.world_sizes}
                                       for r in plan_rows}}))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--audio-sizes", type=int, nargs="+", default=[1000, 4000], help="real-audio corpus sizes")
    ap.add_argument("--corpus", choices=["speech", "tone"], default="speech")
    ap.add_argument("--max-batch-seconds", type=float, default=300.0)
    ap.add_argument("--repeats", type=int, default=3, help="plan_epoch timings per size (median, min, max)")
    ap.add_argument("--work-dir", default=str(common.DEFAULT_WORK_DIR))
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--quick", action="store_true", help="1k-100k rows, 400 utterances of audio")
    ap.add_argument("--simulate", action="store_true",
                    help="the block-level planner (load/blockplan.py) for --rows x --world-sizes; defaults 1k..100M "
                         "rows and 1..1,024 ranks")
    ap.add_argument("--block-s", type=float, default=None,
                    help="audio seconds per block for --simulate (default: the Loader's, blockplan.block_shape)")
    ap.add_argument("--sim-ranks", type=int, default=3, help="ranks per world size whose rows are dealt for real")
    args = ap.parse_args(argv)
    if args.out_dir is None:
        args.out_dir = str(common.BENCH_DIR / "results" / ("quick" if args.quick else ""))
    if args.quick:
        args.rows, args.audio_sizes, args.repeats = [r for r in args.rows if r <= 100_000], [400], 1
    if args.simulate and "--rows" not in (argv or sys.argv):
        args.rows = [1_000, 100_000, 1_000_000, 10_000_000, 100_000_000]
    if args.simulate and "--world-sizes" not in (argv or sys.argv):
        args.world_sizes = [1, 8, 64, 1024]
    return args


if __name__ == "__main__":
    common.setup_logging()
    main(parse_args())
