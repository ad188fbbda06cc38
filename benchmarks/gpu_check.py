"""GPU check: every CUDA figure of the design in one command (at most ~10 minutes on one GPU), one JSON + Markdown.

    python -m benchmarks.gpu_check              # or scripts/gpu-check; no GPU: says so in one line, exits 0
    python -m benchmarks.gpu_check --dry-run    # the same parts on the CPU at tiny sizes (tests/integration)

Parts, each in a fresh process under its own time bound (a part that runs over is stopped and recorded as
"timeout"; the JSON and Markdown are rewritten after every part, so what was measured survives):
    data       synthetic tone corpus (durations uniform in 2-16 s; dry run 1-5 s) packed with `shardtrain pack` (cached)
    cuda_tests the suite's CUDA tests (pytest -k cuda): passed / skipped / failed
    augment    DeviceAugment (speed, reverb, noise, gain, log-mel, normalise, SpecAugment) batched on the device
               against the CPU path per utterance (bench_augment.time_chain); goal >= 50x
    amp_step   `shardtrain train --pipeline librispeech_base` with bf16 autocast: data wait share of step time
               (the trainer's data_wait_pct); goal < 2%
    tune       `shardtrain tune` by device memory, then the tuned table against its best single budget (the
               smallest of the table) in interleaved `shardtrain train` runs (bench_tune): audio s per s, goal
               >= 1.3x; peak device memory per bucket (max_memory_allocated, train/memory.py) against the target
    oom        a real CUDA out-of-memory: the allocator capped at the tune target
               (torch.cuda.set_per_process_memory_fraction in this benchmark's launcher, not in the product) and a
               single budget 3x the table's largest; the trainer splits the batch (update.py) and the run finishes
    onnx       ONNX Runtime on CUDA when its CUDAExecutionProvider is present (bench_infer on the amp_step run)

Writes benchmarks/results/gpu_check.json and .md (--dry-run: a temporary folder unless --out-dir). Cost of the
dry run: ~30-60 s on 2 shared cores (57 s with the load average at 2.5, where 2-16 s utterances took 105 s).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import common


@dataclass(frozen=True)
class Sizes:
    """How big each part is: the full check on a GPU, or the dry run's tiny sizes on the CPU."""
    device: str
    utterances: int
    augment_batch: int
    augment_duration_s: float
    pipeline: str
    steps: int
    buckets: int
    memory_mb: float  # the memory target of tune, of the per-bucket peaks and of the OOM part's allocator cap
    repeats: int  # tuned / single pairs
    bounds_s: dict
    total_s: float  # every part together: a part gets at most what is left of this
    durations_s: tuple[float, float] = (2.0, 16.0)  # the data part's durations, uniform in this range


# 16 GiB, not the H200's 139: a few thousand utterances fill 16 GiB budgets in every bucket (a 139 GiB budget is
# larger than a whole bucket of this corpus, so tuned and single would read the same batches), and the steps stay
# inside the ten minutes; the figure is still the device's own (max_memory_allocated).
GPU = Sizes("cuda", 3000, 64, 15.0, "librispeech_base", 30, 8, 16384.0, 2,
            {"data": 90, "cuda_tests": 45, "augment": 45, "amp_step": 90, "tune": 180, "oom": 60, "onnx": 60}, 570)
# The dry run proves every part runs and writes its row, at the smallest sizes that still give every bucket steps:
# 1-5 s utterances and a 120 MiB target keep each CPU step to a fraction of a second (the suite runs it).
DRY = Sizes("cpu", 24, 2, 2.0, "tiny_cpu", 4, 2, 120.0, 1,
            {"data": 60, "cuda_tests": 60, "augment": 60, "amp_step": 60, "tune": 120, "oom": 60, "onnx": 30}, 400,
            durations_s=(1.0, 5.0))
TRAIN_SET = ["train.precision=bf16"]  # bf16 autocast on both devices
DRY_SET = ["stream.bucket.max_batch_seconds=12", "stream.num_workers=0"]
GOALS = {"augment": "device batched / CPU per utterance >= 50x", "amp_step": "data wait < 2% of step time",
         "tune": "tuned / best single budget >= 1.3x audio s per s", "oom": "real CUDA OOM split, run finishes",
         "cuda_tests": "all pass", "onnx": "ORT CUDA runs", "data": "packed"}
