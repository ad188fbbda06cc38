"""Shuffle quality: how much batch composition changes between epochs, beside padding and read size.

    index of a packed corpus (default: the 4,000-utterance espeak-ng benchmark corpus, cached in --work-dir)
      -> shardtrain plans for epochs 0..E-1 (plan_epoch, world size --world-size; metadata only, no audio)
      -> the same epochs for: the uniform in-bucket reference (every bucket of shardtrain's plan shuffled
         uniformly and split into the same number of batches), shardtrain without mixing (run_mb=0: contiguous
         chunks), and lhotse DynamicBucketingSampler (dummy cuts with the same durations)
      -> pair repeat rate: of the utterance pairs sharing a batch in epoch e, the share sharing one again in e+1
         (mean over consecutive epochs); identical batches; padding efficiency (real / padded audio); audio s per
         batch; reads per batch and MB per read (shardtrain's byte runs, the reader's 1 MB gap merging)

The repeat rate of a uniform shuffle inside a bucket of N utterances dealt into batches of B is about B / N; it
is the floor any sampler that keeps the same buckets can reach. Run:

    .venv/bin/python -m benchmarks.load.bench_shuffle                    # 4k speech corpus (packs it once)
    .venv/bin/python -m benchmarks.load.bench_shuffle --synthetic 1000000 --no-lhotse   # scale
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks import common

log = logging.getLogger("bench")


def pair_codes(batches: list[np.ndarray], n: int) -> np.ndarray:
    """Every unordered pair of rows sharing a batch, encoded as lo * n + hi (sorted, unique)."""
    out = []
    for b in batches:
        if len(b) < 2:
            continue
        b = np.sort(np.asarray(b, np.int64))
        i, j = np.triu_indices(len(b), 1)
        out.append(b[i] * n + b[j])
    return np.unique(np.concatenate(out)) if out else np.zeros(0, np.int64)


def repeat_stats(epochs: list[list[np.ndarray]], n: int) -> dict:
    """Pair repeat rate and identical-batch rate between consecutive epochs (means over the epoch pairs)."""
    rates, same = [], []
    codes = [pair_codes(e, n) for e in epochs]
    for a, b, ea, eb in zip(codes, codes[1:], epochs, epochs[1:]):
        rates.append(float(np.isin(a, b, assume_unique=True).mean()) if len(a) else 0.0)
        kb = {tuple(np.sort(x).tolist()) for x in eb}
        same.append(float(np.mean([tuple(np.sort(x).tolist()) in kb for x in ea])))
    # 6 decimals: at 1M rows a uniform shuffle repeats ~0.1% of pairs, and the ratio to it is what matters
    return {"pair_repeat_rate": round(float(np.mean(rates)), 6), "identical_batches": round(float(np.mean(same)), 4)}


def padding_stats(batches: list[np.ndarray], dur: np.ndarray) -> dict:
    full = [b for b in batches if len(b)]
    real = sum(float(dur[b].sum()) for b in full)
    padded = sum(float(dur[b].max()) * len(b) for b in full)
    return {"padding_efficiency": round(real / padded, 4), "batch_audio_s": round(real / len(full), 1),
            "batches": len(full)}


def plan_batches(idx, cfg, epoch: int, world_size: int, seed: int) -> tuple[list[np.ndarray], dict]:
    """All ranks' batches of one epoch in step order, plus read statistics of its chunks."""
    from shardtrain.load.plan import plan_epoch
    from shardtrain.load.reader import _byte_runs

    plan = plan_epoch(idx, seed=seed, epoch=epoch, world_size=world_size, cfg=cfg)
    batches = [b for g in plan.groups for c in g for b in c.batches]
    runs = [r for g in plan.groups for c in g for r in _byte_runs(idx, c.rows)]
    nbytes = sum(e - s for _, s, e in runs)
    return batches, {"reads_per_batch": round(len(runs) / max(1, len(batches)), 2),
                     "mb_per_read": round(nbytes / max(1, len(runs)) / 1e6, 2), "steps": plan.steps}


