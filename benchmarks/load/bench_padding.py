"""Padding, fill, steps and batch variety of the rows planner's epochs (plans only: metadata, no audio, seconds).

    packed datasets (--dataset, local) and synthetic uniform lengths (--uniform N,LO,HI,WORLD,BUDGET)
      -> plan_epoch for epochs 0..E-1 (shipped BucketConfig defaults but for the budget; --world-size ranks)
      -> padding efficiency: real samples / padded samples, sum(num_samples) / sum(len(batch) x longest);
         fill: audio seconds / max_batch_seconds per batch; steps per epoch (every rank)
      -> pair repeat rate across consecutive epochs against a uniform shuffle in `num_buckets` fixed equal-audio
         buckets (bench_shuffle.fixed_reference: the reference narrower buckets cannot game), and against a
         uniform shuffle in the planner's own buckets of each epoch (bench_shuffle.uniform_reference)

Padding is deterministic from the plan, so no timing and no repeats are needed. Run:

    .venv/bin/python -m benchmarks.load.bench_padding --dataset DS_4K --dataset DS_6K \
        --uniform 20000,0.5,20,8,300 --uniform 40000,2,16,4,120
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np

from benchmarks import common
from benchmarks.load import bench_shuffle

log = logging.getLogger("bench")


def uniform_index(n: int, lo: float, hi: float, seed: int = 0):
    """n rows of uniform lengths in [lo, hi] s, duration-sorted, ~19 kB/s (tests/load/test_plan.fake_index)."""
    from shardtrain.load.plan import PlanIndex

    d = np.sort(np.random.default_rng(seed).uniform(lo, hi, n))
    size = (d * 19_200).astype(np.int64) + 2048
    off = np.concatenate([[0], np.cumsum(size)[:-1]])
    return PlanIndex(shard=(off // 20_000_000).astype(np.int32), offset=off, size=size, audio_offset=off + 512,
                     audio_size=size - 2048, json_offset=off + size - 512, json_size=np.full(n, 100), duration_s=d,
                     num_samples=(d * 16000).astype(np.int64), channels=np.ones(n, np.int16))


def measure(idx, cfg, world_size: int, epochs: int, seed: int) -> dict:
    epochs_batches, steps = [], []
    for e in range(epochs):
        batches, reads = bench_shuffle.plan_batches(idx, cfg, e, world_size, seed)
        epochs_batches.append(batches)
        steps.append(reads["steps"])
    full = [b for ep in epochs_batches for b in ep if len(b)]
    ns = idx.num_samples
    n = len(idx)
    ours = bench_shuffle.repeat_stats(epochs_batches, n)["pair_repeat_rate"]
    fixed = bench_shuffle.repeat_stats(bench_shuffle.fixed_reference(idx, cfg, epochs, seed), n)["pair_repeat_rate"]
    own = bench_shuffle.repeat_stats(bench_shuffle.uniform_reference(idx, cfg, epochs, world_size, seed),
                                     n)["pair_repeat_rate"]
    return {"padding": round(sum(int(ns[b].sum()) for b in full) / sum(len(b) * int(ns[b].max()) for b in full), 4),
            "fill": round(float(np.mean([idx.duration_s[b].sum() for b in full])) / cfg.max_batch_seconds, 3),
            "steps": round(float(np.mean(steps)), 1), "pair_repeat_rate": round(ours, 4),
            "x_fixed_buckets": round(ours / fixed, 3) if fixed else None,
            "x_own_buckets": round(ours / own, 3) if own else None}


COLUMNS = [("case", "corpus"), ("world_size", "ranks"), ("budget_s", "budget s"), ("padding", "padding eff."),
           ("fill", "fill"), ("steps", "steps / epoch"), ("pair_repeat_rate", "pair repeat"),
           ("x_fixed_buckets", "x uniform, 30 fixed buckets"), ("x_own_buckets", "x uniform, own buckets")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", action="append", default=[], help="a packed shardtrain dataset (local folder)")
    ap.add_argument("--uniform", action="append", default=[], help="N,LO,HI,WORLD,BUDGET: synthetic uniform lengths")
    ap.add_argument("--world-size", type=int, default=1, help="ranks for --dataset")
    ap.add_argument("--max-batch-seconds", type=float, default=300.0, help="budget for --dataset")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=common.BENCH_DIR / "results" / "bench_padding.json")
    args = ap.parse_args(argv)
    common.setup_logging()
    from shardtrain.format.manifest import open_dataset
    from shardtrain.load.plan import PLAN_COLUMNS, BucketConfig, PlanIndex

    cases = [(Path(d).name, PlanIndex.from_table(open_dataset(d).read_index(columns=list(PLAN_COLUMNS))),
              args.world_size, args.max_batch_seconds) for d in args.dataset]
    for spec in args.uniform:
        n, lo, hi, ws, budget = spec.split(",")
        cases.append((f"uniform {n} x {lo}-{hi} s", uniform_index(int(n), float(lo), float(hi), args.seed), int(ws),
                      float(budget)))
    rows = []
    for name, idx, ws, budget in cases:
        row = {"case": name, "world_size": ws, "budget_s": budget,
               **measure(idx, BucketConfig(max_batch_seconds=budget), ws, args.epochs, args.seed)}
        log.info("%s", row)
        rows.append(row)
    common.write_json(args.out, {"bench": "padding", "git": common.git_sha(), "epochs": args.epochs,
                                 "seed": args.seed, "results": rows})
    print(common.markdown_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