CUDA_TESTS = ["tests/train/test_augment.py", "tests/interop/test_torchdata.py"]


# ---------------------------------------------------------------------------------------------- parts
def part_data(sizes: dict, work: str) -> dict:
    """Tones of durations uniform in sizes["durations_s"] (2-16 s on the GPU), synthesised in one process per core,
    packed (cached in `work`)."""
    import numpy as np

    from shardtrain.pack.packer import PackConfig, pack
    from shardtrain.testing.corpus import make_corpus

    n, cores = sizes["utterances"], os.cpu_count() or 1
    lo, hi = sizes["durations_s"]
    tag = f"{n}" if (lo, hi) == (2.0, 16.0) else f"{n}-{lo:g}-{hi:g}s"  # the GPU run's cached dataset keeps its name
    ds, corpus = Path(work) / f"gpu-ds-{tag}", Path(work) / f"gpu-corpus-{tag}"
    if not (ds / "manifest.json").exists():  # written last: marks a complete pack
        durs = [float(x) for x in np.random.default_rng(0).uniform(lo, hi, n).round(2)]
        parts = [corpus / f"part{c:02d}" for c in range(min(n, cores))]
        with ProcessPoolExecutor(len(parts)) as ex:
            list(ex.map(make_corpus, parts, [durs[c::len(parts)] for c in range(len(parts))]))
        lines = ["path\ttext\tspeaker"]  # one TSV over the parts (same file names: pack suffixes the keys)
        for d in parts:
            lines += [f"{d}/{row}" for row in (d / "manifest.tsv").read_text().splitlines()[1:]]
        (corpus / "all.tsv").write_text("\n".join(lines) + "\n")
        pack(PackConfig(input=str(corpus / "all.tsv"), output=str(ds), workers=cores, progress=False,
                        overwrite=True))
    return {"dataset": str(ds), "corpus_part": str(corpus / "part00"), **common.dataset_summary(ds)}


def part_augment(sizes: dict) -> dict:
    """The device's batched chain against the CPU's per-utterance loop, same waves, same chain."""
    import torch

    from benchmarks.train.bench_augment import make_batch, time_chain
    from shardtrain.train.augment import AugmentConfig, DeviceAugment
    from shardtrain.train.features import FeatureConfig

    rate, device = 16000, sizes["device"]
    chain = DeviceAugment(AugmentConfig(), FeatureConfig(sample_rate_hz=rate), rate)
    waves, lengths = make_batch(sizes["augment_batch"], sizes["augment_duration_s"], rate, 0)
    audio_s = float(lengths.sum()) / rate
    _, cpu_per_utt = time_chain(chain, waves, lengths, "cpu", 1, 0)
    dev_batched, _ = time_chain(chain.to(device), waves, lengths, device, 3, 0)
    return {"utterances": len(lengths), "audio_s": round(audio_s, 1), "torch_threads": torch.get_num_threads(),
            "device_batched_audio_s_per_s": round(audio_s / dev_batched, 1),
            "cpu_per_utt_audio_s_per_s": round(audio_s / cpu_per_utt, 1),
            "speedup": round(cpu_per_utt / dev_batched, 2)}


def _train(sizes: dict, ds: str, out: Path, extra: list[str], *, launcher: list[str] | None = None,
           timeout_s: float) -> dict:
    from benchmarks.train.bench_tune import train_run

    extra = TRAIN_SET + [f"train.device={sizes['device']}"] + (DRY_SET if sizes["device"] == "cpu" else []) + extra
    return train_run(ds, out, sizes["steps"], sizes["memory_mb"], extra, pipeline=sizes["pipeline"],
                     launcher=launcher, timeout_s=timeout_s)


def _device_mb() -> float:
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**20


