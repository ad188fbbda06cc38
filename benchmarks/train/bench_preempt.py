"""Preemption delay: SIGTERM -> committed checkpoint, for the demo model (tiny_cpu), with --out local and on S3.

    tone corpus (make_corpus, 2-16 s utterances) -> `shardtrain pack` (local, cached in --work-dir)
    per target (local folder, s3:// on a SeaweedFS started on loopback) x --repeats:
        `shardtrain train --pipeline tiny_cpu` in a fresh process; at step --signal-step: SIGTERM
        -> the trainer's own figures from metrics.jsonl: preempt_s (signal -> checkpoint committed) and
           checkpoint_s (the write), the duration of the step the signal fell in (step_s), its exit code and the wall time
           from the signal to the process's exit
    -> one JSON line per run, a table of medians (min-max)

The promise under test: preempt_s <= one step + the checkpoint write. Run (from the repository root):

    .venv/bin/python -m benchmarks.train.bench_preempt                     # local and S3, 3 runs each
    .venv/bin/python -m benchmarks.train.bench_preempt --targets local --repeats 1
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.train.bench_train_rss import dataset  # the same cached tone corpus (2-16 s utterances)
from benchmarks.common import DEFAULT_WORK_DIR, git_sha, markdown_table, summarize


def one_run(ds: str, out: str, signal_step: int, so: dict | None, env: dict) -> dict:
    """Train until `signal_step` is logged, SIGTERM, wait; the trainer's preemption row + our wall clock."""
    local = Path(out) if "://" not in out else None
    cmd = [sys.executable, "-m", "shardtrain", "train", "--data", ds, "--pipeline", "tiny_cpu", "--max-steps",
           "100000", "--out", out, "--set", "train.progress=false", "--set", "train.log_every_steps=1",
           "--set", "train.cpu_threads=1", "--set", "train.tensorboard=false"]
    for k, v in (so or {}).items():
        cmd += ["--storage-option", f"{k}={json.dumps(v)}"]
    metrics = local / "metrics.jsonl" if local else None
    if metrics is None:
        from shardtrain.train.checkpoint import run_mirror

        metrics = run_mirror(out) / "metrics.jsonl"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"trainer exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
        if any(r.get("step", 0) >= signal_step for r in rows):
            break
        time.sleep(0.02)
    t_sig = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    t_exit = time.time() - t_sig
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    (pre,) = [r for r in rows if r.get("event") == "preempted"] or [None]
    if pre is None:
        raise SystemExit(f"no preemption row (exit {proc.returncode}): {err[-2000:]}")
    return {"exit_code": proc.returncode, "step": pre["step"], "preempt_s": pre["preempt_s"],
            "checkpoint_s": pre["checkpoint_s"], "signal_to_exit_s": round(t_exit, 3),
            "step_s": pre["step_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    ap.add_argument("--utterances", type=int, default=60)
    ap.add_argument("--signal-step", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--targets", default="local,s3")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    ds = dataset(args.work_dir, args.utterances)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = []
    for target in args.targets.split(","):
        server = None
        if target == "s3":
            from shardtrain.testing.s3server import LocalS3

            server = LocalS3(Path(tempfile.mkdtemp(prefix="bench-preempt-s3-"))).start()
            env_t, so = {**env, "AWS_DEFAULT_REGION": "us-east-1"}, server.storage_options
        else:
            env_t, so = env, None
        try:
            for i in range(args.repeats):
                out = (f"{server.make_bucket(f'preempt-{i}')}/run" if server else
                       tempfile.mkdtemp(prefix="bench-preempt-", dir=args.work_dir))
                row = {"target": target, "run": i, **one_run(ds, out, args.signal_step, so, env_t)}
                print(json.dumps({"bench": "preempt", "git": git_sha(), **row}), flush=True)
                results.append(row)
        finally:
            if server is not None:
                server.stop()
    table = []
    for target in args.targets.split(","):
        rs = [r for r in results if r["target"] == target]
        cell = {k: summarize([r[k] for r in rs]) for k in ("preempt_s", "checkpoint_s", "step_s", "signal_to_exit_s")}
        table.append({"target": target, "runs": str(len(rs)), "exit": ",".join(sorted({str(r["exit_code"]) for r in rs})),
                      **{k: f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})" for k, v in cell.items()}})
    print(markdown_table(table, [("target", "--out"), ("runs", "runs"), ("exit", "exit"),
                                 ("preempt_s", "signal -> committed (s)"), ("checkpoint_s", "checkpoint write (s)"),
                                 ("step_s", "step (s)"), ("signal_to_exit_s", "signal -> exit (s)")]))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
