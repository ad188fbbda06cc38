"""`shardtrain plan DATASET...`: a run seen before launch, from metadata only (load/preflight.py)."""
from __future__ import annotations

import json
import sys
import time

from shardtrain.cli.common import _CREDS_HELP, _parse_storage_options, missing_local_path, report_error


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan", help="see a run before launch: steps, fill, padding, memory, start-up, read rate, shares",
        description="Plan the epochs a training run would read, from manifest.json and index.parquet only (no "
                    "audio): steps per epoch (equal on every rank), batch fill and padding, utterances left out as "
                    "too long, the planner's memory per node and the index map on disk, the time to the first batch, "
                    "the bytes and requests per second each node must read at a target rate, batch variety against "
                    "a uniform shuffle, and a mixture's shares per epoch against its weights. Uses the same planner "
                    "as `shardtrain train` with the same --pipeline and --set.")
    p.add_argument("data", nargs="+", metavar="DATASET", help="dataset URL(s); several make a weighted mixture")
    p.add_argument("--weight", type=float, action="append", default=[], help="weight of each DATASET, in order")
    p.add_argument("--world-size", type=int, required=True, help="ranks (processes) the run will have")
    p.add_argument("--nodes", type=int, default=1, help="machines the ranks are spread over (default 1)")
    p.add_argument("--pipeline", default="tiny_cpu", help="preset whose stream config to plan with (default tiny_cpu)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, as for train (e.g. --set stream.bucket.num_buckets=20)")
    p.add_argument("--max-batch-seconds", type=float, default=None, help="audio seconds per batch per rank")
    p.add_argument("--batch-budget", metavar="BUDGET_JSON", default=None,
                   help="per-bucket budgets from `shardtrain tune` (budget.json)")
    p.add_argument("--target-audio-s-per-s", type=float, default=1000.0,
                   help="audio seconds per second each rank trains on (default 1000): sets the read rate per node")
    p.add_argument("--seed", type=int, default=None, help="plan seed (default: the pipeline's train.seed)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the report")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="write a picture: duration histogram with the batches' longest utterances, batches per band")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option for s3:// URLs. " + _CREDS_HELP)
    p.set_defaults(func=_cmd_plan)


def _stream_config(args):
    import dataclasses

    from pipelines import load_pipeline
    from shardtrain.train.overrides import apply_overrides

    cfg = apply_overrides(load_pipeline(args.pipeline), args.overrides)
    bucket = cfg.stream.bucket
    if args.max_batch_seconds is not None:
        bucket = dataclasses.replace(bucket, max_batch_seconds=args.max_batch_seconds)
    if args.batch_budget:
        from shardtrain.train.budget import read_budget

        table = tuple((float(e), float(b)) for e, b in read_budget(args.batch_budget)["budget_table"])
        bucket = dataclasses.replace(bucket, budget_table=table)
    return dataclasses.replace(cfg.stream, bucket=bucket), (cfg.train.seed if args.seed is None else args.seed)


def _cmd_plan(args) -> int:
    from shardtrain.format.locate import nothing_there

    for url in args.data:  # before pyarrow's import: a typo answers at once
        if missing_local_path(url):
            return report_error("plan", ValueError(nothing_there(url)))
    from shardtrain.format.manifest import DatasetError, open_dataset
    from shardtrain.load.mixplan import make_planner
    from shardtrain.load.preflight import (PreflightConfig, batch_figures, io_figures, memory_figures,
                                           mixture_figures, pair_repeat)

    so = _parse_storage_options(args.storage_option) or None
    try:  # a wrong DATASET is refused before the preset (and torch, ~1.5 s) is imported
        for url in args.data:
            open_dataset(url, so)
    except DatasetError as e:
        return report_error("plan", e)
    try:
        stream, seed = _stream_config(args)
        pc = PreflightConfig(world_size=args.world_size, nodes=args.nodes,
                             target_audio_s_per_s=args.target_audio_s_per_s)
        if args.weight and len(args.weight) != len(args.data):
            raise ValueError(f"give one --weight per DATASET ({len(args.data)}), got {len(args.weight)}")
    except (ValueError, OSError, KeyError) as e:
        raise SystemExit(f"plan: {e}") from None
    weights = args.weight or [1.0] * len(args.data)
    sources = args.data[0] if len(args.data) == 1 else list(zip(args.data, weights))
    import pyarrow.parquet  # noqa: F401 - imports are not start-up the run pays per epoch: outside the clock

    t0 = time.perf_counter()
    planner = make_planner(sources, seed=seed, cfg=stream, storage_options=so)
    open_s = time.perf_counter() - t0
    fig = batch_figures(planner, pc, stream.bucket)
    durations = fig.pop("batch_durations")
    rows = sum(s.samples for s in planner.data.shards)
    report = {
        "datasets": planner.datasets, "planner": planner.name, "rows": rows, "world_size": pc.world_size,
        "nodes": pc.nodes, "max_batch_seconds": stream.bucket.max_batch_seconds,
        "budget_table": stream.bucket.budget_table, "too_long": int(planner.too_long),
        "filtered": int(planner.filtered), **fig,
        "open_s": open_s, "memory": memory_figures(planner, pc),
        "io": io_figures(planner, pc, fig, stream.decode_threads),
        "variety": pair_repeat(planner, pc.world_size, rows),
        "mixture": mixture_figures(planner, weights) if len(args.data) > 1 else None,
    }
    report["startup_s_estimate"] = open_s + fig["plan_s"] + report["io"]["first_batch_read_decode_s"]
    if args.plot:
        _plot(args.plot, planner, durations, stream.bucket)
    print(json.dumps(report, indent=1, default=float) if args.json else _text(report))
    return 0