def part_amp_step(sizes: dict, ds: str, out: str, bound_s: float) -> dict:
    r = _train(sizes, ds, Path(out), [], timeout_s=bound_s)
    return {k: v for k, v in r.items() if k != "step_peaks"}


def part_tune(sizes: dict, ds: str, out: str, bound_s: float) -> dict:
    """The table by device memory, then tuned and single interleaved (tuned, single, tuned, single)."""
    from benchmarks.train.bench_tune import tune_table

    t0 = time.perf_counter()
    budget = Path(out) / "budget.json"
    Path(out).mkdir(parents=True, exist_ok=True)
    doc = tune_table(ds, sizes["memory_mb"], sizes["buckets"], budget, pipeline=sizes["pipeline"],
                     device=sizes["device"], extra=TRAIN_SET, timeout_s=bound_s / 2)
    single = min(b for _, b in doc["budget_table"])
    target_mb = doc["memory_target_bytes"] / 2**20
    runs: dict[str, list[dict]] = {"tuned": [], "single": []}
    stopped = None
    for i in range(sizes["repeats"]):
        for name, extra in (("tuned", [f"budget.file={budget}"]),
                            ("single", [f"stream.bucket.max_batch_seconds={single}",
                                        f"stream.bucket.num_buckets={sizes['buckets']}"])):
            left = bound_s - (time.perf_counter() - t0)
            if stopped or left < 5 or (i and left < bound_s / 3):  # a second pair only with a third of the bound
                break
            try:
                runs[name].append(_train(sizes, ds, Path(out) / f"{name}{i}", extra, timeout_s=left))
            except subprocess.TimeoutExpired:  # the table and the runs so far are still the part's result
                stopped = f"{name} run {i} stopped at the part's bound"
    rate = {n: sum(r["audio_s_per_s"] for r in rs) / len(rs) for n, rs in runs.items() if rs}
    return {"table": doc["budget_table"], "tune_s": doc["tune_s"], "memory_target_mb": round(target_mb, 1),
            "single_max_batch_seconds": single, "runs": {n: len(rs) for n, rs in runs.items()},
            "tuned_audio_s_per_s": round(rate.get("tuned", 0), 1), "single_audio_s_per_s": round(rate.get("single", 0), 1),
            "ratio": round(rate["tuned"] / rate["single"], 3) if len(rate) == 2 else None,
            "per_bucket": per_bucket(doc["budget_table"], [p for r in runs["tuned"] for p in r["step_peaks"]],
                                     target_mb),
            "oom_splits": sum(r["oom_splits"] for rs in runs.values() for r in rs), "budget_file": str(budget),
            "stopped": stopped}


def per_bucket(table: list, step_peaks: list, target_mb: float) -> list[dict]:
    """Peak memory of the steps of each bucket (by the batch's longest utterance, as the table is read) vs target."""
    rows = []
    for i, (edge, budget) in enumerate(table):
        lo = table[i - 1][0] if i else 0.0
        peaks = [mb for longest, mb in step_peaks if lo < longest <= edge or (i == len(table) - 1 and longest > edge)]
        rows.append({"bucket_edge_s": edge, "budget_s": budget, "steps": len(peaks),
                     "peak_mb": round(max(peaks), 1) if peaks else None,
                     "of_target": round(max(peaks) / target_mb, 3) if peaks else None})
    return rows


OOM_LAUNCHER = ("import sys, torch; torch.cuda.set_per_process_memory_fraction(float(sys.argv.pop(1))); "
                "import shardtrain.cli as c; sys.exit(c.main(sys.argv[1:]))")


def part_oom(sizes: dict, ds: str, out: str, tune: dict, bound_s: float) -> dict:
    """A single budget 3x the table's largest under an allocator capped at the tune target: the first long batch
    runs out of device memory for real; the trainer splits it and the run reaches its last step."""
    big = 3 * max(b for _, b in tune["table"])
    extra = [f"stream.bucket.max_batch_seconds={big}", f"stream.bucket.num_buckets={sizes['buckets']}"]
    launcher = None
    if sizes["device"] == "cuda":
        launcher = [sys.executable, "-c", OOM_LAUNCHER, str(tune["memory_target_mb"] / _device_mb())]
    r = _train(sizes, ds, Path(out), extra, launcher=launcher, timeout_s=bound_s)
    return {"max_batch_seconds": big, "capped_at_mb": tune["memory_target_mb"] if launcher else None,
            "oom_splits": r["oom_splits"], "steps": r["steps"], "peak_mb": round(r["peak_mb"], 1),
            "survived": True, "real_oom": bool(launcher) and r["oom_splits"] > 0}


