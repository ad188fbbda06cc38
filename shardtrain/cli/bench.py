"""`shardtrain bench`: the real loader timed per stage; `--augment` adds the trainer's device chain, built here
so the `load` room never imports `train`.
"""
from __future__ import annotations

import sys

from shardtrain.cli.common import _CREDS_HELP, _parse_storage_options
from shardtrain.format.safe import printable



# ---- bench (owner: stream) ----------------------------------------------------------------------
def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="measure loader throughput on a dataset",
                       description="Run the shardtrain loader over DATASET and report audio seconds/s, samples/s, "
                                   "padding efficiency, first-batch latency, peak RSS and per-stage times.")
    p.add_argument("dataset", metavar="DATASET", help="dataset folder or URL (s3://bucket/prefix)")
    p.add_argument("--epochs", type=int, default=1, help="epochs to run (default 1; 0 = until --max-batches)")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
    p.add_argument("--workers", type=int, default=0,
                   help="removed: worker processes ran slower than decode threads; only 0 (use --decode-threads)")
    p.add_argument("--decode-threads", type=int, default=3,
                   help="decode threads of the loader (default 3: one more than 2 cores; decoding runs without the GIL)")
    p.add_argument("--pcm-dtype", choices=("float32", "int16"), default="float32",
                   help="batch dtype; int16 halves host memory traffic and converts on the device")
    p.add_argument("--max-batch-seconds", type=float, default=300.0, help="audio seconds per batch (default 300)")
    p.add_argument("--max-batch-size", type=int, default=None, help="utterances per batch cap")
    p.add_argument("--batches-per-chunk", type=int, default=None,
                   help="most batches per planned read; more mixes utterances across batches (default: the "
                        "trainer's, stream.bucket.batches_per_chunk)")
    p.add_argument("--planner", choices=("auto", "rows", "blocks"), default="auto",
                   help="epoch planner: rows (whole index in every rank), blocks (node-shared memory-mapped index, "
                        "for 100M-row corpora), auto (blocks from 4M rows; default)")
    p.add_argument("--index-cache-dir", default=None,
                   help="node-local folder of the block planner's index map (default: <tempdir>/shardtrain-index)")
    p.add_argument("--prefetch-chunks", type=int, default=2, help="chunks read and decoded ahead (default 2)")
    p.add_argument("--world-size", type=int, default=1, help="simulated world size (default 1)")
    p.add_argument("--rank", type=int, default=0, help="simulated rank (default 0)")
    p.add_argument("--seed", type=int, default=0, help="plan seed (default 0)")
    p.add_argument("--step-ms", type=float, default=0.0, help="simulated trainer step time; reports data wait %%")
    p.add_argument("--device", default="cpu", help="copy batches to this device, e.g. cuda (default cpu)")
    p.add_argument("--augment", action="store_true", help="also run the augmentation + log-mel chain per batch")
    p.add_argument("--cache-dir", default=None, help="local shard cache for remote datasets")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                   help="fsspec storage option, repeatable. " + _CREDS_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args) -> int:
    import json

    from shardtrain.load.bench import BenchConfig, bench_loader
    from shardtrain.load.plan import BucketConfig
    from shardtrain.load.config import StreamConfig
    from shardtrain.world import World

    per_chunk = {} if args.batches_per_chunk is None else {"batches_per_chunk": args.batches_per_chunk}
    stream = StreamConfig(
        bucket=BucketConfig(max_batch_seconds=args.max_batch_seconds, max_batch_size=args.max_batch_size,
                            **per_chunk),
        prefetch_chunks=args.prefetch_chunks,
        num_workers=args.workers, decode_threads=args.decode_threads, cache_dir=args.cache_dir,
        pcm_dtype=args.pcm_dtype, planner=args.planner, index_cache_dir=args.index_cache_dir)
    bench = BenchConfig(epochs=args.epochs or None, max_batches=args.max_batches, step_ms=args.step_ms,
                        device=args.device, progress=not args.no_progress)
    out = bench_loader(args.dataset, world=World(rank=args.rank, world_size=args.world_size), seed=args.seed,
                       stream=stream, bench=bench, storage_options=_parse_storage_options(args.storage_option),
                       make_augment=_bench_augmenter(args.device) if args.augment else None)  # errors: cli.app.main
    if args.json:
        print(json.dumps(out))
    else:
        width = max(map(len, out))
        for k, v in out.items():
            if k != "steady_refused":
                print(f"{k:<{width}}  {printable(v)}")
        if "steady_refused" in out:
            print(f"bench: {out['steady_refused']}", file=sys.stderr)
    return 0


def _bench_augmenter(device: str):
    """`bench --augment`: the trainer's default augmentation + log-mel chain, built at the dataset's rate."""
    def make(sample_rate_hz: int):
        from shardtrain.train.augment import AugmentConfig, DeviceAugment
        from shardtrain.train.features import FeatureConfig

        aug = DeviceAugment(AugmentConfig(), FeatureConfig(), sample_rate_hz).to(device)
        return lambda waves, lengths, gen: aug(waves, lengths, gen, train=True)
    return make