def _text(r: dict) -> str:
    mem, io = r["memory"], r["io"]
    lines = [
        f"plan of {', '.join(r['datasets'])}: {r['rows']:,} utterances, {r['planner']} planner, "
        f"{r['world_size']} ranks on {r['nodes']} node(s)",
        f"  steps per epoch (every rank)   {r['steps_per_epoch']:,}   ({r['rows_per_epoch']:,} utterances an epoch; "
        f"{r['too_long']:,} left out as longer than the budget, {r['filtered']:,} by the load-time filters)",
        f"  batch fill                     {r['fill']:.3f} of the budget ({r['mean_batch_audio_s']:.1f} s audio a batch, "
        f"budget {r['max_batch_seconds']:g} s{'; per-bucket table' if r['budget_table'] else ''})",
        f"  padding efficiency             {r['padding_efficiency']:.3f}   (over {r['batches_sampled']:,} batches of "
        f"ranks {', '.join(map(str, r['sampled_ranks']))})",
        f"  planner memory                 {_mb(mem['per_rank_bytes'])} per rank, {_mb(mem['per_node_bytes'])} per node"
        + (f"; index map {_mb(mem['mapped_index_bytes'])} on disk, built in ~{mem['map_build_s_estimate']:.0f} s "
           "once per node" if r["planner"] == "blocks" else ""),
        f"  start-up to the first batch    ~{r['startup_s_estimate']:.2f} s (index {r['open_s']:.2f} s + plan "
        f"{r['plan_s']:.2f} s + first batch read and decode ~{io['first_batch_read_decode_s']:.2f} s)",
        f"  reads                          {r['reads_per_chunk']:.1f} ranged reads per chunk, {r['mb_per_read']:.2f} MB each",
        f"  storage per node at the target {io['node_read_mb_s']:,.1f} MB/s, "
        f"{io['node_requests_per_s']:,.1f} requests/s ({io['bytes_per_audio_s'] / 1e3:.1f} kB per audio second)",
    ]
    v = r["variety"]
    lines.append("  batch variety                  " + (v["skipped"] if "skipped" in v else
                 f"pair repeat rate {v['pair_repeat_rate']:.4f}, x{(v['x_uniform'] or 0):.2f} a uniform shuffle "
                 "in the same duration bands"))
    for m in r["mixture"] or []:
        rep = m["epochs_until_repeat"]
        lines.append(f"  {m['dataset']}: share per epoch {', '.join(f'{s:.3f}' for s in m['share_per_epoch'])} "
                     f"(weight {m['weight_share']:.3f}); "
                     + (f"repeats within every epoch (x{1 / rep:.1f} a pass)" if rep is not None and rep < 1 else
                        f"first repeat after {rep:.1f} epochs" if rep is not None else "no audio"))
    return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} kB"


def _plot(path: str, planner, durations: list, bucket) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    indexes = getattr(planner, "indexes", None) or [planner.idx]
    dur = np.concatenate([np.asarray(ix.duration_s, np.float64) for ix in indexes])
    longest = np.array([d.max() for d in durations]) if durations else np.zeros(0)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.hist(dur, bins=80, color="#4477aa")
    from shardtrain.load.plan import estimate_bins

    edges = list(bucket.bins_s) if bucket.bins_s else estimate_bins(dur, bucket.num_buckets).tolist()
    for e in edges:
        a.axvline(e, color="#cc6677", lw=1)
    for e, _ in (bucket.budget_table or ()):
        a.axvline(e, color="#222222", lw=1, ls="--")
    a.set_xlabel("utterance duration (s)")
    a.set_ylabel("utterances")
    a.set_title("durations (red: bucket edges, dashed: budget table)")
    b.hist(longest, bins=40, color="#228833")
    b.set_xlabel("longest utterance in the batch (s)")
    b.set_ylabel("batches (sampled ranks)")
    b.set_title("batches per duration band")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plan: wrote {path}", file=sys.stderr)