def part_cuda_tests(bound_s: float) -> dict:
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda", *CUDA_TESTS],
                         capture_output=True, text=True, cwd=common.REPO, timeout=bound_s, env=common.subprocess_env())
    last = (res.stdout.strip().splitlines() or [""])[-1]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|error|deselected)", last)}
    return {"rc": res.returncode, "summary": last, **counts}


def part_onnx(run_dir: str, val_from: str, out: str, bound_s: float) -> dict:
    """bench_infer on the amp_step run's checkpoint, CPU and CUDA, on 10 utterances of the corpus (no espeak-ng)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return {"present": False, "note": "onnxruntime not installed"}
    providers = ort.get_available_providers()
    if "CUDAExecutionProvider" not in providers:
        return {"present": False, "providers": providers}
    val = Path(out) / "val"
    val.mkdir(parents=True, exist_ok=True)
    for flac in sorted(Path(val_from).glob("*.flac"))[:10]:
        for f in (flac, flac.with_suffix(".txt")):
            (val / f.name).symlink_to(f)
    cmd = [sys.executable, "-m", "benchmarks.infer.bench_infer", "--checkpoint", run_dir, "--devices", "cpu,cuda",
           "--val", str(val), "--repeats", "1", "--out-dir", out]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=common.REPO, timeout=bound_s,
                         env=common.subprocess_env())
    if res.returncode:
        raise RuntimeError(f"bench_infer rc {res.returncode}: {res.stderr.strip()[-300:]}")
    return {"present": True, "providers": providers, "result": json.loads((Path(out) / "bench_infer.json").read_text())}


# ---------------------------------------------------------------------------------------------- main
def _figure(name: str, r: dict) -> str:
    """The part's headline, for the summary table."""
    if r.get("status") != "ok":
        return r.get("error", r.get("status", ""))
    return {"data": lambda: f"{r['samples']} utterances, {r['audio_hours']} h, {r['shards']} shards",
            "cuda_tests": lambda: r["summary"],
            "augment": lambda: f"{r['speedup']}x ({r['device_batched_audio_s_per_s']} vs "
                               f"{r['cpu_per_utt_audio_s_per_s']} audio s/s)",
            "amp_step": lambda: f"data wait {r['data_wait_pct']:.2f}%, {r['audio_s_per_s']:.0f} audio s/s",
            "tune": lambda: f"{r['ratio']}x ({r['tuned_audio_s_per_s']} vs {r['single_audio_s_per_s']} audio s/s)",
            "oom": lambda: f"{r['oom_splits']} splits, {'real' if r['real_oom'] else 'no'} OOM, finished "
                           f"{r['steps']} steps",
            "onnx": lambda: "ORT CUDA measured" if r.get("present") else "absent"}[name]()


def write(result: dict, out_dir: Path) -> Path:
    """gpu_check.json and gpu_check.md: the summary rows, then peak memory per bucket against the target."""
    result["rows"] = [{"part": n, "status": r.get("status"), "figure": _figure(n, r), "goal": GOALS[n],
                       "wall_s": r.get("wall_s")} for n, r in result["parts"].items()]
    common.write_json(out_dir / "gpu_check.json", result)
    md = [f"GPU check on {result['device']} ({'dry run, tiny sizes' if result['dry_run'] else 'full'}), "
          f"git {result['git_sha']}", "",
          common.markdown_table(result["rows"], [(k, k) for k in ("part", "status", "figure", "goal", "wall_s")])]
    buckets = result["parts"].get("tune", {}).get("per_bucket")
    if buckets:
        md += ["", "Peak device memory per bucket (tuned runs) against the target "
               f"{result['parts']['tune']['memory_target_mb']} MiB:", "",
               common.markdown_table(buckets, [(k, k) for k in buckets[0]])]
    path = out_dir / "gpu_check.md"
    path.write_text("\n".join(md) + "\n")
    return path


