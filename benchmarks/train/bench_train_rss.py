"""Trainer RSS over a long tiny run: glibc's default heap against the bounded one `shardtrain train` sets.

    tone corpus (make_corpus, 2-16 s utterances) -> `shardtrain pack` (local, cached in --work-dir)
    for heap in (glibc default, bounded = cli._bound_malloc_heap: mmap threshold fixed at 1 MB):
        `shardtrain train --pipeline tiny_cpu` in a fresh process for --steps steps, RSS sampled every second
    -> RSS at 10/25/50/75/100% of the run, peak, growth over the second half, wall time; one JSON line and a table

The peer run is the same command through a wrapper that turns `_bound_malloc_heap` into a no-op, so the only
difference is the heap setting. Timings are noisy on a shared machine; RSS is what this measures. Run:

    .venv/bin/python -m benchmarks.train.bench_train_rss                  # 2,000 steps, 20 s batches
    .venv/bin/python -m benchmarks.train.bench_train_rss --steps 200 --batch-seconds 60   # the demo's batch size
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks.common import DEFAULT_WORK_DIR, REPO, git_sha, markdown_table

WRAPPER = "import sys, shardtrain.cli as c, shardtrain.cli.train as t; {patch}sys.exit(c.main(sys.argv[1:]))"


def dataset(work: Path, n: int) -> str:
    import numpy as np

    from shardtrain.pack.packer import PackConfig, pack
    from shardtrain.testing.corpus import make_corpus

    ds = work / f"rss-ds-{n}"
    if not (ds / "manifest.json").exists():
        durs = [float(x) for x in np.random.default_rng(0).uniform(2, 16, n).round(2)]
        make_corpus(work / f"rss-corpus-{n}", durs, seed=0)
        pack(PackConfig(input=str(work / f"rss-corpus-{n}"), output=str(ds), workers=1, progress=False))
    return str(ds)


def run(ds: str, steps: int, batch_s: float, bounded: bool, out: Path) -> dict:
    patch = "" if bounded else "t._bound_malloc_heap = lambda env=None: False; "
    cmd = [sys.executable, "-c", WRAPPER.format(patch=patch), "train", "--data", ds, "--pipeline", "tiny_cpu",
           "--max-steps", str(steps), "--out", str(out), "--set", "train.progress=false",
           "--set", "train.cpu_threads=1", "--set", "train.tensorboard=false", "--set", "train.val_every_steps=0",
           "--set", f"train.ckpt_every_steps={steps}", "--set", f"stream.bucket.max_batch_seconds={batch_s}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = str(REPO)
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ps = psutil.Process(proc.pid)
    curve: list[tuple[float, float]] = []
    while proc.poll() is None:
        try:
            curve.append((round(time.monotonic() - t0, 1), round(ps.memory_info().rss / 2**20, 1)))
        except psutil.Error:
            break
        time.sleep(1.0)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"train failed ({proc.returncode}):\n{err[-3000:]}")
    curve = [(t, m) for t, m in curve if m > 0]  # the last sample can catch the process exiting
    rss = [m for _, m in curve]
    at = {f"rss_mb_at_{p}pct": rss[min(len(rss) - 1, len(rss) * p // 100)] for p in (10, 25, 50, 75, 100)}
    half = rss[len(rss) // 2:]
    return {"heap": "bounded" if bounded else "glibc default", "steps": steps, "batch_seconds": batch_s,
            "wall_s": round(time.monotonic() - t0, 1), "peak_rss_mb": max(rss), **at,
            "second_half_growth_mb": round(max(half) - half[0], 1), "curve": curve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-seconds", type=float, default=20.0)
    ap.add_argument("--utterances", type=int, default=300)
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    ds = dataset(args.work_dir, args.utterances)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for bounded in (False, True):
            r = run(ds, args.steps, args.batch_seconds, bounded, Path(tmp) / f"run-{bounded}")
            print(json.dumps({**r, "git": git_sha()}), flush=True)
            rows.append(r)
    cols = ["heap", "steps", "batch_seconds", "wall_s", "peak_rss_mb", "rss_mb_at_10pct", "rss_mb_at_50pct",
            "rss_mb_at_100pct", "second_half_growth_mb"]
    print(markdown_table(rows, [(c, c) for c in cols]))
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