def uniform_reference(idx, cfg, epochs: int, world_size: int, seed: int) -> list[list[np.ndarray]]:
    """Each of shardtrain's buckets shuffled uniformly per epoch and split into as many batches as shardtrain
    makes from it (same buckets, same batch sizes: only the composition rule differs)."""
    from shardtrain.load.padding import bucket_phase
    from shardtrain.load.plan import _bucket_ranges, cost_s

    dur = idx.duration_s
    keep = np.flatnonzero(cost_s(dur, cfg) <= cfg.max_batch_seconds)
    rows = keep[np.argsort(dur[keep], kind="stable")]
    out = []
    for e in range(epochs):
        buckets = _bucket_ranges(rows, dur, cfg, world_size, bucket_phase(seed, e))  # the edges move every epoch
        bucket_of = np.empty(len(dur), np.int64)
        for i, b in enumerate(buckets):
            bucket_of[b] = i
        batches, _ = plan_batches(idx, cfg, e, world_size, seed)
        per_bucket = np.bincount([bucket_of[b[0]] for b in batches if len(b)], minlength=len(buckets))
        rng = np.random.default_rng([seed, e, 99])
        out.append([p for b, m in zip(buckets, per_bucket) if m
                    for p in np.array_split(b[rng.permutation(len(b))], m)])
    return out


def fixed_reference(idx, cfg, epochs: int, seed: int) -> list[list[np.ndarray]]:
    """The reference that does not move with the planner: `cfg.num_buckets` equal-audio buckets (lhotse's
    DynamicBucketingSampler default, and shardtrain's buckets before whole-batch buckets), each shuffled
    uniformly per epoch and split into ceil(its cost / budget) batches. A planner cannot look varied against it
    by narrowing its own buckets."""
    from shardtrain.load.plan import cost_s, estimate_bins

    dur = idx.duration_s
    keep = np.flatnonzero(cost_s(dur, cfg) <= cfg.max_batch_seconds)
    rows = keep[np.argsort(dur[keep], kind="stable")]
    ids = np.searchsorted(estimate_bins(dur[rows], cfg.num_buckets), dur[rows], side="right")
    buckets = np.split(rows, np.flatnonzero(np.diff(ids)) + 1)
    per = [max(1, int(np.ceil(float(cost_s(dur[b], cfg).sum()) / cfg.max_batch_seconds))) for b in buckets]
    return [[p for b, m in zip(buckets, per) for p in np.array_split(b[np.random.default_rng([seed, e, 98])
                                                                        .permutation(len(b))], m)]
            for e in range(epochs)]


def variety(idx, cfg, epochs: int, world_size: int, seed: int) -> dict:
    """Pair repeat rate of shardtrain's plans beside both references (its own buckets, and fixed buckets)."""
    n = len(idx)
    ours = repeat_stats([plan_batches(idx, cfg, e, world_size, seed)[0] for e in range(epochs)], n)
    own = repeat_stats(uniform_reference(idx, cfg, epochs, world_size, seed), n)
    fixed = repeat_stats(fixed_reference(idx, cfg, epochs, seed), n)
    rate = ours["pair_repeat_rate"]
    return {"pair_repeat_rate": rate, "uniform_own_buckets": own["pair_repeat_rate"],
            "uniform_fixed_buckets": fixed["pair_repeat_rate"],
            "x_uniform_own_buckets": round(rate / own["pair_repeat_rate"], 3) if own["pair_repeat_rate"] else None,
            "x_uniform_fixed_buckets": round(rate / fixed["pair_repeat_rate"], 3) if fixed["pair_repeat_rate"] else None}


def lhotse_epochs(dur: np.ndarray, epochs: int, max_batch_seconds: float, num_buckets: int,
                  seed: int) -> list[list[np.ndarray]]:
    """lhotse DynamicBucketingSampler over dummy cuts with the corpus's durations (no audio is read)."""
    from lhotse import CutSet
    from lhotse.dataset import DynamicBucketingSampler
    from lhotse.testing.dummies import dummy_cut

    cuts = CutSet.from_cuts(dummy_cut(i, duration=float(d), recording_duration=float(d)) for i, d in enumerate(dur))
    sampler = DynamicBucketingSampler(cuts, max_duration=max_batch_seconds, num_buckets=num_buckets, shuffle=True,
                                      seed=seed)
    out = []
    for e in range(epochs):
        sampler.set_epoch(e)
        out.append([np.array([int(c.id.split("-")[-1]) for c in b]) for b in sampler])
    return out