ISOLATED = ("data", "augment")
"""Parts that measure in their own interpreter (run_isolated, stopped at the bound); the others run subprocesses
with the bound as their timeout, so they need no interpreter of their own."""


class Check:
    """The result so far, its files, and the clock every part's bound is cut to."""

    def __init__(self, sizes: Sizes, out_dir: Path, device_name: str, dry_run: bool):
        self.sizes, self.out_dir, self.deadline = sizes, out_dir, time.monotonic() + sizes.total_s
        self.result = {"benchmark": "gpu_check", "git_sha": common.git_sha(), "machine": common.machine(),
                       "device": device_name, "dry_run": dry_run, "sizes": asdict(sizes), "parts": {}}

    def run(self, part, **kwargs) -> dict | None:
        """One part (a part_* function), stopped at min(its bound, what is left of the total); the files
        rewritten after it."""
        name = part.__name__.removeprefix("part_")
        t0 = time.perf_counter()
        bound = min(self.sizes.bounds_s[name], self.deadline - time.monotonic() - 10)
        try:
            if bound < 5:
                raise TimeoutError(f"not started: {max(bound, 0):.0f} s left of the {self.sizes.total_s:.0f} s total")
            if name in ISOLATED:
                r = common.run_isolated("gpu_check", f"part_{name}", kwargs, timeout_s=bound)
            else:
                r = part(**kwargs, bound_s=bound)
            r = {"status": "ok", **r}
        except (subprocess.TimeoutExpired, TimeoutError) as e:
            r = {"status": "timeout", "error": str(e).splitlines()[0][:300]}
        except Exception as e:  # a failed part is a row of the table, never the end of the check
            lines = [x for x in str(e).splitlines() if x.strip()]
            r = {"status": "error", "error": (lines[-1] if lines else type(e).__name__)[:300]}
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        self.result["parts"][name] = r
        write(self.result, self.out_dir)
        return r if r["status"] == "ok" else None


def check(sizes: Sizes, out_dir: Path, work: Path, device_name: str, dry_run: bool) -> Path:
    c = Check(sizes, out_dir, device_name, dry_run)
    sz = asdict(sizes)
    work.mkdir(parents=True, exist_ok=True)
    runs = Path(tempfile.mkdtemp(prefix="runs-", dir=work))
    data = c.run(part_data, sizes=sz, work=str(work))
    c.run(part_cuda_tests)
    c.run(part_augment, sizes=sz)
    if data:
        ds = data["dataset"]
        amp = c.run(part_amp_step, sizes=sz, ds=ds, out=str(runs / "amp"))
        tune = c.run(part_tune, sizes=sz, ds=ds, out=str(runs / "tune"))
        if tune:
            c.run(part_oom, sizes=sz, ds=ds, out=str(runs / "oom"), tune=tune)
        if amp:
            c.run(part_onnx, run_dir=str(runs / "amp"), val_from=data["corpus_part"], out=str(runs / "onnx"))
    return write(c.result, out_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the same parts on the CPU at tiny sizes (the test suite)")
    ap.add_argument("--out-dir", default=None, help="where gpu_check.json/.md go (default benchmarks/results; "
                                                    "--dry-run: a temporary folder)")
    ap.add_argument("--work-dir", default=None, help="corpus, dataset and runs (default the benchmarks cache)")
    args = ap.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False); nothing measured")
        return 0
    out_dir = Path(args.out_dir or (tempfile.mkdtemp(prefix="gpu-check-") if args.dry_run
                                    else common.BENCH_DIR / "results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or (out_dir / "work" if args.dry_run else common.DEFAULT_WORK_DIR / "gpu-check"))
    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    md = check(DRY if args.dry_run else GPU, out_dir, work, name, args.dry_run)
    print(md.read_text())
    print(f"gpu-check: table in {md} (JSON: {md.with_suffix('.json')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
