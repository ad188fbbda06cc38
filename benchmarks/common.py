"""Shared plumbing of the loader benchmarks: cached inputs, isolated runs, statistics and output.

    work dir (cached across runs; delete it to regenerate)
      corpus-<kind>-<n>-s<seed>/      speech (espeak-ng, synth_speech_corpus) or tone (make_corpus) FLAC + .txt
      ds-<kind>-<n>-s<seed>-<mb>mb/   `shardtrain pack` output (manifest.json written last = cache marker)
      shar-<kind>-<n>-s<seed>-<k>/    lhotse Shar export of the same audio (`.done` marker)
    run_isolated(script, func, kwargs) -> one fresh Python process per measured run
    summarize(values) -> median / min / max; markdown_table(rows, cols); json line with the git sha

Why a fresh process per run: peak RSS is measured over the process tree of the run, so every tool starts from
the same empty interpreter (imports done before the clock starts) and no tool inherits another's heap, page
faults or DataLoader workers. The cost is ~2-4 s of imports per run, outside the timed region.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
DEFAULT_WORK_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shardtrain-bench"
log = logging.getLogger("bench")


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except OSError:
        return ""


def machine() -> dict:
    import platform

    import psutil

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "mem_gb": round(psutil.virtual_memory().total / 2**30, 1), "load_avg_1m": round(os.getloadavg()[0], 2)}


# ---------------------------------------------------------------------------------------------- cached inputs
def prepare_corpus(work_dir: Path, n: int, *, kind: str = "speech", seed: int = 0,
                   min_duration_s: float = 1.0, max_duration_s: float = 6.0) -> Path:
    """A flat folder of n FLAC files + .txt transcripts; generated once per (kind, n, seed), then reused.

    speech: espeak-ng sentences (~1-7 s, real FLAC compression, ~1 min per 2,000 on 2 cores);
    tone: synthetic tones with durations uniform in [min_duration_s, max_duration_s] (no espeak needed).
    """
    root = work_dir / f"corpus-{kind}-{n}-s{seed}"
    if (root / ".done").exists():
        return root
    t0 = time.perf_counter()
    if kind == "speech":
        from shardtrain.testing.speech import synth_speech_corpus

        synth_speech_corpus(root, n, seed=seed, workers=os.cpu_count() or 2, layout="flat", progress=False)
    elif kind == "tone":
        from shardtrain.testing.corpus import make_corpus

        rng = np.random.default_rng(seed)
        make_corpus(root, np.round(rng.uniform(min_duration_s, max_duration_s, n), 2).tolist(), seed=seed)
    else:
        raise ValueError(f"--corpus must be speech or tone, got {kind!r}")
    (root / ".done").write_text("ok\n")
    log.info("corpus %s: %d utterances in %.1f s", root, n, time.perf_counter() - t0)
    return root


def prepare_dataset(work_dir: Path, corpus: Path, *, shard_mb: float = 16.0) -> Path:
    """`shardtrain pack` of the corpus (cached; manifest.json is written last, so it marks a complete pack)."""
    out = work_dir / f"ds-{corpus.name.removeprefix('corpus-')}-{shard_mb:g}mb"
    if (out / "manifest.json").exists():
        return out
    from shardtrain.pack.packer import PackConfig, pack

    t0 = time.perf_counter()
    pack(PackConfig(input=str(corpus), output=str(out), workers=os.cpu_count() or 2, target_shard_mb=shard_mb,
                    progress=False, overwrite=True))
    log.info("packed %s in %.1f s", out, time.perf_counter() - t0)
    return out


def existing_dataset(work_dir: Path, url: str) -> Path:
    """A dataset the user already packed, as a local folder: a local path as it is; an s3:// (or other remote)
    URL copied once into work_dir (manifest, its index and its shards, through shardtrain.storage), so every
    tool reads the same bytes from local disk and from the loopback S3 server. Raises naming the URL when it holds
    no manifest.json (not a packed dataset)."""
    from shardtrain.storage import fs as sfs

    if sfs.is_local(url):
        ds = Path(url.removeprefix("file://")).resolve()
        if not (ds / "manifest.json").is_file():
            raise SystemExit(f"--dataset {url}: no manifest.json there; pass a folder written by `shardtrain pack`")
        return ds
    out = work_dir / ("given-" + hashlib.sha256(url.encode()).hexdigest()[:12])
    if (out / "manifest.json").exists():  # written last: marks a complete copy
        return out
    if not sfs.exists(sfs.join(url, "manifest.json")):
        raise SystemExit(f"--dataset {url}: no manifest.json there; pass a dataset written by `shardtrain pack`")
    out.mkdir(parents=True, exist_ok=True)
    manifest = sfs.read_bytes(sfs.join(url, "manifest.json"))
    m = json.loads(manifest)
    names = [m.get("index") or "index.parquet"] + [s["name"] for s in m["shards"]]
    t0 = time.perf_counter()
    for name in names:
        (out / name).write_bytes(sfs.read_bytes(sfs.join(url, name)))
    (out / "manifest.json").write_bytes(manifest)
    log.info("copied %s (%d files) to %s in %.1f s", url, len(names) + 1, out, time.perf_counter() - t0)
    return out


def dataset_summary(ds: Path) -> dict:
    m = json.loads((ds / "manifest.json").read_text())
    return {"samples": m["totals"]["samples"], "audio_hours": round(m["totals"]["seconds"] / 3600, 3),
            "bytes_mb": round(m["totals"]["bytes"] / 2**20, 1), "shards": m["totals"]["shards"],
            "mean_duration_s": round(m["totals"]["seconds"] / max(1, m["totals"]["samples"]), 3),
            "sample_rate_hz": dataset_rate(ds)}


def dataset_rate(ds: Path) -> int:
    """The sample rate of a packed dataset (its index's one `sample_rate_hz`): what the peers' decoded lengths are
    divided by to count audio seconds. A fixed 16 kHz made an 8 kHz dataset's webdataset run and decode limit
    report half the audio the loader delivered (and a 24 kHz one 1.5x), so every ratio against them was off by the
    rate. One column read (a few MB per million rows). Mixed rates raise: the loader refuses them too."""
    import pyarrow.parquet as pq

    m = json.loads((ds / "manifest.json").read_text())
    col = pq.read_table(ds / (m.get("index") or "index.parquet"), columns=["sample_rate_hz"]).column(0)
    rates = sorted({int(r) for r in np.unique(col.to_numpy())})
    if len(rates) != 1:
        raise SystemExit(f"{ds}: sample rates {rates}; the benchmarks (and the loader) need one rate per dataset")
    return rates[0]


def shard_paths(ds: Path) -> list[str]:
    m = json.loads((ds / "manifest.json").read_text())
    return [str(ds / s["name"]) for s in m["shards"]]


def warm_page_cache(*folders: Path) -> int:
    """Read every file below `folders` once (returns the bytes read), so each measured run starts from the same warm
    page cache. Why: this VM's host reclaims idle page cache within seconds (kdamond; 103 -> 65 MB of a 122 MB
    corpus resident after 20 s idle), so a run whose input was last read a while ago (the first tool of a round, a
    tool reading other files than the one before it) read part of it from the disk, and the ratios measured the
    reclaim, not the tools."""
    n = 0
    for folder in folders:
        for p in sorted(Path(folder).rglob("*")):
            if p.is_file():
                with open(p, "rb", buffering=0) as f:
                    while b := f.read(1 << 20):
                        n += len(b)
    return n


def upload_dir(s3, local: Path, bucket: str, prefix: str) -> str:
    """Copy every file of `local` to s3://bucket/prefix/ (flat) and return that URL."""
    url = s3.make_bucket(bucket)
    fs = s3.fs()
    for p in sorted(local.iterdir()):
        if p.is_file() and not p.name.startswith("."):
            fs.put_file(str(p), f"{bucket}/{prefix}/{p.name}")
    return f"{url}/{prefix}"


