"""Packing throughput: `shardtrain pack` vs webdataset's ShardWriter vs a decode-only pass (vs lhotse's Shar export),
same corpus, same interleaved run.

    corpus (make_corpus tone FLAC, --speech espeak-ng, or --corpus DIR) -> for workers in (1, 2), --repeats rounds:
        shardtrain          pack with its decode check (the default): scan + layout + write + commit, each timed
        shardtrain-nocheck  pack --no-decode-check (the tail check only)
        webdataset          webdataset.ShardWriter: the same FLAC bytes + json, input order, no probe/sort/index
        decode-only         every file fully decoded (int16, soundfile/libsndfile), `workers` processes, nothing
                            written: the limit of a pack that decodes everything once, as the issue defines it
        decode-only-shardtrain  the same with pack's own decoder (format.audio.decoded_frames: dr_flac for FLAC), so
                            the overhead of pack beyond its decoder is visible too
        lhotse              CutSet.to_shar(fields={"recording": "flac"}) (Recording.from_file + re-encode)
    -> per tool: wall, files/s, audio h/s, MB/s, pack's phases (scan, layout, write, commit); per round the ratios
       the issue sets goals for (pack / decode-only, pack --no-decode-check / webdataset), then their medians;
       the 1-minute load average at each round's start and end. JSON (stdout, and --out) + a table.

Every tool writes to a fresh folder on local disk and starts with the corpus read once (common.warm_page_cache:
this VM reclaims idle page cache within seconds); wall time includes each tool's own metadata work; library
imports happen before any timing (pack itself imports no pandas: its index is built from Arrow buffers, so pyarrow's lazy
pandas import never happens; tests/cli/test_app.py). On a shared machine only the ratios within one round mean
anything.
Run (the figures in the README):

    PYTHONPATH=$PWD .venv/bin/python -m shardtrain synth /tmp/c3k --n 3000 --layout flat
    .venv/bin/python -m benchmarks.pack.bench_pack --corpus /tmp/c3k --workers 2 --repeats 3 \\
        --tools decode-only decode-only-shardtrain shardtrain webdataset shardtrain-nocheck \\
        --out benchmarks/results/bench_pack.json

A corpus that packs into one shard (issue 32: `--corpus /tmp/c2k --target-shard-mb 256`, 2,000 files) shows whether
pack spreads a shard's decoding over its workers (LocalEngine slices shards) or runs it on one core.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import common


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_shardtrain(corpus: Path, out: Path, workers: int, target_shard_mb: float, decode_check: bool = True,
                   engine: str = "local") -> dict:
    from shardtrain.pack.packer import AudioTarget, PackConfig, pack

    ray_start_s = 0.0
    if engine == "ray":  # a local Ray cluster of `workers` CPUs, started outside the timed section
        import ray

        t0 = time.perf_counter()
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        ray_start_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        r = pack(PackConfig(input=str(corpus), output=str(out), workers=workers, target_shard_mb=target_shard_mb,
                            audio=AudioTarget(verify_decode=decode_check), progress=False, engine=engine))
        wall_s = time.perf_counter() - t0
    finally:
        if engine == "ray":
            ray.shutdown()
    out_d = {"wall_s": wall_s, "files": r.samples, "audio_s": r.seconds, "bytes": _dir_bytes(out),
             "shards": r.shards, "probe_s": r.probe_s,
             "phases_s": {"scan": r.scan_s, "layout": r.layout_s, "write": r.write_s, "commit": r.commit_s}}
    if engine == "ray":
        out_d["ray_start_s"] = ray_start_s
    return out_d


def _decode_part(files: list[str], decoder: str = "soundfile") -> tuple[int, float]:
    import soundfile as sf

    from shardtrain.format.audio import decoded_frames

    audio_s = 0.0
    for path in files:
        if decoder == "shardtrain":  # the file's bytes, then pack's own check (dr_flac for FLAC)
            data = Path(path).read_bytes()
            # the rate from FLAC's STREAMINFO (20 bits at byte 18): only for the audio-hours column
            rate = int.from_bytes(data[18:21], "big") >> 4 if data[:4] == b"fLaC" else sf.info(path).samplerate
            audio_s += decoded_frames(data) / rate
            continue
        with sf.SoundFile(path) as f:
            n = sum(len(b) for b in f.blocks(blocksize=1 << 16, dtype="int16"))
            audio_s += n / f.samplerate
    return len(files), audio_s


def run_decode_only(corpus: Path, out: Path, workers: int, target_shard_mb: float,
                    decoder: str = "soundfile") -> dict:
    """The decode check's floor: every file fully decoded (int16, as the check does), `workers` processes, nothing
    written. pack (with the check) cannot beat webdataset + this on the same cores with the same decoder.
    `decoder`: "soundfile" (libsndfile, the issue's reference) or "shardtrain" (pack's own: dr_flac for FLAC)."""
    import functools

    files = sorted(str(p) for p in corpus.glob("*.flac"))
    parts = [files[len(files) * k // workers: len(files) * (k + 1) // workers] for k in range(workers)]
    part = functools.partial(_decode_part, decoder=decoder)
    t0 = time.perf_counter()
    if workers == 1:
        res = [part(parts[0])]
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            res = pool.map(part, parts)
    return {"wall_s": time.perf_counter() - t0, "files": sum(n for n, _ in res), "audio_s": sum(a for _, a in res),
            "bytes": 0, "shards": 0}


def _wds_part(args) -> tuple[int, float]:
    import soundfile as sf
    import webdataset as wds

    files, out, part, maxsize = args
    audio_s = 0.0
    with wds.ShardWriter(str(out / f"part{part}-%06d.tar"), maxsize=maxsize, maxcount=10**9, verbose=0) as w:
        for audio in files:
            audio = Path(audio)
            data = audio.read_bytes()
            text = audio.with_suffix(".txt").read_text(encoding="utf-8").strip()
            info = sf.info(str(audio))  # the same header read pack does, for a fair json
            audio_s += info.duration
            meta = {"text": text, "duration_s": info.duration, "sample_rate_hz": info.samplerate}
            w.write({"__key__": audio.stem, "flac": data, "json": json.dumps(meta).encode()})
    return len(files), audio_s


def run_webdataset(corpus: Path, out: Path, workers: int, target_shard_mb: float) -> dict:
    """Input order (no sorting), contiguous slices of the file list, one ShardWriter per process."""
    import contextlib
    import io

    out.mkdir(parents=True)
    files = sorted(str(p) for p in corpus.glob("*.flac"))
    parts = [(files[len(files) * k // workers: len(files) * (k + 1) // workers], out, k,
              int(target_shard_mb * (1 << 20))) for k in range(workers)]
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # ShardWriter prints "# writing ..." per shard
        if workers == 1:
            res = [_wds_part(parts[0])]
        else:
            with multiprocessing.get_context("fork").Pool(workers) as pool:  # children inherit the imports
                res = pool.map(_wds_part, parts)
    return {"wall_s": time.perf_counter() - t0, "files": sum(n for n, _ in res), "audio_s": sum(a for _, a in res),
            "bytes": _dir_bytes(out), "shards": len(list(out.glob("*.tar")))}


def run_lhotse(corpus: Path, out: Path, workers: int, shard_size: int) -> dict:
    t0 = time.perf_counter()
    cuts = common.lhotse_cuts(corpus)
    probe_s = time.perf_counter() - t0
    out.mkdir(parents=True)
    cuts.to_shar(out, fields={"recording": "flac"}, shard_size=shard_size, num_jobs=workers)
    return {"wall_s": time.perf_counter() - t0, "files": len(cuts), "audio_s": sum(c.duration for c in cuts),
            "bytes": _dir_bytes(out), "shards": len(list(out.glob("recording.*.tar"))), "probe_s": probe_s}


def _run_tool(tool: str, args, corpus: Path, root: Path, workers: int, n_files: int, in_bytes: int) -> dict:
    out = root / f"out-{tool}-{workers}"
    shutil.rmtree(out, ignore_errors=True)
    common.warm_page_cache(corpus)
    try:
        if tool.startswith("shardtrain"):  # "-nocheck": without the full decode of kept audio; "-ray": Ray engine
            return run_shardtrain(corpus, out, workers, args.target_shard_mb, not tool.endswith("-nocheck"),
                                  "ray" if tool.endswith("-ray") else "local")
        if tool.startswith("decode-only"):
            return run_decode_only(corpus, out, workers, args.target_shard_mb,
                                   "shardtrain" if tool.endswith("-shardtrain") else "soundfile")
        if tool == "webdataset":
            return run_webdataset(corpus, out, workers, args.target_shard_mb)
        per_shard = max(1, int(n_files * args.target_shard_mb * (1 << 20) / max(in_bytes, 1)))
        return run_lhotse(corpus, out, workers, per_shard)
    finally:
        shutil.rmtree(out, ignore_errors=True)


PAIRS = (("shardtrain", "decode-only"), ("shardtrain-nocheck", "webdataset"), ("shardtrain", "webdataset"),
         ("shardtrain", "decode-only-shardtrain"))
"""(tool, reference) pairs whose wall-time ratio the issue sets a goal for: pack with its decode check vs decoding
the same audio alone with the same cores (libsndfile, the issue's reference; and pack's own decoder, for what pack
costs beyond decoding); pack --no-decode-check vs webdataset's ShardWriter."""


