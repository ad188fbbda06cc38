"""Side by side: shardtrain vs webdataset vs lhotse Shar, same audio, same workers, local disk and S3.

    corpus (espeak-ng speech, 1-7 s) -> `shardtrain pack` (16 MB shards) and `CutSet.to_shar` (same shard count,
    FLAC); both cached in --work-dir, so a rerun measures only the loaders
    decode-only limit of the machine (bench_loader.run_decode_limit: tar read + decode, one process per core)
    for each of --repeats (default 3), for storage in (local, SeaweedFS on loopback), for each tool:
        shardtrain  shardtrain.load.bench.bench_loader, max_batch_seconds=B
        webdataset  WebDataset -> shuffle -> soundfile decode -> fixed batch of round(B / mean duration) utterances
        lhotse      CutSet.from_shar(split_for_dataloading, shuffle_shards) -> DynamicBucketingSampler(max_duration=B,
                    num_buckets=30, shuffle) -> IterableDatasetWrapper(dataset: collate_audio = padded float32)
        webdataset and lhotse with DataLoader(num_workers=--workers); shardtrain decodes in threads of its own
        process (it has no worker processes: issue 32 measured them at 0.66-0.83x); one epoch, each run in a
        fresh interpreter
    -> median (min-max) of audio-s/s, samples/s, padding efficiency, first batch s, peak RSS MB (process tree,
       DataLoader workers included; the S3 server is not), ratios against shardtrain and the decode limit
    -> stdout + results/compare.md (Markdown), results/compare.json, results/compare.png (matplotlib Agg)

S3 access: shardtrain reads s3:// through s3fs; webdataset and lhotse have no s3 reader of their own here, so they
get presigned http URLs of the same objects (webdataset's curl handler; lhotse via `pipe:curl`). Budget: ~4,000
utterances x 3 tools x 2 storages x 5 runs take ~5 min on 2 quiet cores once the inputs are cached; the first
run adds ~2 min of espeak-ng, ~1 min of packing and ~1-2 min of Shar export. Run:

    .venv/bin/python -m benchmarks.load.compare                    # the full comparison (< 15 min on 2 cores)
    .venv/bin/python -m benchmarks.load.compare --quick            # 400 utterances, 1 run each, smoke test
    .venv/bin/python -m benchmarks.load.compare --dataset s3://bucket/ds --storage local   # a dataset already packed
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

from benchmarks import common
from benchmarks.load import bench_loader

log = logging.getLogger("bench")
TOOLS = ["shardtrain", "webdataset", "lhotse"]


# ---------------------------------------------------------------------------------------------- lhotse
def prepare_shar(work_dir: Path, corpus: Path, num_shards: int) -> Path:
    """The corpus as Lhotse Shar (cuts.N.jsonl.gz + recording.N.tar, FLAC), about `num_shards` shards; cached."""
    out = work_dir / f"shar-{corpus.name.removeprefix('corpus-')}-{num_shards}"
    if (out / ".done").exists():
        return out
    t0 = time.perf_counter()
    cuts = common.lhotse_cuts(corpus)
    out.mkdir(parents=True, exist_ok=True)
    shard_size = -(-len(cuts) // max(1, num_shards))
    cuts.to_shar(out, fields={"recording": "flac"}, shard_size=shard_size, num_jobs=os.cpu_count() or 1)
    (out / ".done").write_text("ok\n")
    log.info("lhotse Shar export %s (%d cuts, %d per shard) in %.1f s", out, len(cuts), shard_size,
             time.perf_counter() - t0)
    return out


class PaddedAudio:
    """The minimal lhotse dataset: a CutSet batch -> (float32 [B, T] zero-padded, lengths, texts), like the others.
    A cut at another rate than the packed dataset's raises: lhotse would decode other audio than the loader, and
    its lengths would count as the wrong number of seconds."""

    def __init__(self, sample_rate_hz: int):
        self.sample_rate_hz = sample_rate_hz

    def __getitem__(self, cuts):
        from lhotse.dataset.collation import collate_audio

        other = {c.sampling_rate for c in cuts} - {self.sample_rate_hz}
        if other:
            raise ValueError(f"lhotse cuts at {sorted(other)} Hz, the packed dataset at {self.sample_rate_hz} Hz")
        audio, lengths = collate_audio(cuts)
        texts = [c.supervisions[0].text if c.supervisions else "" for c in cuts]
        return audio, lengths, texts


def run_lhotse(cuts_paths: list[str], recording_paths: list[str], workers: int, max_duration_s: float,
               num_buckets: int = 30, seed: int = 0, *, sample_rate_hz: int) -> dict:
    """lhotse's recommended Shar setup: sampler inside each worker over its share of the shards."""
    import torch
    from lhotse import CutSet
    from lhotse.dataset import DynamicBucketingSampler, IterableDatasetWrapper

    from shardtrain.load.bench import RssSampler

    with RssSampler() as rss:
        t0 = time.perf_counter()
        cuts = CutSet.from_shar(fields={"cuts": cuts_paths, "recording": recording_paths},
                                split_for_dataloading=True, shuffle_shards=True, seed=seed)
        sampler = DynamicBucketingSampler(cuts, max_duration=max_duration_s, num_buckets=num_buckets, shuffle=True,
                                          seed=seed)
        dl = torch.utils.data.DataLoader(IterableDatasetWrapper(PaddedAudio(sample_rate_hz), sampler), batch_size=None,
                                         num_workers=workers, prefetch_factor=2 if workers else None)
        out = common.time_batches(dl, sample_rate_hz=sample_rate_hz, t_start=t0, rss=rss)
    return {**out, "workers": workers, "num_buckets": num_buckets}