def loader_run(url: str, max_batch_seconds: float, epochs: int, bucket: dict | None = None,
               stream: dict | None = None, storage_options: dict | None = None) -> dict:
    """Run in a fresh interpreter: `epochs` of the real loader (one rank, default threads; local disk, or S3
    with `storage_options`), with `bucket` / `stream` fields set over the defaults of the checkout it runs in
    (empty for another tree's shipped defaults, whatever fields that tree has)."""
    import shardtrain
    from shardtrain.load.bench import BenchConfig, bench_loader
    from shardtrain.load.config import StreamConfig
    from shardtrain.load.plan import BucketConfig
    from shardtrain.world import World

    cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=max_batch_seconds, **(bucket or {})), **(stream or {}))
    cpu0 = _cpu_s()
    out = bench_loader(url, world=World(), seed=0, stream=cfg, bench=BenchConfig(epochs=epochs),
                       storage_options=storage_options)
    cpu = _cpu_s() - cpu0  # every thread of this process and its reaped children (DataLoader workers)
    return {**out, "shardtrain_from": str(Path(shardtrain.__file__).parent.parent), "cpu_seconds": round(cpu, 3), "audio_s_per_cpu_s": round(out["audio_seconds"] / max(cpu, 1e-9), 1)}


def _cpu_s() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """'LABEL:field=value,...' -> (label, BucketConfig fields, StreamConfig fields); values are Python literals
    (run_mb=0, check_transcripts=False, min_run_mb=1.0)."""
    import ast

    from shardtrain.load.plan import BucketConfig

    label, _, spec = text.partition(":")
    bucket, stream = {}, {}
    for item in filter(None, spec.split(",")):
        k, _, v = item.partition("=")
        (bucket if k in BucketConfig.__dataclass_fields__ else stream)[k.strip()] = ast.literal_eval(v.strip())
    return label, bucket, stream


def throughput(ds: str, args: argparse.Namespace, url: str, storage_options: dict | None) -> list[dict]:
    """Loaders alternated --repeats times (the order reversed every other repeat) beside the decode-only limit
    (all cores, no batching) of the same shards: this checkout's default, its run_mb=0 planner (contiguous chunks),
    each --variant of this checkout, and the default loader of each --baseline-tree (another checkout's
    `shardtrain` first on PYTHONPATH: an A/B against an older commit on the same corpus in one run).
    `url`/`storage_options`: where the loaders read (the dataset itself, or its copy on a local SeaweedFS)."""
    k = args.loader_batches_per_chunk
    loaders: list[tuple[str, dict, dict, str | None]] = [
        ("shardtrain (default)", {"batches_per_chunk": k} if k else {}, {}, None)]
    if not args.no_contiguous:
        loaders.append(("shardtrain run_mb=0 (contiguous chunks)", {"run_mb": 0.0, "batches_per_chunk": 1}, {}, None))
    vt = str(args.variant_tree) if args.variant_tree else None
    loaders += [(label, b, s, vt) for label, b, s in map(parse_variant, args.variant)]
    loaders += [(f"default of {t}", {}, {}, str(t)) for t in args.baseline_tree]
    runs: dict[str, list[dict]] = {label: [] for label, *_ in loaders}
    runs["decode-only limit"] = []
    for rep in range(args.repeats):
        for label, bucket, stream, tree in (loaders if rep % 2 == 0 else loaders[::-1]):  # alternate the order
            runs[label].append(common.run_isolated("bench_shuffle", "loader_run", {
                "url": url, "max_batch_seconds": args.max_batch_seconds, "epochs": args.loader_epochs,
                "bucket": bucket, "stream": stream, "storage_options": storage_options},
                env={"PYTHONPATH": tree} if tree else None, cwd=tree))
            log.info("%s: %s audio-s/s", label, runs[label][-1]["audio_s_per_s"])
        runs["decode-only limit"].append(common.run_isolated("bench_loader", "run_decode_limit", {
            "paths": common.shard_paths(Path(ds)), "processes": 2, "epochs": args.loader_epochs}))
    out = []
    for label, rs in runs.items():
        agg = common.aggregate(rs, ("audio_s_per_s", "audio_s_per_cpu_s", "first_batch_s", "peak_rss_mb",
                                    "padding_efficiency", "batch_audio_s"))
        out.append({"loader": label, **{k: common.fmt_stat(v, {"first_batch_s": 2, "padding_efficiency": 3}.get(k, 0))
                                         for k, v in agg.items()}, "runs": rs})
    # per repeat: each loader over the decode limit of the same repeat, then the median of those ratios
    lims = [r["audio_s_per_s"] for r in runs["decode-only limit"]]
    for row, rs in zip(out, runs.values()):
        ratios = [r["audio_s_per_s"] / lim for r, lim in zip(rs, lims)]
        row["of_decode_limit"] = f"{statistics.median(ratios):.0%} ({min(ratios):.0%}-{max(ratios):.0%})"
        cpu = [r["audio_s_per_cpu_s"] / lim["audio_s_per_cpu_s"] for r, lim in zip(rs, runs["decode-only limit"])]
        row["cpu_of_decode_limit"] = f"{statistics.median(cpu):.0%} ({min(cpu):.0%}-{max(cpu):.0%})"
    return out


