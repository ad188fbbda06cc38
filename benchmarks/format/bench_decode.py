"""Decode paths on the same FLAC members: soundfile over BytesIO, libsndfile on a memfd, and shardtrain's
decode_into (dr_flac for FLAC).

Why this exists: the loader decodes in threads of one process, so what matters is what a decode costs and how it
scales with threads. soundfile reading from BytesIO goes through Python callbacks that take the GIL; libsndfile
on a memfd (format.audio._MemfdDecoder, still the path for WAV/Opus/MP3) runs without the GIL but converts
libFLAC's output sample by sample; dr_flac (format.audio._DrFlac) reads the bytes where they are and converts in
blocks. Each is run in threads and as one process per core (the decode-only limit's shape).

    .venv/bin/python -m benchmarks.format.bench_decode              # members of the bench_loader dataset (cached)
    .venv/bin/python -m benchmarks.format.bench_decode --repeats 5

The single-thread CPU A/B prices dr_flac against libsndfile on a memfd in thread CPU time (robust to a busy box).
"""
from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import soundfile as sf

from benchmarks import common

from shardtrain.format import audio

BLOBS: list[bytes] = []
FRAMES: list[int] = []


def _bytesio(i: int) -> int:
    with sf.SoundFile(io.BytesIO(BLOBS[i])) as f:
        return len(f.read(dtype="float32"))


def _memfd(i: int) -> int:
    return audio._decoder().decode_into(BLOBS[i], np.zeros(FRAMES[i], np.float32))  # noqa: SLF001


def _decode_into(i: int) -> int:
    return audio.decode_into(BLOBS[i], np.zeros(FRAMES[i], np.float32))


PATHS = {"soundfile BytesIO": _bytesio, "libsndfile on a memfd": _memfd, "decode_into (dr_flac)": _decode_into}


def _threads(fn, n: int) -> float:
    with ThreadPoolExecutor(n) as ex:
        list(ex.map(fn, range(min(50, len(BLOBS)))))  # warm: threads started, decoders created
        t0 = time.perf_counter()
        list(ex.map(fn, range(len(BLOBS)), chunksize=8))
        return time.perf_counter() - t0


def _proc_part(args: tuple[str, int, int]) -> float:
    name, part, parts = args
    fn = PATHS[name]
    t0 = time.perf_counter()
    for i in range(part, len(BLOBS), parts):
        fn(i)
    return time.perf_counter() - t0


def _processes(name: str, n: int) -> float:
    with multiprocessing.get_context("fork").Pool(n) as pool:
        pool.map(abs, range(n))
        t0 = time.perf_counter()
        pool.map(_proc_part, [(name, p, n) for p in range(n)], chunksize=1)
        return time.perf_counter() - t0


def _cpu_ab(audio_s: float, rounds: int) -> dict:
    """Audio seconds decoded per CPU second of one thread, dr_flac vs libsndfile on a memfd, alternating rounds:
    thread CPU time does not count time stolen by other processes, so this prices the decoders on a busy box."""
    rates: dict[str, list[float]] = {"dr_flac": [], "libsndfile": []}
    for _ in range(rounds):
        for name, fn in (("dr_flac", _decode_into), ("libsndfile", _memfd)):
            t0 = time.thread_time()
            for i in range(len(BLOBS)):
                fn(i)
            rates[name].append(audio_s / (time.thread_time() - t0))
    med = {k: float(np.median(v)) for k, v in rates.items()}
    return {"rounds": rounds, **med, "dr_flac_vs_libsndfile": med["dr_flac"] / med["libsndfile"]}


def main(args: argparse.Namespace) -> dict:
    work = Path(args.work_dir)
    ds = common.prepare_dataset(work, common.prepare_corpus(work, args.utterances, kind="speech", seed=0),
                                shard_mb=16.0)
    for p in sorted(ds.glob("*.tar"))[: args.shards]:
        with tarfile.open(p) as tf:
            for m in tf:
                if m.name.endswith(".flac"):
                    BLOBS.append(tf.extractfile(m).read())
    FRAMES.extend(sf.info(io.BytesIO(b)).frames for b in BLOBS)
    audio_s = sum(FRAMES) / 16000
    cores = os.cpu_count() or 1
    rows = []
    for name, fn in PATHS.items():
        for how, n in [("threads", 1), ("threads", cores), ("threads", cores + 1), ("processes", cores)]:
            walls = [(_threads(fn, n) if how == "threads" else _processes(name, n)) for _ in range(args.repeats)]
            rates = [audio_s / w for w in walls]
            rows.append({"decoder": name, "parallelism": f"{n} {how}", "audio_s_per_s": common.summarize(rates)})
    base = {r["parallelism"]: r["audio_s_per_s"]["median"] for r in rows if r["decoder"] == "soundfile BytesIO"}
    table = [{"decoder": r["decoder"], "par": r["parallelism"], "rate": common.fmt_stat(r["audio_s_per_s"]),
              "vs": f"{r['audio_s_per_s']['median'] / base[r['parallelism']]:.2f}"} for r in rows]
    md = common.markdown_table(table, [("decoder", "decoder"), ("par", "parallelism"), ("rate", "audio-s/s"),
                                       ("vs", "vs BytesIO, same parallelism")])
    cpu = _cpu_ab(audio_s, rounds=max(5, args.repeats))
    md += (f"\n\nSingle-thread CPU cost, {cpu['rounds']} alternating rounds (thread CPU time, robust to a busy "
           f"machine): dr_flac {cpu['dr_flac']:,.0f} vs libsndfile on a memfd {cpu['libsndfile']:,.0f} audio-s "
           f"per CPU-s = {cpu['dr_flac_vs_libsndfile']:.3f}")
    result = {"benchmark": "bench_decode", "git_sha": common.git_sha(), "machine": common.machine(),
              "members": len(BLOBS), "audio_seconds": round(audio_s, 1), "repeats": args.repeats, "rows": rows,
              "cpu_ab": cpu}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    common.write_json(out / "bench_decode.json", result)
    (out / "bench_decode.md").write_text(md + "\n")
    print(md)
    print(common.json_line(result))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--utterances", type=int, default=4000, help="corpus of the bench_loader dataset (cached)")
    ap.add_argument("--shards", type=int, default=6, help="shards whose FLAC members are decoded")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", default=str(common.DEFAULT_WORK_DIR))
    ap.add_argument("--out-dir", default=str(common.BENCH_DIR / "results"))
    return ap.parse_args(argv)


if __name__ == "__main__":
    common.setup_logging()
    main(parse_args())