# ---------------------------------------------------------------------------------------------- plot
def plot(summary: list[dict], limit: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    storages = sorted({r["storage"] for r in summary}, key=["local", "s3"].index)
    metrics = [("audio_s_per_s", "audio seconds / s"), ("padding_efficiency", "padding efficiency"),
               ("first_batch_s", "first batch (s)"), ("peak_rss_mb", "peak RSS (MB)")]
    colors = {"shardtrain": "#1f77b4", "webdataset": "#ff7f0e", "lhotse": "#2ca02c"}
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.8))
    width = 0.8 / len(TOOLS)
    for ax, (m, label) in zip(axes, metrics):
        for i, tool in enumerate(TOOLS):
            xs, ys, lo, hi = [], [], [], []
            for j, storage in enumerate(storages):
                row = next((r for r in summary if r["tool"] == tool and r["storage"] == storage), None)
                if row is None or row[m]["median"] is None:
                    continue
                xs.append(j + (i - (len(TOOLS) - 1) / 2) * width)
                ys.append(row[m]["median"])
                lo.append(row[m]["median"] - row[m]["min"])
                hi.append(row[m]["max"] - row[m]["median"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=tool, color=colors[tool])
        if m == "audio_s_per_s" and limit["audio_s_per_s"]["median"]:
            ax.axhline(limit["audio_s_per_s"]["median"], color="k", ls="--", lw=1, label="decode-only limit")
        ax.set_xticks(range(len(storages)), storages)
        ax.set_title(label)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- issue 20's table
def issue_figures(summary: list[dict], limit: dict, ds: Path, args: argparse.Namespace) -> tuple[dict, str]:
    """Issue 20's figures for shardtrain as shipped (threads in one process, float32), per storage: whole epoch
    over the decode-only limit of the same run, over webdataset and lhotse (same workers, same run), padding,
    fill (audio s per batch / max_batch_seconds), first batch, peak RSS, and the pair repeat rate of its plans
    across epochs over a uniform shuffle in 30 fixed equal-audio buckets (planning only, 4 epochs)."""
    from benchmarks.load import bench_shuffle

    from shardtrain.format.manifest import open_dataset
    from shardtrain.load.plan import PLAN_COLUMNS, BucketConfig, PlanIndex

    idx = PlanIndex.from_table(open_dataset(str(ds)).read_index(columns=list(PLAN_COLUMNS)))
    var = bench_shuffle.variety(idx, BucketConfig(max_batch_seconds=args.max_batch_seconds), 4, 1, args.seed)
    out: dict = {"variety": var, "storages": {}}
    lines = ["| figure | " + " | ".join(sorted({r["storage"] for r in summary})) + " | goal |", ""]
    rows: dict[str, list[str]] = {}
    goals = {"loader whole epoch / decode-only limit (libsndfile)": ">= 0.95",
             "loader whole epoch / decode-only limit (fastest decoder, dr_flac)": ">= 0.95 (issue 32)",
             "loader / webdataset": ">= 2", "loader / lhotse":
             ">= 2", "padding efficiency": ">= 0.97", "batch fill": ">= 0.85", "first batch s": "<= 0.15",
             "peak RSS MB": "<= 650", "pair repeat rate / uniform in 30 buckets": "<= 1.2"}
    for storage in sorted({r["storage"] for r in summary}):
        me = next((r for r in summary if r["tool"] == "shardtrain" and r["storage"] == storage and r["workers"] == 0),
                  None)
        if me is None:
            continue
        peer = {r["tool"]: r for r in summary if r["storage"] == storage and r["tool"] != "shardtrain"}
        med = lambda r, k: r[k]["median"] if r and r.get(k) else None  # noqa: E731
        fig = {"loader whole epoch / decode-only limit (libsndfile)": me["of_libsndfile_limit"],
               "loader whole epoch / decode-only limit (fastest decoder, dr_flac)": me["of_decode_limit"],
               "loader / webdataset": common.ratio(med(me, "audio_s_per_s"), med(peer.get("webdataset"), "audio_s_per_s")),
               "loader / lhotse": common.ratio(med(me, "audio_s_per_s"), med(peer.get("lhotse"), "audio_s_per_s")),
               "padding efficiency": med(me, "padding_efficiency"),
               "batch fill": round(med(me, "batch_audio_s") / args.max_batch_seconds, 3) if med(me, "batch_audio_s") else None,
               "first batch s": med(me, "first_batch_s"), "peak RSS MB": med(me, "peak_rss_mb"),
               "pair repeat rate / uniform in 30 buckets": var["x_uniform_fixed_buckets"]}
        out["storages"][storage] = fig
        for k, v in fig.items():
            rows.setdefault(k, []).append("-" if v is None else f"{v:g}")
    lines[1] = "|" + "---|" * (len(lines[0].split("|")) - 2)
    lines += [f"| {k} | " + " | ".join(v) + f" | {goals[k]} |" for k, v in rows.items()]
    return out, "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main
def inputs(work: Path, args: argparse.Namespace) -> tuple[Path, Path | None, dict]:
    """(packed dataset, its Lhotse Shar export or None, summary). --dataset measures a dataset the user packed:
    no source corpus, so no Shar export and lhotse is left out (logged); otherwise the synthetic corpus."""
    if args.dataset:
        ds = common.existing_dataset(work, args.dataset)
        if "lhotse" in args.tools:
            log.warning("--dataset %s: lhotse needs the source corpus for its Shar export; measuring shardtrain "
                        "and webdataset against the decode-only limit", args.dataset)
        return ds, None, common.dataset_summary(ds)
    corpus = common.prepare_corpus(work, args.utterances, kind=args.corpus, seed=args.seed)
    ds = common.prepare_dataset(work, corpus, shard_mb=args.shard_mb)
    info = common.dataset_summary(ds)
    return ds, prepare_shar(work, corpus, info["shards"]), info


def main(args: argparse.Namespace) -> dict:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    load_start = os.getloadavg()[0]
    ds, shar, info = inputs(work, args)
    bs = bench_loader.wds_batch_size(ds, args.max_batch_seconds)
    t_prep = time.perf_counter() - t_all
    log.info("inputs ready in %.1f s: %s; webdataset batch size %d", t_prep, info, bs)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tools = [t for t in TOOLS if t in args.tools and (t != "lhotse" or shar is not None)]
    with open(out_dir / "compare.jsonl", "w") as jsonl:
        targets = bench_loader.Targets(ds, args.storage, work, shar=shar)
        try:
            runs, limit = bench_loader.run_matrix(
                targets, tools, args.storage, [args.workers], args.repeats,
                {"shardtrain": {"max_batch_seconds": args.max_batch_seconds, "seed": args.seed},
                 "webdataset": {"batch_size": bs, "seed": args.seed},
                 "lhotse": {"max_duration_s": args.max_batch_seconds, "seed": args.seed}}, jsonl,
                tool_workers={"shardtrain": [0]})
        finally:
            targets.close()
    # ratios against shardtrain as shipped (decode threads in the training process, same cores)
    table, summary = bench_loader.rows_for_table(runs, limit, ref_workers=0)
    md = common.markdown_table(table, bench_loader.COLUMNS)
    sha = common.git_sha()
    mach = common.machine()
    load = os.getloadavg()[0]  # how shared the machine was: ratios hold up under load, absolute rates do not
    head = (f"load average {load_start:.1f} at the start, {load:.1f} at the end; "
            f"{info['samples']} utterances ({args.dataset or args.corpus}, {info['audio_hours']} h, {info['shards']} shards), "
            f"{args.workers} workers, max_batch_seconds {args.max_batch_seconds:g} (webdataset batch {bs}), "
            f"median (min-max) of {args.repeats} runs; {mach['cpus']} CPUs "
            f"(effective {limit['effective_cores']}: decode limit / one process); git {sha}")
    result = {"benchmark": "compare", "git_sha": sha, "machine": mach,
              "config": {**vars(args), "webdataset_batch_size": bs}, "dataset": info,
              "decode_limit": {k: v for k, v in limit.items() if k != "runs"}, "rows": summary,
              "prepare_s": round(t_prep, 1), "total_wall_s": round(time.perf_counter() - t_all, 1)}
    issue, issue_md = issue_figures(summary, limit, ds, args)
    result["issue_table"] = issue
    common.write_json(out_dir / "compare.json", result)
    (out_dir / "compare.md").write_text(f"{head}\n\n{md}\n\n{issue_md}\n")
    print(issue_md + "\n")
    plot(summary, limit, out_dir / "compare.png", head)
    print(head + "\n\n" + md)
    print(common.json_line({"git_sha": sha, "config": result["config"], "total_wall_s": result["total_wall_s"],
                            "audio_s_per_s": {f"{r['tool']}/{r['storage']}": r["audio_s_per_s"]["median"]
                                              for r in summary},
                            "decode_limit_audio_s_per_s": limit["audio_s_per_s"]["median"]}))
    log.info("total %.1f s (inputs %.1f s)", result["total_wall_s"], t_prep)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default=None, metavar="URL",
                    help="a dataset already packed (local folder or s3://; an s3 one is copied once into --work-dir) "
                         "instead of the synthetic corpus; lhotse is left out (no source corpus to export)")
    ap.add_argument("--utterances", type=int, default=4000, help="corpus size (>= 4,000 for the issue's figures)")
    ap.add_argument("--corpus", choices=["speech", "tone"], default="speech", help="espeak-ng speech or tones")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers of webdataset and lhotse (shardtrain: decode threads in its process)")
    ap.add_argument("--storage", nargs="+", choices=["local", "s3"], default=["local", "s3"])
    ap.add_argument("--tools", nargs="+", choices=TOOLS, default=TOOLS)
    ap.add_argument("--repeats", type=int, default=5,
                    help="runs per tool and storage (median and min-max; >= 3; 5 tames a shared machine's noise)")
    ap.add_argument("--max-batch-seconds", type=float, default=300.0,
                    help="audio per batch: shardtrain budget, lhotse max_duration, webdataset batch size")
    ap.add_argument("--shard-mb", type=float, default=16.0, help="pack target shard size (Shar: same shard count)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=str(common.DEFAULT_WORK_DIR), help="cache of corpus and exports")
    ap.add_argument("--out-dir", default=None, help="Markdown / JSON / PNG output")
    ap.add_argument("--quick", action="store_true", help="smoke run: 400 utterances, 4 MB shards, 1 run each")
    args = ap.parse_args(argv)
    if args.out_dir is None:  # a smoke run never overwrites the published results
        args.out_dir = str(common.BENCH_DIR / "results" / ("quick" if args.quick else ""))
    if args.quick:
        args.utterances, args.repeats, args.shard_mb = min(args.utterances, 400), 1, 4.0
    return args


if __name__ == "__main__":
    common.setup_logging()
    main(parse_args())