def throughput_on(ds: str, args: argparse.Namespace) -> list[dict]:
    """throughput() on local disk, or with --s3 on a copy uploaded to a SeaweedFS server on loopback."""
    if not args.s3:
        return throughput(ds, args, ds, None)
    import tempfile

    from shardtrain.testing.s3server import LocalS3

    with tempfile.TemporaryDirectory(prefix="s3-", dir=args.work_dir) as tmp:
        s3 = LocalS3(Path(tmp) / "data").start()
        try:
            url = common.upload_dir(s3, Path(ds), "bench", "ds")
            return throughput(ds, args, url, s3.storage_options)
        finally:
            s3.stop()


def load_index(args: argparse.Namespace):
    from shardtrain.load.plan import PLAN_COLUMNS, PlanIndex

    if args.synthetic:
        from benchmarks.load import bench_plan_scale

        return PlanIndex(**bench_plan_scale.synthetic_columns(args.synthetic, args.seed)), f"synthetic-{args.synthetic}"
    ds = Path(args.dataset) if args.dataset else common.prepare_dataset(
        args.work_dir, common.prepare_corpus(args.work_dir, args.utterances))
    from shardtrain.format.manifest import open_dataset

    table = open_dataset(str(ds)).read_index(columns=list(PLAN_COLUMNS))
    return PlanIndex.from_table(table), str(ds)


def measure(args: argparse.Namespace) -> dict:
    from shardtrain.load.plan import BucketConfig

    idx, name = load_index(args)
    n, dur = len(idx), idx.duration_s
    base = BucketConfig(max_batch_seconds=args.max_batch_seconds)
    rows = []

    def add(label: str, epochs: list[list[np.ndarray]], extra: dict | None = None) -> None:
        rows.append({"sampler": label, **repeat_stats(epochs, n), **padding_stats(epochs[0], dur), **(extra or {})})
        log.info("%s", rows[-1])

    configs = [("shardtrain (default)", base),
               ("shardtrain run_mb=0 (contiguous chunks)", dataclasses.replace(base, run_mb=0.0, batches_per_chunk=1))]
    configs += [(f"shardtrain batches_per_chunk={k}", dataclasses.replace(base, batches_per_chunk=k))
                for k in args.batches_per_chunk if k != base.batches_per_chunk]
    configs += [(f"shardtrain min_run_mb={mb:g}", dataclasses.replace(base, min_run_mb=mb))
                for mb in args.min_run_mb if mb != base.min_run_mb]
    for label, cfg in configs:
        t0 = time.perf_counter()
        planned = [plan_batches(idx, cfg, e, args.world_size, args.seed) for e in range(args.epochs)]
        add(label, [p[0] for p in planned], {**planned[0][1], "plan_s": round((time.perf_counter() - t0) / args.epochs, 3)})
    add("uniform shuffle in shardtrain's buckets", uniform_reference(idx, base, args.epochs, args.world_size, args.seed))
    add(f"uniform shuffle in {base.num_buckets} equal-audio buckets", fixed_reference(idx, base, args.epochs, args.seed))
    if not args.no_lhotse:
        for nb in args.lhotse_buckets:
            add(f"lhotse DynamicBucketingSampler ({nb} buckets)",
                lhotse_epochs(dur, args.epochs, args.max_batch_seconds, nb, args.seed))
    if args.throughput:
        thr = throughput_on(name, args)
    ref = next(r for r in rows if r["sampler"].startswith("uniform"))["pair_repeat_rate"]
    for r in rows:
        r["vs_uniform"] = round(r["pair_repeat_rate"] / ref, 3) if ref else None
    return {"bench": "shuffle", "git": common.git_sha(), "dataset": name, "rows_in_index": n,
            "audio_hours": round(float(dur.sum()) / 3600, 2), "world_size": args.world_size, "epochs": args.epochs,
            "max_batch_seconds": args.max_batch_seconds, "results": rows,
            "throughput": thr if args.throughput else None, "loader_epochs": args.loader_epochs,
            "loader_storage": "s3 (SeaweedFS, loopback)" if args.s3 else "local disk"}


