"""Per-bucket budgets from `shardtrain tune` against the best single max_batch_seconds at the same memory target.

    tone corpus (make_corpus, durations uniform in 2-16 s) -> `shardtrain pack` (cached in --work-dir)
    -> tune (train/tune.py) on the device at --memory-mb: the table, its tune time
    -> peer: one max_batch_seconds = the smallest budget of the table (the best single budget whose batches never
       exceed the target: the longest bucket's, by the same measurement)
    -> `shardtrain train --pipeline tiny_cpu` for --steps steps with each, in fresh processes, interleaved
       (tuned, single, tuned, single, ...), the closed loop off so each runs the table it was given
    -> audio seconds per second of training (keys x index durations / summed step time), batch fill (audio /
       the batch's own budget), padding share, peak memory per step (train/memory.py figure), OOM splits;
       one JSON line and a markdown table

On the CPU the memory figure is the model of train/memory.py (parameters, gradients, optimiser state and the
activations saved for backward), measured the same way for both; on CUDA it would be max_memory_allocated
(this task had no GPU lent, so the CUDA figures with librispeech_base and bf16 are left for later). Timings on a
shared machine are noisy: read the ratio of the interleaved runs, not absolute numbers. Run:

    .venv/bin/python -m benchmarks.train.bench_tune                      # 160 utterances, 4 buckets, 2 x 24 steps
    .venv/bin/python -m benchmarks.train.bench_tune --steps 60 --repeats 3 --memory-mb 250
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.train.bench_train_rss import dataset  # (tone corpus, durations uniform in 2-16 s, packed once)
from benchmarks.common import DEFAULT_WORK_DIR, REPO, git_sha, machine, markdown_table

SETTINGS = ["train.progress=false", "train.tensorboard=false", "train.log_every_steps=1", "train.val_every_steps=0",
            "train.ckpt_every_steps=0", "train.log_keys=true", "train.cpu_threads=1", "budget.adapt=false",
            "train.warmup_steps=10"]


def tune_table(ds: str, memory_mb: float | None, buckets: int, out: Path, *, pipeline: str = "tiny_cpu",
               device: str = "cpu", extra: list[str] = (), timeout_s: float | None = None) -> dict:
    """`shardtrain tune` in a fresh process; memory_mb None: the target is the tool's share of device memory."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "shardtrain", "tune", "--data", ds, "--pipeline", pipeline, "--out", str(out),
           "--device", device, "--buckets", str(buckets), "--set", "train.cpu_threads=1"]
    cmd += ["--memory-limit-mb", str(memory_mb)] if memory_mb is not None else []
    for s in extra:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO, timeout=timeout_s,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    doc = json.loads(out.read_text())
    doc["wall_s"] = time.perf_counter() - t0
    return doc


