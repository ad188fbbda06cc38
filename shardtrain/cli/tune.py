"""`shardtrain tune`: measure a per-bucket batch budget table (budget.json) for `shardtrain train --batch-budget`."""
from __future__ import annotations

import sys

from shardtrain.cli.common import _CREDS_HELP, _parse_storage_options, _run_errors, init_logging, report_error


# ---- tune (owner: tune) -------------------------------------------------------------------------
def _add_tune(sub) -> None:
    p = sub.add_parser("tune", help="measure the largest batch per duration bucket that fits the device memory",
                       description="For each duration bucket of the dataset's plan, find the largest padded batch "
                                   "whose forward + backward + optimiser step fits the memory target, by real steps "
                                   "of the pipeline (model, features, augmentation, precision) at the bucket's "
                                   "longest utterance; write budget.json for `shardtrain train --batch-budget`.")
    p.add_argument("--data", required=True, help="dataset URL (path, file://, s3://): its index gives the buckets")
    p.add_argument("--pipeline", default="tiny_cpu", help="preset, module:function or path/file.py:function")
    p.add_argument("--out", required=True, help="budget.json to write")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="where to measure (auto: cuda when available)")
    p.add_argument("--memory-fraction", type=float, default=0.9,
                   help="target = this share of the device memory (CUDA total; CPU: memory available now)")
    p.add_argument("--memory-limit-mb", type=float, default=None,
                   help="target in MiB instead of the fraction (on the CPU the figure is parameters, gradients, "
                        "optimiser state and activations held for backward)")
    p.add_argument("--max-batch-seconds", type=float, default=None,
                   help="largest budget a bucket may get (default: 2 x the preset's max_batch_seconds on the CPU, "
                        "8 x on CUDA)")
    p.add_argument("--buckets", type=int, default=None, help="duration buckets (default: the preset's num_buckets)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, as for train (repeatable)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option for s3:// URLs (repeatable). " + _CREDS_HELP)
    p.set_defaults(func=_cmd_tune)


def _cmd_tune(args) -> int:
    import json

    import torch

    from pipelines import load_pipeline
    from shardtrain.format.manifest import open_dataset
    from shardtrain.train.budget import write_budget
    from shardtrain.train.overrides import apply_overrides
    from shardtrain.train.text import CharVocab, SentencePieceVocab
    from shardtrain.train.tune import NothingFits, Search, default_search_s, default_target, tune

    init_logging(0, args.verbose)
    if not 0 < args.memory_fraction <= 1:
        raise SystemExit("tune: --memory-fraction must be in (0, 1]")
    try:
        cfg = apply_overrides(load_pipeline(args.pipeline), args.overrides)
    except ValueError as e:
        raise SystemExit(f"tune: {e}") from None
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tune: --device cuda, but no CUDA device is visible")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if device.type == "cpu" and cfg.train.cpu_threads > 0:
        torch.set_num_threads(cfg.train.cpu_threads)
    so = _parse_storage_options(args.storage_option) or None
    try:
        durations = open_dataset(args.data, so).read_index(columns=["duration_s"]).column("duration_s").to_numpy()
        vocab = (len(SentencePieceVocab(cfg.train.sentencepiece_model)) if cfg.train.tokenizer == "sentencepiece"
                 else len(CharVocab.from_index(args.data, so)))
        target = default_target(device, args.memory_fraction, args.memory_limit_mb)
        search = Search(target_bytes=target, num_buckets=args.buckets,
                        max_batch_seconds=args.max_batch_seconds or default_search_s(cfg, device))
        doc = tune(cfg, durations, vocab, device, search, progress=sys.stderr.isatty())
    except NothingFits as e:
        print(f"tune: error: {e}; {args.out} not written", file=sys.stderr)
        return 1
    except _run_errors() as e:  # one exit-status table for every command: a dataset that is not there is 2
        return report_error("tune", e)
    write_budget(args.out, {**doc, "pipeline": args.pipeline, "dataset": args.data,
                            "memory_fraction": None if args.memory_limit_mb else args.memory_fraction})
    print(f"{'bucket <= s':>12} {'utts':>6} {'budget s':>9} {'peak MiB':>9} {'step s':>7}")
    for r in doc["buckets"]:
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
        print(f"{r['edge_s']:>12.2f} {r['utterances']:>6} {r['batch_seconds']:>9.1f} {peak:>9} {r['step_s']:>7.3f}")
    print(json.dumps({"out": args.out, "buckets": len(doc["buckets"]), "tune_s": doc["tune_s"],
                      "memory_target_mb": round(target / 2**20, 1), "device": str(device)}))
    return 0