def _round(v):
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    return v


def make_input(args, root: Path) -> Path:
    if args.corpus:
        return Path(args.corpus)
    if args.speech:
        from shardtrain.testing.speech import synth_speech_corpus

        corpus = synth_speech_corpus(root / "speech", args.utterances, seed=0, workers=2, layout="flat")
        return Path(corpus)
    from shardtrain.testing.corpus import make_corpus

    rng = np.random.default_rng(0)
    durations = np.round(rng.uniform(args.min_duration_s, args.max_duration_s, args.utterances), 2).tolist()
    tones = root / "tones"
    if (tones / "manifest.tsv").exists() and len(list(tones.glob("*.flac"))) == args.utterances:
        return tones  # reuse a corpus left by an earlier run with --work-dir (same seed and sizes)
    return make_corpus(tones, durations, seed=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--utterances", type=int, default=2000, help="corpus size (>= 2000 for the reported numbers)")
    ap.add_argument("--min-duration-s", type=float, default=1.0, help="shortest tone utterance (seconds)")
    ap.add_argument("--max-duration-s", type=float, default=12.0, help="longest tone utterance (seconds)")
    ap.add_argument("--speech", action="store_true", help="espeak-ng speech corpus instead of tones (slower to make)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to measure")
    ap.add_argument("--target-shard-mb", type=float, default=16.0, help="shard size for shardtrain and webdataset")
    ap.add_argument("--tools", nargs="+", default=["shardtrain", "shardtrain-nocheck", "webdataset", "lhotse"],
                    help="which tools to run (shardtrain shardtrain-nocheck shardtrain-ray webdataset decode-only "
                         "decode-only-shardtrain lhotse)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the tool list this many times, alternating (A/B), and report each tool's median")
    ap.add_argument("--out", default=None,
                    help="also write the JSON record here (e.g. benchmarks/results/bench_pack.json)")
    ap.add_argument("--corpus", default=None,
                    help="an existing flat corpus (x.flac + x.txt), e.g. from `shardtrain synth DIR --n 3000 --layout "
                         "flat`, instead of making one")
    ap.add_argument("--work-dir", default=None, help="where to put corpus and outputs (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import lhotse  # noqa: F401  - import cost (torch) is paid here, outside every timed section
    import webdataset  # noqa: F401

    import shardtrain.pack.transcode  # noqa: F401

    root = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_pack-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        corpus = make_input(args, root)
        make_s = time.perf_counter() - t0
        n_files = len(list(corpus.glob("*.flac")))
        in_bytes = sum(p.stat().st_size for p in corpus.glob("*.flac"))
        rows, ratios = [], []
        for workers in args.workers:
            runs: dict[str, list[dict]] = {t: [] for t in args.tools}
            for rep in range(args.repeats):  # A/B: the tools alternate, so load drift on a shared machine hits all
                load = os.getloadavg()[0]
                walls = {}
                for tool in args.tools:
                    runs[tool].append(_run_tool(tool, args, corpus, root, workers, n_files, in_bytes))
                    walls[tool] = runs[tool][-1]["wall_s"]
                ratio = {"workers": workers, "repeat": rep, "load_1min": [round(load, 2),
                                                                          round(os.getloadavg()[0], 2)]}
                for num, den in PAIRS:  # the figures, from walls measured in this one interleaved round
                    if num in walls and den in walls:
                        ratio[f"{num}/{den}"] = round(walls[num] / walls[den], 3)
                ratios.append(ratio)
            wds = [r["wall_s"] for r in runs.get("webdataset", [])]
            for tool, rs in runs.items():
                r = sorted(rs, key=lambda x: x["wall_s"])[len(rs) // 2]  # the median run
                r.update(tool=tool, workers=workers, runs_wall_s=[round(x["wall_s"], 3) for x in rs],
                         files_per_s=r["files"] / r["wall_s"], audio_h_per_s=r["audio_s"] / 3600 / r["wall_s"],
                         mb_per_s=r["bytes"] / 1e6 / r["wall_s"])
                if wds:
                    r["x_webdataset"] = r["wall_s"] / sorted(wds)[len(wds) // 2]
                rows.append(r)
        medians = {}
        for key in sorted({k for r in ratios for k in r if "/" in k}):
            for workers in args.workers:
                vals = sorted(r[key] for r in ratios if key in r and r["workers"] == workers)
                if vals:
                    medians[f"{key} (workers={workers})"] = {"median": vals[len(vals) // 2], "runs": vals}
        record = {"bench": "pack", "git_sha": common.git_sha(), "cpus": os.cpu_count(),
                  "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "config": {k: v for k, v in vars(args).items() if k not in ("work_dir", "keep")},
                  "corpus": {"files": n_files, "bytes": in_bytes, "make_s": round(make_s, 2)},
                  "ratios": medians, "rounds": ratios,
                  "results": [{k: (_round(v)) for k, v in r.items()} for r in rows]}
        print(json.dumps(record, sort_keys=True))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(record, sort_keys=True, indent=1) + "\n")
        print(f"\n{'tool':<23} {'workers':>7} {'files':>6} {'audio_h':>8} {'wall_s':>7} {'files/s':>8} "
              f"{'audio_h/s':>9} {'MB/s':>7} {'shards':>6} {'x_wds':>6}  phases_s (scan/layout/write/commit)")
        for r in rows:
            ph = r.get("phases_s")
            print(f"{r['tool']:<23} {r['workers']:>7} {r['files']:>6} {r['audio_s'] / 3600:>8.3f} {r['wall_s']:>7.2f} "
                  f"{r['files_per_s']:>8.0f} {r['audio_h_per_s']:>9.3f} {r['mb_per_s']:>7.1f} {r['shards']:>6} "
                  f"{r.get('x_webdataset', float('nan')):>6.2f}  "
                  + ("/".join(f"{ph[k]:.2f}" for k in ("scan", "layout", "write", "commit")) if ph else ""))
        print("\nratios of walls measured in the same interleaved round (median over rounds; goal <= 1.2):")
        for k, v in medians.items():
            print(f"  {k:<48} {v['median']:.3f}   rounds {v['runs']}")
        print(f"load average (1 min) at each round's start/end: {[r['load_1min'] for r in ratios]}")
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