def presigned_urls(s3, bucket: str, keys: Sequence[str], expires_s: int = 6 * 3600) -> list[str]:
    """Plain http URLs for objects of the loopback server: how tools without an s3:// handler read S3."""
    client = s3.client()
    return [client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": k}, ExpiresIn=expires_s)
            for k in keys]


# ---------------------------------------------------------------------------------------------- isolated runs
def subprocess_env(extra: dict | None = None) -> dict:
    """The environment for a child interpreter that imports `benchmarks.*`: this repository last on PYTHONPATH."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO)) if p)
    return env


def script_module(script: str) -> str:
    """`room.script` under benchmarks/ of a script named bare (`bench_loader` -> `load.bench_loader`; a script on top,
    such as `gpu_check`, stays as it is): script names are unique across the rooms, so callers name the script, not
    where it lives."""
    if "." in script or (BENCH_DIR / f"{script}.py").exists():
        return script
    found = sorted(BENCH_DIR.glob(f"*/{script}.py"))
    if len(found) != 1:
        raise ValueError(f"benchmark script {script!r}: {len(found)} files benchmarks/*/{script}.py")
    return f"{found[0].parent.name}.{script}"


def run_isolated(script: str, func: str, kwargs: dict, *, env: dict | None = None, timeout_s: float = 900,
                 cwd: str | None = None) -> dict:
    """Run `func(**kwargs)` of benchmarks.<script> in a fresh interpreter and return its dict result.

    `cwd`: where it runs (default the repository). `python -c` puts the working folder first on sys.path, ahead
    of PYTHONPATH: to import another checkout's `shardtrain`, run in that checkout. This repository is appended
    to PYTHONPATH so `benchmarks` imports there too (a checkout with its own `benchmarks` package runs its own)."""
    code = (f"import sys, json; import benchmarks.{script_module(script)} as m; "
            f"r = m.{func}(**json.loads(sys.argv[1])); print('@@RESULT@@' + json.dumps(r))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True, text=True,
                          env=subprocess_env(env), timeout=timeout_s, cwd=cwd or str(REPO))
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@"):])
    raise RuntimeError(f"{script}.{func}({kwargs}) failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def time_batches(batches, *, sample_rate_hz: int, t_start: float, rss) -> dict:
    """Drain an iterator of (waves [B, T] float32, lengths [B], ...) and time it like shardtrain.load.bench does."""
    samples = n_batches = 0
    real = padded = 0
    first_batch_s = None
    from shardtrain.load.bench import steady_rate

    first_real = 0
    for waves, lengths, *_ in batches:
        if first_batch_s is None:
            first_batch_s = time.perf_counter() - t_start
            first_real = int(lengths.sum())
        n_batches += 1
        samples += int(lengths.shape[0])
        real += int(lengths.sum())
        padded += int(waves.numel())
    wall = time.perf_counter() - t_start
    audio_s = real / sample_rate_hz
    return {"samples": samples, "audio_seconds": round(audio_s, 3), "wall_seconds": round(wall, 3),
            "samples_per_s": round(samples / wall, 2), "audio_s_per_s": round(audio_s / wall, 1),
            "padding_efficiency": round(real / padded, 4) if padded else None, "batches": n_batches,
            "first_batch_s": round(first_batch_s or 0.0, 3), "peak_rss_mb": round(rss.peak_bytes / 2**20, 1),
            "steady_audio_s_per_s": steady_rate(audio_s, first_real / sample_rate_hz, wall, first_batch_s)}


# ---------------------------------------------------------------------------------------------- statistics
METRICS = ("audio_s_per_s", "steady_audio_s_per_s", "samples_per_s", "padding_efficiency", "first_batch_s",
           "peak_rss_mb", "batch_audio_s")
"""batch_audio_s: mean audio seconds per batch (padding efficiency only compares at similar batch sizes)."""


def summarize(values: Sequence[float]) -> dict:
    """Median and min-max spread of repeated runs (spread = the range, honest for 3-5 runs)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def aggregate(runs: list[dict], metrics: Sequence[str] = METRICS) -> dict:
    for r in runs:
        if r.get("batches") and "batch_audio_s" not in r:
            r["batch_audio_s"] = round(r["audio_seconds"] / r["batches"], 1)
    return {m: summarize([r.get(m) for r in runs]) for m in metrics}


