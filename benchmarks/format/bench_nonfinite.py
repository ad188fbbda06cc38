"""What the loader's non-finite check costs per batch, against the decode it guards.

Only float members (WAV FLOAT/DOUBLE, e.g. kept by --keep-original) can hold NaN/Inf; integer PCM and FLAC cannot,
so format.audio checks a member only when its header says float (read anyway to open it): FLAC and 16-bit members
pay nothing. For float members the check is two reductions over the decoded row (format.audio.float_peak: min and
max, NaN propagates, no temporary array), plus a clip pass when the peak is past full scale. This prices it per
batch of 10 s rows, single-threaded, in thread CPU time (robust to a busy box):

    .venv/bin/python -m benchmarks.format.bench_nonfinite                 # 16 rows of 10 s, 20 repeats
    .venv/bin/python -m benchmarks.format.bench_nonfinite --rows 32 --repeats 50
"""
from __future__ import annotations

import argparse
import io
import time

import numpy as np
import soundfile as sf

from shardtrain.format import audio

RATE = 16000


def _members(rows: int, seconds: float, fmt: str, subtype: str) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(rows):
        t = np.arange(int(seconds * RATE)) / RATE
        x = 0.1 * np.sin(2 * np.pi * (200 + 10 * i) * t) + 0.01 * rng.standard_normal(len(t))
        buf = io.BytesIO()
        sf.write(buf, x, RATE, format=fmt, subtype=subtype)
        out.append(buf.getvalue())
    return out


def _cpu(fn, repeats: int) -> float:
    """Median thread CPU seconds of fn() over `repeats`."""
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16, help="rows per batch (default 16)")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds per row (default 10)")
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    n = int(a.seconds * RATE)
    rows = {"float32 WAV": _members(a.rows, a.seconds, "WAV", "FLOAT"),
            "16-bit FLAC": _members(a.rows, a.seconds, "FLAC", "PCM_16")}
    print(f"batch of {a.rows} x {a.seconds:g} s, 1 thread, median of {a.repeats} (thread CPU ms per batch)")
    print(f"{'member':<12} {'out':<8} {'decode_into':>12} {'of it: check':>13} {'share':>7}")
    for name, members in rows.items():
        for dtype in (np.float32, np.int16):
            outs = [np.zeros(n, dtype) for _ in members]

            def decode() -> None:
                for m, o in zip(members, outs):
                    audio.decode_into(m, o)

            decoded = [np.zeros(n, np.float32) for _ in members]
            for m, o in zip(members, decoded):
                audio.decode_into(m, o)

            def check() -> None:
                for o in decoded:
                    audio.float_peak(o)

            total = _cpu(decode, a.repeats)
            chk = _cpu(check, a.repeats) if name.startswith("float") else 0.0
            print(f"{name:<12} {np.dtype(dtype).name:<8} {total * 1e3:>12.2f} {chk * 1e3:>13.3f} "
                  f"{chk / total:>7.1%}")


if __name__ == "__main__":
    main()