COLUMNS = [("sampler", "sampler"), ("pair_repeat_rate", "pair repeat rate"), ("vs_uniform", "x uniform"),
           ("identical_batches", "identical batches"), ("padding_efficiency", "padding eff."),
           ("batch_audio_s", "audio s / batch"), ("batches", "batches / epoch"), ("reads_per_batch", "reads / batch"),
           ("mb_per_read", "MB / read")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", help="a packed shardtrain dataset (local); default: the cached speech corpus")
    ap.add_argument("--utterances", type=int, default=4000)
    ap.add_argument("--synthetic", type=int, default=0, help="use N synthetic LibriSpeech-like rows instead")
    ap.add_argument("--work-dir", type=Path, default=common.DEFAULT_WORK_DIR)
    ap.add_argument("--max-batch-seconds", type=float, default=300.0)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batches-per-chunk", type=int, nargs="*", default=[])
    ap.add_argument("--min-run-mb", type=float, nargs="*", default=[],
                    help="also plan with these min_run_mb (e.g. 1: runs never shrink below run_mb)")
    ap.add_argument("--lhotse-buckets", type=int, nargs="*", default=[30, 10])
    ap.add_argument("--no-lhotse", action="store_true")
    ap.add_argument("--throughput", action="store_true", help="also time the real loader, with and without mixing")
    ap.add_argument("--repeats", type=int, default=3, help="throughput runs per loader (alternated)")
    ap.add_argument("--loader-epochs", type=int, default=2)
    ap.add_argument("--loader-batches-per-chunk", type=int, default=0,
                    help="batches_per_chunk of the timed default loader (0: the default; 1 with a small budget: many "
                         "small reads)")
    ap.add_argument("--variant", action="append", default=[],
                    help="with --throughput: also time this checkout's loader as 'LABEL:field=value,...' (BucketConfig "
                         "or StreamConfig fields), e.g. 'no checks:check_transcripts=False'; repeatable")
    ap.add_argument("--variant-tree", type=Path, help="run the --variant loaders in this checkout instead")
    ap.add_argument("--no-contiguous", action="store_true", help="with --throughput: leave out the run_mb=0 loader")
    ap.add_argument("--s3", action="store_true", help="with --throughput: the loaders read from a local SeaweedFS")
    ap.add_argument("--baseline-tree", type=Path, action="append", default=[],
                    help="with --throughput: also time the default loader of this checkout (e.g. `git worktree add "
                         "/tmp/ab-old d12b55b^`), alternated with this one; repeatable")
    ap.add_argument("--out", type=Path, default=common.BENCH_DIR / "results" / "bench_shuffle.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    common.setup_logging()
    res = measure(args)
    common.write_json(args.out, res)
    print(json.dumps(res))
    print(f"\n{res['dataset']}: {res['rows_in_index']} utterances, {res['audio_hours']} h, world size "
          f"{res['world_size']}, max_batch_seconds {res['max_batch_seconds']:g}, epochs {res['epochs']}\n")
    print(common.markdown_table(res["results"], COLUMNS))
    if res["throughput"]:
        print(f"\nloader throughput, {res['loader_storage']}, {res['loader_epochs']} epochs, median "
              "(min-max); timings are noisy on a shared 2-core machine\n")
        print(common.markdown_table(res["throughput"], [("loader", "loader"), ("audio_s_per_s", "audio-s/s"),
                                                        ("of_decode_limit", "of decode limit"),
                                                        ("audio_s_per_cpu_s", "audio-s per CPU-s"),
                                                        ("cpu_of_decode_limit", "CPU efficiency of decode limit's"),
                                                        ("padding_efficiency", "padding eff."),
                                                        ("first_batch_s", "first batch s"),
                                                        ("peak_rss_mb", "peak RSS MB")]))
    return res


if __name__ == "__main__":
    main()