def fmt_stat(s: dict, digits: int = 0) -> str:
    """`median (min-max)`; a single run prints the value alone."""
    if s["median"] is None:
        return "-"
    f = (lambda v: f"{v:,.{digits}f}")
    if s["n"] <= 1 or s["min"] == s["max"]:
        return f(s["median"])
    return f"{f(s['median'])} ({f(s['min'])}-{f(s['max'])})"


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def markdown_table(rows: list[dict], columns: Sequence[tuple[str, str]]) -> str:
    """rows of already formatted cells; columns = (key, header)."""
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(str(r.get(k, "")) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def write_json(path: Path, obj: Any) -> None:
    """Results JSON (sorted keys); a dict gets the day it was measured (benchmarks/README.md shows it)."""
    if isinstance(obj, dict) and "date" not in obj:
        obj = {**obj, "date": time.strftime("%Y-%m-%d")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def json_line(obj: dict) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")


def lhotse_cuts(corpus: Path):
    """A lhotse CutSet of a flat corpus folder (`x.flac` + `x.txt`), one supervision per whole recording."""
    from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet

    recs, sups = [], []
    for p in sorted(Path(corpus).glob("*.flac")):
        rec = Recording.from_file(p)
        recs.append(rec)
        sups.append(SupervisionSegment(id=rec.id, recording_id=rec.id, start=0.0, duration=rec.duration,
                                       text=p.with_suffix(".txt").read_text(encoding="utf-8").strip()))
    return CutSet.from_manifests(recordings=RecordingSet.from_recordings(recs),
                                 supervisions=SupervisionSet.from_segments(sups))
