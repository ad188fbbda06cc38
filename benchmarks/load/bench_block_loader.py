"""The Loader at scale: `stream.planner` rows vs blocks through the Loader's own code path.

    synthetic dataset of N rows: index.parquet with every column (INDEX_SCHEMA, 131k-row groups, keys and
    LibriSpeech-length transcripts) + manifest.json with its ~256 MB shards; no audio (planning never reads it)
      -> cold map: open_mapped (index.parquet -> node-local memory map, once per node): wall s, peak RSS
      -> per planner, one node: ranks 0..R-1 of a --world-size world as concurrent processes, each
           build_loader + its first chunk scheduled (time to first batch, less that batch's read and decode),
           then the rest of its epoch-0 schedule (plan + deal per epoch), then a barrier and the memory reading:
           PSS per process summed over the node (map pages shared by the ranks counted once), minus each
           process's PSS after imports (torch), and its peak RSS
    real audio (the 4k espeak corpus of bench_loader, cached in --work-dir): one epoch in-process per planner:
      first batch s, audio-s/s, padding, batches

The rows planner is run with --rows-ranks processes (default 1: at 10M rows one rank holds ~2 GB); its node
figure is that rank's growth x ranks per node, which the table says. Run:

    .venv/bin/python -m benchmarks.load.bench_block_loader                       # 1M and 10M rows
    .venv/bin/python -m benchmarks.load.bench_block_loader --rows 30000000 --no-audio
    .venv/bin/python -m benchmarks.load.bench_block_loader --variety 200000 1000000   # batch variety
"""
from __future__ import annotations

import argparse
import json
import logging
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import common
from benchmarks.load.bench_plan_scale import synthetic_columns

log = logging.getLogger("bench")
TEXT = "he hoped there would be stew for dinner turnips and carrots and bruised potatoes and fat mutton pieces"


