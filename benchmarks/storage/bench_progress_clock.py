"""What the time-without-progress clock (shardtrain.storage.clock) costs on the loader's hot read path, per MB read,
against the time to decode that MB of FLAC.

    python -m benchmarks.storage.bench_progress_clock                 # 64 MB object on a local SeaweedFS, 5 rounds

Method: a real read (storage.iter_range, direct HTTP, from SeaweedFS on loopback) counts how often each clock
operation runs per MB (socket reads through `_ClockedIO`, pieces held/resumed, requests watched); each operation
is timed alone (best of --rounds, 200k calls); cost per MB = sum(count x unit cost). The peer is soundfile's
decode of 1 MB of FLAC (speech-like tones from shardtrain.testing, 16 kHz mono). For context the same object is
also read end to end with the shipped path and with a bare http.client loop (no clock, no storage layer),
interleaved, in CPU seconds per GB. Prints a table and one JSON line; writes benchmarks/results/bench_progress_clock.json.
Absolute times are noisy on a shared 2-core machine: read the ratios.
"""
from __future__ import annotations

import argparse
import http.client
import io
import os
import tempfile
import time
import timeit
import urllib.parse
from pathlib import Path

from benchmarks import common

from shardtrain import storage  # noqa: E402
from shardtrain.storage import clock as clock_mod  # noqa: E402
from shardtrain.storage import s3http  # noqa: E402
from shardtrain.testing.s3server import LocalS3  # noqa: E402

MB = 1 << 20


def count_ops(url: str, so: dict) -> dict:
    """Per MB: recvs seen by the clock, pieces handed over, requests made (one real read, counted)."""
    counts = {"got": 0}
    real_got = clock_mod.ProgressClock.got

    def counting(self, n):  # benchmark instrumentation only
        counts["got"] += 1
        real_got(self, n)

    clock_mod.ProgressClock.got = counting  # type: ignore[method-assign]
    try:
        pieces = 0
        total = 0
        for p in storage.iter_range(url, 0, None, so, direct_http=True):
            pieces += 1
            total += len(p)
    finally:
        clock_mod.ProgressClock.got = real_got  # type: ignore[method-assign]
    mb = total / MB
    requests = -(-total // (8 * MB))
    return {"recvs_per_mb": counts["got"] / mb, "pieces_per_mb": pieces / mb, "requests_per_mb": requests / mb}


def unit_costs(rounds: int) -> dict:
    """Seconds per call of each clock operation (best of `rounds`)."""
    n = 200_000
    c = clock_mod.ProgressClock("x", 120.0)
    raw = io.BytesIO(b"\0" * (64 << 10))
    buf = bytearray(16 << 10)
    clocked = s3http._ClockedIO(raw, c)

    def plain():
        raw.seek(0)
        raw.readinto(buf)

    def wrapped():
        raw.seek(0)
        clocked.readinto(buf)

    class Conn:
        sock = None

    conn = Conn()

    def hold_resume():
        c.resume(c.hold())

    def watch():
        c.watch(conn)
        c.unwatch()

    best = {name: min(timeit.repeat(fn, number=n, repeat=rounds)) / n
            for name, fn in (("plain_readinto", plain), ("clocked_readinto", wrapped), ("hold_resume", hold_resume),
                             ("watch_unwatch", watch))}
    best["recv_overhead"] = max(0.0, best["clocked_readinto"] - best["plain_readinto"])
    return best


def flac_decode_s_per_mb(work: Path, rounds: int) -> float:
    import soundfile as sf

    from shardtrain.testing.corpus import make_corpus

    corpus = make_corpus(work / "flac", [30.0, 30.0], seed=0)
    blobs = [p.read_bytes() for p in sorted(corpus.rglob("*.flac"))]
    size = sum(map(len, blobs))
    t = min(timeit.repeat(lambda: [sf.read(io.BytesIO(b), dtype="int16") for b in blobs], number=3,
                          repeat=rounds)) / 3
    return t / (size / MB)


def bare_read(url: str) -> int:
    """The object through one plain http.client GET, read1 loop: no clock, no storage layer (the floor)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("GET", f"{parts.path}?{parts.query}")
    resp = conn.getresponse()
    total = 0
    while True:
        piece = resp.read1(MB)
        if not piece:
            break
        total += len(piece)
    conn.close()
    return total


def cpu_s_per_gb(fn, nbytes: int) -> float:
    t0 = time.process_time()
    fn()
    return (time.process_time() - t0) / (nbytes / 2**30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=64, help="object size in MB (default 64)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (best of / interleaved), default 5")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp, LocalS3(Path(tmp) / "s3").start() as s3:
        bucket = s3.make_bucket("clockbench")
        url = f"{bucket}/blob.bin"
        nbytes = args.mb * MB
        storage.atomic_write_bytes(url, os.urandom(nbytes), s3.storage_options)
        so = s3.storage_options
        counts = count_ops(url, so)
        units = unit_costs(args.rounds)
        decode = flac_decode_s_per_mb(Path(tmp), args.rounds)
        signed = s3http.presigned(url.split("://", 1)[1], so, lambda: None)
        shipped, bare = [], []
        for _ in range(args.rounds):  # interleaved: both see the same load
            shipped.append(cpu_s_per_gb(lambda: sum(map(len, storage.iter_range(url, 0, None, so, direct_http=True))),
                                        nbytes))
            bare.append(cpu_s_per_gb(lambda: bare_read(signed), nbytes))
    clock_s_per_mb = (counts["recvs_per_mb"] * units["recv_overhead"] + counts["pieces_per_mb"] * units["hold_resume"]
                      + counts["requests_per_mb"] * units["watch_unwatch"])
    out = {"git_sha": common.git_sha(), "machine": common.machine(), "object_mb": args.mb, **counts,
           **{f"unit_{k}_us": round(v * 1e6, 3) for k, v in units.items()},
           "clock_us_per_mb": round(clock_s_per_mb * 1e6, 2), "flac_decode_ms_per_mb": round(decode * 1e3, 2),
           "clock_share_of_decode": round(clock_s_per_mb / decode, 6),
           "read_cpu_s_per_gb_shipped": common.summarize(shipped), "read_cpu_s_per_gb_bare": common.summarize(bare)}
    common.write_json(common.BENCH_DIR / "results" / "bench_progress_clock.json", out)
    print(f"| per MB read | clock | FLAC decode of that MB | share |\n|---|---|---|---|\n"
          f"| {counts['recvs_per_mb']:.1f} recvs, {counts['pieces_per_mb']:.1f} pieces, "
          f"{counts['requests_per_mb']:.3f} requests | {clock_s_per_mb * 1e6:.1f} us | {decode * 1e3:.1f} ms | "
          f"{clock_s_per_mb / decode:.4%} |")
    print(f"read CPU s/GB, median of {args.rounds} interleaved: shipped {out['read_cpu_s_per_gb_shipped']['median']:.3f}"
          f", bare http.client {out['read_cpu_s_per_gb_bare']['median']:.3f}")
    print(common.json_line(out))


if __name__ == "__main__":
    main()