def train_run(ds: str, out: Path, steps: int, memory_mb: float, extra: list[str], *, pipeline: str = "tiny_cpu",
              launcher: list[str] | None = None, timeout_s: float | None = None) -> dict:
    """`shardtrain train` for `steps` steps in a fresh process (`launcher`: the interpreter command that runs the
    CLI, default `python -m shardtrain`), read back from its metrics, keys and config."""
    import pyarrow.parquet as pq

    cmd = (launcher or [sys.executable, "-m", "shardtrain"]) + [
        "train", "--data", ds, "--pipeline", pipeline, "--max-steps", str(steps), "--out", str(out)]
    for s in SETTINGS + [f"budget.memory_limit_mb={memory_mb}"] + extra:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO, timeout=timeout_s,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "loss" in r][2:]  # the first two steps warm up
    dur = {r["key"]: r["duration_s"] for r in pq.read_table(Path(ds) / "index.parquet", columns=["key", "duration_s"])
           .to_pylist()}
    by_step: dict[int, list[list[float]]] = {}  # one key-log line per loader batch: several a step under accumulation
    for x in (out / "keys" / "rank00000.jsonl").read_text().splitlines():
        line = json.loads(x)
        by_step.setdefault(line["step"], []).append([dur[k] for k in line["keys"]])
    cfg = json.loads((out / "config.json").read_text())
    table = cfg["stream"]["bucket"]["budget_table"]
    single = cfg["stream"]["bucket"]["max_batch_seconds"]

    def budget(d: list[float]) -> float:
        if not table:
            return single
        return next((b for e, b in table if max(d) <= e), table[-1][1])

    trained = [r for r in steps_rows if r["step"] in by_step]
    loader_batches = [b for r in trained for b in by_step[r["step"]] if b]  # fill and padding: per loader batch
    audio = [sum(map(sum, by_step[r["step"]])) for r in trained]
    secs = [a / r["audio_s_per_s"] for a, r in zip(audio, trained)]
    return {"audio_s_per_s": sum(audio) / sum(secs), "steps": len(trained),
            "audio_per_step_s": statistics.mean(audio),
            "fill": statistics.mean(sum(b) / budget(b) for b in loader_batches),
            "padding": 1 - statistics.mean(sum(b) / (len(b) * max(b)) for b in loader_batches),
            "peak_mb": max(r.get("mem_peak_mb", 0.0) for r in rows if "loss" in r),
            "oom_splits": sum(1 for r in rows if r.get("event") == "oom_split"),
            "data_wait_pct": statistics.mean(r["data_wait_pct"] for r in trained),
            "step_peaks": [[max(max(b) for b in by_step[r["step"]] if b), r.get("mem_peak_mb", 0.0)]
                           for r in trained if any(by_step[r["step"]])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    ap.add_argument("--utterances", type=int, default=160)
    ap.add_argument("--buckets", type=int, default=4)
    ap.add_argument("--memory-mb", type=float, default=200.0)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    ds = dataset(args.work_dir, args.utterances)
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as tmp:
        doc = tune_table(ds, args.memory_mb, args.buckets, Path(tmp) / "budget.json")
        single = min(b for _, b in doc["budget_table"])
        runs: dict[str, list[dict]] = {"tuned": [], "single": []}
        for i in range(args.repeats):
            for name, extra in (("tuned", [f"budget.file={Path(tmp) / 'budget.json'}"]),
                                ("single", [f"stream.bucket.max_batch_seconds={single}",
                                            f"stream.bucket.num_buckets={args.buckets}"])):
                runs[name].append(train_run(ds, Path(tmp) / f"{name}{i}", args.steps, args.memory_mb, extra))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "step_peaks"} for n, rs in runs.items()}
    result = {"bench": "tune", "git": git_sha(), "machine": machine(), "device": "cpu",
              "memory_target_mb": args.memory_mb, "tune_s": doc["tune_s"], "tune_wall_s": round(doc["wall_s"], 1),
              "table": doc["budget_table"], "single_max_batch_seconds": single, "runs": runs, "median": med,
              "throughput_ratio": med["tuned"]["audio_s_per_s"] / med["single"]["audio_s_per_s"],
              "audio_per_step_ratio": med["tuned"]["audio_per_step_s"] / med["single"]["audio_per_step_s"],
              "cuda": "not measured: no GPU lent to this task"}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    table_rows = [{"config": n, **{k: f"{v:.3g}" for k, v in m.items()}} for n, m in med.items()]
    print(markdown_table(table_rows, [("config", "budgets"), ("audio_s_per_s", "audio s / s"),
                                      ("audio_per_step_s", "audio s / step"), ("fill", "fill of budget"),
                                      ("padding", "padding"), ("peak_mb", "peak MiB"), ("oom_splits", "OOM splits")]))
    print(f"tuned table {doc['budget_table']} (tune {doc['tune_s']:.0f} s) vs single max_batch_seconds={single}; "
          f"throughput x{result['throughput_ratio']:.2f}, audio per step x{result['audio_per_step_ratio']:.2f} "
          f"at target {args.memory_mb:.0f} MiB")


if __name__ == "__main__":
    main()