def write_dataset(folder: Path, n: int) -> str:
    """index.parquet + manifest.json of n synthetic rows (written once per n, reused)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardtrain.format.manifest import INDEX_SCHEMA, ROW_GROUP, shard_name

    if (folder / "manifest.json").exists():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cols = synthetic_columns(n)
    with pq.ParquetWriter(folder / "index.parquet", INDEX_SCHEMA, compression="zstd") as w:
        for a in range(0, n, ROW_GROUP):
            b = min(n, a + ROW_GROUP)
            keys = np.char.add("spk-chapter-utt", np.char.zfill(np.arange(a, b).astype("U9"), 9))
            part = {k: v[a:b] for k, v in cols.items()}
            w.write_table(pa.table({
                **part, "key": pa.array(keys), "codec": pa.array(np.full(b - a, "flac")),
                "sample_rate_hz": np.full(b - a, 16000, np.int32), "text": pa.array(np.full(b - a, TEXT)),
                "speaker": pa.array(np.full(b - a, "spk")), "language": pa.array(np.full(b - a, "en")),
                "source": pa.array(keys)}).select(INDEX_SCHEMA.names).cast(INDEX_SCHEMA))
    shard, end, dur = cols["shard"], cols["offset"] + cols["size"], cols["duration_s"]
    shards = []
    for s in range(int(shard.max()) + 1):
        m = shard == s
        shards.append({"name": shard_name(s), "samples": int(m.sum()), "seconds": float(dur[m].sum()),
                       "min_duration_s": float(dur[m].min()), "max_duration_s": float(dur[m].max()),
                       "bytes": int(end[m].max()), "sha256": "0" * 64})
    manifest = {"format": "shardtrain", "format_version": 1, "index": "index.parquet", "shards": shards,
                "totals": {"samples": n, "seconds": float(dur.sum()), "bytes": int(sum(s["bytes"] for s in shards)),
                           "shards": len(shards), "rejects": 0}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return str(folder)


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def map_cold(url: str, cache: str) -> dict:
    """Fresh interpreter: the once-per-node build of the memory map."""
    from shardtrain.format.manifest import open_dataset
    from shardtrain.load.mapped import open_mapped

    shutil.rmtree(cache, ignore_errors=True)
    base = _maxrss_mb()
    t0 = time.perf_counter()
    mi = open_mapped(open_dataset(url), cache, text=True)
    wall = time.perf_counter() - t0
    disk = sum(p.stat().st_size for p in mi.folder.iterdir())
    return {"map_s": round(wall, 2), "map_peak_rss_growth_mb": round(_maxrss_mb() - base, 1),
            "map_disk_mb": round(disk / 2**20, 1)}


def rank_run(url: str, planner: str, world_size: int, rank: int, cache: str, barrier: str, ranks: int) -> dict:
    """One rank: Loader start-up to its first chunk, then its epoch-0 schedule; memory read at a node barrier."""
    import psutil
    import pyarrow.compute  # noqa: F401 - imported lazily by the index checks: not planning memory
    import pyarrow.parquet  # noqa: F401

    from shardtrain.load.config import StreamConfig
    from shardtrain.load.loader import build_loader
    from shardtrain.world import World

    proc = psutil.Process()
    pss0 = proc.memory_full_info().pss
    t0, c0 = time.perf_counter(), time.process_time()
    loader = build_loader(url, world=World(rank=rank, world_size=world_size), seed=0,
                          cfg=StreamConfig(planner=planner, index_cache_dir=cache, epochs=1))
    sched = loader.planner.epoch(0, world_size).chunks(rank)  # the planner seam: what this rank reads
    first = next(sched).chunk
    first_s, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    batches, rows = len(first.batches), len(first.rows)
    t1 = time.perf_counter()
    for rc in sched:
        batches += len(rc.chunk.batches)
        rows += len(rc.chunk.rows)
    epoch_s = time.perf_counter() - t1 + first_s
    Path(barrier, f"{rank}").touch()
    deadline = time.time() + 600
    while len(list(Path(barrier).iterdir())) < ranks and time.time() < deadline:
        time.sleep(0.05)
    mem = proc.memory_full_info()
    time.sleep(1.0)  # every rank reads its memory while all are alive
    return {"rank": rank, "first_chunk_s": round(first_s, 3), "first_chunk_cpu_s": round(first_cpu, 3),
            "epoch_schedule_s": round(epoch_s, 2),
            "steps": batches, "rows": rows, "pss_growth_mb": round((mem.pss - pss0) / 2**20, 1),
            "uss_mb": round(mem.uss / 2**20, 1), "peak_rss_mb": round(_maxrss_mb(), 1)}


def node_run(url: str, planner: str, world_size: int, ranks: int, cache: str, work: Path) -> dict:
    """`ranks` concurrent rank processes (ranks 0..ranks-1) of a world_size world: one node."""
    barrier = work / f"barrier-{planner}-{time.time_ns()}"
    barrier.mkdir()
    code = ("import sys, json; import benchmarks.load.bench_block_loader as m; "
            "print('@@RESULT@@' + json.dumps(m.rank_run(**json.loads(sys.argv[1]))))")
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps(
        {"url": url, "planner": planner, "world_size": world_size, "rank": r, "cache": cache,
         "barrier": str(barrier), "ranks": ranks})], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=str(common.REPO), env=common.subprocess_env()) for r in range(ranks)]
    out = []
    for p in procs:
        so, se = p.communicate(timeout=1800)
        line = next((x for x in reversed(so.splitlines()) if x.startswith("@@RESULT@@")), None)
        if line is None:
            raise RuntimeError(f"rank process failed (rc {p.returncode}): {se[-2000:]}")
        out.append(json.loads(line[len("@@RESULT@@"):]))
    shutil.rmtree(barrier, ignore_errors=True)
    return {"planner": planner, "ranks": ranks, "world_size": world_size,
            "first_chunk_s": max(r["first_chunk_s"] for r in out),
            "first_chunk_cpu_s": max(r["first_chunk_cpu_s"] for r in out),
            "epoch_schedule_s": max(r["epoch_schedule_s"] for r in out), "steps": out[0]["steps"],
            "rows_rank0": out[0]["rows"], "node_pss_growth_mb": round(sum(r["pss_growth_mb"] for r in out), 1),
            "max_peak_rss_mb": max(r["peak_rss_mb"] for r in out), "per_rank": out}


def audio_epoch(url: str, planner: str, cache: str, max_batch_seconds: float) -> dict:
    """Fresh interpreter: one epoch of the real loader on the 4k corpus with this planner (in-process decode)."""
    from shardtrain.load.bench import BenchConfig, bench_loader
    from shardtrain.load.config import StreamConfig
    from shardtrain.load.plan import BucketConfig
    from shardtrain.world import World

    stream = StreamConfig(bucket=BucketConfig(max_batch_seconds=max_batch_seconds), planner=planner,
                          index_cache_dir=cache)
    r = bench_loader(url, world=World(), seed=0, stream=stream, bench=BenchConfig(epochs=1))
    return {k: r[k] for k in ("first_batch_s", "audio_s_per_s", "padding_efficiency", "batches", "audio_seconds")}


def block_epochs(n: int, world_size: int, epochs: int, max_batch_seconds: float, seed: int = 0) -> dict:
    """Fresh interpreter: batch variety of the block planner on n synthetic rows (metadata only, all ranks dealt):
    pair repeat rate across consecutive epochs, against a uniform shuffle inside the same buckets split into the
    same number of batches, and against the rows planner (plan_epoch) on the same rows; padding and fill."""
    from benchmarks.load.bench_shuffle import padding_stats, repeat_stats

    from shardtrain.load.blockplan import block_shape, make_blocks, plan_blocks, rank_batches
    from shardtrain.load.plan import BucketConfig, PlanIndex, plan_epoch

    cols = synthetic_columns(n, seed)
    dur = cols["duration_s"]
    cfg = BucketConfig(max_batch_seconds=max_batch_seconds)
    block_s, block_rows = block_shape(float(dur.sum()), n, cfg.batches_per_chunk)
    blocks = make_blocks(dur, cols["size"], block_s, max_batch_seconds, block_rows=block_rows)
    sched: dict[str, list[list[np.ndarray]]] = {"blocks": [], "uniform in the same buckets": [],
                                                "rows (plan_epoch)": []}
    idx = PlanIndex(**cols)
    for e in range(epochs):
        plan = plan_blocks(blocks, seed=seed, epoch=e, world_size=world_size, cfg=cfg)
        batches = [b for r in range(world_size) for b in rank_batches(plan, blocks, lambda x: dur[x], r, seed)]
        sched["blocks"].append(batches)
        row_bucket = np.repeat(plan.bucket, blocks.rows)  # the bucket of every row, through its block
        per_bucket = np.bincount([row_bucket[b[0]] for b in batches if len(b)])
        rng = np.random.default_rng([seed, e, 99])
        sched["uniform in the same buckets"].append(
            [p for k, m in enumerate(per_bucket) if m for p in np.array_split(rng.permutation(
                np.flatnonzero(row_bucket == k)), m)])
        rp = plan_epoch(idx, seed=seed, epoch=e, world_size=world_size, cfg=cfg)
        sched["rows (plan_epoch)"].append([b for g in rp.groups for c in g for b in c.batches])
    out = {"rows": n, "world_size": world_size, "block_s": round(block_s, 1), "block_rows": block_rows,
           "blocks": len(blocks)}
    for name, eps in sched.items():
        out[name] = {**repeat_stats(eps, n), **padding_stats(eps[0], dur),
                     "fill": round(float(sum(dur[b].sum() for b in eps[0])) / (len(eps[0]) * max_batch_seconds), 3)}
    return out


def main(args: argparse.Namespace) -> dict:
    if args.variety:
        return variety(args)
    work = Path(args.work_dir)
    cache = str(work / "index-map")
    rows_out, audio_out = [], []
    for n in args.rows:
        url = write_dataset(work / f"synthetic-index-{n}", n)
        cold = common.run_isolated("bench_block_loader", "map_cold", {"url": url, "cache": cache}, timeout_s=3600)
        log.info("%d rows, cold map: %s", n, cold)
        for planner, ranks in (("blocks", args.ranks_per_node), ("rows", args.rows_ranks)):
            r = node_run(url, planner, args.world_size, ranks, cache, work)
            node_mb = r["node_pss_growth_mb"] * (args.ranks_per_node / ranks)
            rows_out.append({"rows": n, **cold, **{k: v for k, v in r.items() if k != "per_rank"},
                             "node_mb": round(node_mb, 1), "node_mb_how": "measured" if ranks == args.ranks_per_node
                             else f"{ranks} rank(s) x {args.ranks_per_node / ranks:g}"})
            log.info("%d rows, %s: %s", n, planner, rows_out[-1])
    if not args.no_audio:
        corpus = common.prepare_corpus(work, 4000, kind="speech")
        ds = common.prepare_dataset(work, corpus)
        for planner in ("rows", "blocks", "rows", "blocks"):  # alternating, warm map
            audio_out.append({"planner": planner, **common.run_isolated("bench_block_loader", "audio_epoch", {
                "url": str(ds), "planner": planner, "cache": cache, "max_batch_seconds": args.max_batch_seconds})})
            log.info("audio: %s", audio_out[-1])
    md = common.markdown_table(rows_out, [
        ("rows", "index rows"), ("planner", "planner"), ("world_size", "world size"), ("ranks", "ranks run"),
        ("first_chunk_s", "start to first chunk s"), ("first_chunk_cpu_s", "of it CPU s (rank's own)"),
        ("epoch_schedule_s", "plan+deal per epoch s"),
        ("steps", "steps"), ("node_mb", "planning MB per node (8 ranks)"), ("node_mb_how", "node figure"),
        ("max_peak_rss_mb", "peak RSS per rank MB"), ("map_s", "map build s (once per node)"),
        ("map_disk_mb", "map on disk MB")])
    if audio_out:
        md += "\n\n" + common.markdown_table(audio_out, [
            ("planner", "planner (4k espeak corpus, 1 epoch)"), ("first_batch_s", "first batch s"),
            ("audio_s_per_s", "audio-s/s"), ("padding_efficiency", "padding"), ("batches", "batches")])
    result = {"benchmark": "bench_block_loader", "git_sha": common.git_sha(), "machine": common.machine(),
              "config": vars(args), "scale": rows_out, "audio": audio_out}
    out_dir = Path(args.out_dir)
    common.write_json(out_dir / "block_loader.json", result)
    (out_dir / "block_loader.md").write_text(md + "\n")
    print(md)
    print(common.json_line({"git_sha": result["git_sha"], "scale": [{k: r[k] for k in (
        "rows", "planner", "first_chunk_s", "epoch_schedule_s", "node_mb")} for r in rows_out]}))
    return result


def variety(args: argparse.Namespace) -> dict:
    rows = [common.run_isolated("bench_block_loader", "block_epochs", {
        "n": n, "world_size": args.variety_world_size, "epochs": 3, "max_batch_seconds": args.max_batch_seconds},
        timeout_s=3600) for n in args.variety]
    table = [{"rows": f"{r['rows']:,}", "block_s": r["block_s"], "sampler": name, **r[name],
              "x_uniform": round(r[name]["pair_repeat_rate"] / max(r["uniform in the same buckets"]["pair_repeat_rate"],
                                                                   1e-12), 2)}
             for r in rows for name in ("blocks", "uniform in the same buckets", "rows (plan_epoch)")]
    md = common.markdown_table(table, [
        ("rows", "rows"), ("block_s", "block s"), ("sampler", "sampler"), ("pair_repeat_rate", "pair repeat rate"),
        ("x_uniform", "x uniform in-bucket"), ("padding_efficiency", "padding"), ("fill", "batch fill"),
        ("batches", "batches")])
    result = {"benchmark": "bench_block_loader --variety", "git_sha": common.git_sha(), "config": vars(args),
              "variety": rows}
    common.write_json(Path(args.out_dir) / "block_variety.json", result)
    print(md)
    print(common.json_line({"git_sha": result["git_sha"], "variety": table}))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--world-size", type=int, default=1024)
    ap.add_argument("--ranks-per-node", type=int, default=8, help="concurrent rank processes for the blocks planner")
    ap.add_argument("--rows-ranks", type=int, default=1, help="concurrent rank processes for the rows planner")
    ap.add_argument("--max-batch-seconds", type=float, default=300.0)
    ap.add_argument("--no-audio", action="store_true", help="skip the real-audio first-batch comparison")
    ap.add_argument("--variety", type=int, nargs="*", default=None,
                    help="batch variety of the block planner instead, for these row counts (metadata only)")
    ap.add_argument("--variety-world-size", type=int, default=8)
    ap.add_argument("--work-dir", default=str(common.DEFAULT_WORK_DIR))
    ap.add_argument("--out-dir", default=str(common.BENCH_DIR / "results"))
    return ap.parse_args(argv)


if __name__ == "__main__":
    common.setup_logging()
    main(parse_args())
