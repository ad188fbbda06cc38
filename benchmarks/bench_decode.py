"""Decode paths on the same FLAC members: soundfile over BytesIO vs shardtrain.format.audio.decode_into (memfd, no GIL).

Why this exists: the loader decodes in threads of one process, so what matters is how decoding scales with
threads. soundfile reading from BytesIO goes through Python callbacks that take the GIL; decode_into hands
libsndfile a memfd and calls it through cffi with the GIL released. Both are also run as one process per core
(the decode-only limit's shape), which shows the decoders themselves cost the same: the limit is not moved by
the choice of decoder, only the in-process scaling is.

    .venv/bin/python benchmarks/bench_decode.py              # members of the bench_loader dataset (cached)
    .venv/bin/python benchmarks/bench_decode.py --repeats 5

The third row is the decoder the loader used before it moved to soundfile's public API (`SoundFile` on the memfd
instead of soundfile's private cffi handle): it prices that move.
"""
from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from shardtrain.format.audio import decode_into

BLOBS: list[bytes] = []
FRAMES: list[int] = []


def _bytesio(i: int) -> int:
    with sf.SoundFile(io.BytesIO(BLOBS[i])) as f:
        return len(f.read(dtype="float32"))


def _memfd(i: int) -> int:
    return decode_into(BLOBS[i], np.zeros(FRAMES[i], np.float32))


class _PrivateHandle:
    """Reference only: the loader's decoder before it moved to soundfile's public API (issue 10). It called
    libsndfile through soundfile's private cffi handle (`sf._snd`) on the same memfd, skipping SoundFile's Python
    bookkeeping. Kept here to measure what the public API costs; the product never uses it."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("bench-private", os.MFD_CLOEXEC)
        self.snd, self.ffi = sf._snd, sf._ffi  # noqa: SLF001
        self.info = self.ffi.new("SF_INFO*")

    def decode(self, data: bytes, out: np.ndarray) -> int:
        os.ftruncate(self.fd, len(data))
        os.pwrite(self.fd, data, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        self.info.format = 0
        h = self.snd.sf_open_fd(self.fd, 0x10, self.info, 0)
        try:
            return int(self.snd.sf_readf_float(h, self.ffi.cast("float *", out.ctypes.data), len(out)))
        finally:
            self.snd.sf_close(h)


_private = threading.local()


def _memfd_private(i: int) -> int:
    dec = getattr(_private, "dec", None)
    if dec is None or getattr(_private, "pid", None) != os.getpid():
        dec = _private.dec = _PrivateHandle()
        _private.pid = os.getpid()
    return dec.decode(BLOBS[i], np.zeros(FRAMES[i], np.float32))


PATHS = {"soundfile BytesIO": _bytesio, "decode_into (memfd, SoundFile(fd))": _memfd,
         "memfd, private cffi handle (reference)": _memfd_private}


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
    """Audio seconds decoded per CPU second of one thread, public SoundFile(fd) vs the private handle, alternating
    rounds: thread CPU time does not count time stolen by other processes, so this prices the API on a busy box."""
    rates: dict[str, list[float]] = {"public": [], "private": []}
    for _ in range(rounds):
        for name, fn in (("public", _memfd), ("private", _memfd_private)):
            t0 = time.thread_time()
            for i in range(len(BLOBS)):
                fn(i)
            rates[name].append(audio_s / (time.thread_time() - t0))
    med = {k: float(np.median(v)) for k, v in rates.items()}
    return {"rounds": rounds, **med, "public_vs_private": med["public"] / med["private"]}


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
           f"machine): SoundFile(fd) {cpu['public']:,.0f} vs private handle {cpu['private']:,.0f} audio-s per "
           f"CPU-s = {cpu['public_vs_private']:.3f}")
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
