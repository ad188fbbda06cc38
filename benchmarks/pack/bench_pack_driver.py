"""Driver memory of `pack --engine ray` per million items: what the global layout and the index assembly hold.

    N synthetic items (LibriSpeech-like ids, durations 1-20 s, no audio) -> PartScan per 1,024 items, as scan_part
    returns them -> layout.lay_out (duplicates, keys, sort, cut, fingerprint) -> every ShardSpec (as the write loop
    asks for them) -> done-markers written to _work/ (index rows: transcript ~200 chars, source path ~60 chars)
    -> _IndexRows streams them back into index.parquet

Reports, in MB per million items, for each phase (scans held, peak while laying out, layout held, layout held after
every shard is done, peak of writing the index: one row group of rows at a time): the bytes allocated (Python
and numpy objects by tracemalloc + Arrow's pool), and RSS growth over the imports-only baseline (ru_maxrss for
peaks: the process-wide high-water mark; RSS also counts what the allocators keep after a free, an upper bound). The audio records are not on the driver under Ray
(they stay in the object store), so they are not part of this. Run:

    .venv/bin/python -m benchmarks.pack.bench_pack_driver --items 1000000
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import tracemalloc

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - imported before the baseline, like everything the phases use
import pyarrow.ipc  # noqa: F401
import pyarrow.parquet  # noqa: F401


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Meter:
    """Allocated bytes (tracemalloc for Python/numpy + Arrow's pool) and RSS, current and per-phase peak, relative
    to construction. Each phase gets a fresh Arrow proxy pool, so its max_memory is that phase's peak."""

    def __init__(self) -> None:
        tracemalloc.start()
        self.rss0 = _rss()
        self.arrow0 = pa.total_allocated_bytes()
        self.pool = pa.default_memory_pool()
        self._pools = [self.pool]  # a replaced pool must outlive the buffers it allocated

    def _arrow(self) -> int:
        return pa.total_allocated_bytes() - self.arrow0

    def start_phase(self) -> None:
        tracemalloc.reset_peak()
        self.held_before = self._arrow()
        self.pool = pa.proxy_memory_pool(pa.default_memory_pool())
        pa.set_memory_pool(self.pool)
        self._pools.append(self.pool)
        self.held_in_pool0 = self.pool.bytes_allocated()

    def now(self) -> tuple[int, int]:
        return tracemalloc.get_traced_memory()[0] + self._arrow(), _rss() - self.rss0

    def peak(self) -> tuple[int, int]:
        return (tracemalloc.get_traced_memory()[1] + self.held_before + self.pool.max_memory(),
                _peak() - self.rss0)


def _scans(n: int, part_items: int, rng: np.random.Generator):
    from shardtrain.pack.keys import sanitize_key
    from shardtrain.pack.scan import DIGEST_BYTES, PartScan

    for p, a in enumerate(range(0, n, part_items)):
        m = min(part_items, n - a)
        ids = [f"{(a + j) // 20000:04d}-{(a + j) // 100:06d}-{(a + j) % 100:04d}" for j in range(m)]
        yield PartScan(index=p, items=m, early=[], pos=np.arange(m, dtype=np.int32),
                       ids=pa.array(ids, pa.string()), keys=pa.array([sanitize_key(i) for i in ids], pa.string()),
                       ok=np.ones(m, bool), late={}, duration_s=np.round(rng.uniform(1, 20, m), 3),
                       est_bytes=rng.integers(30_000, 600_000, m),
                       digest=np.frombuffer(rng.bytes(m * DIGEST_BYTES), f"S{DIGEST_BYTES}").copy())


def _words(rng: np.random.Generator, vocab: list[str], k: int) -> str:
    return " ".join(vocab[i] for i in rng.integers(0, len(vocab), k))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000, help="synthetic items")
    ap.add_argument("--part-items", type=int, default=1024, help="items per scan part (PackConfig.part_items)")
    ap.add_argument("--shard-samples", type=int, default=700, help="samples per shard (~256 MB of 10 s FLAC)")
    args = ap.parse_args(argv)
    from shardtrain.pack.packer import PackConfig, _IndexRows
    from shardtrain.pack.layout import iter_specs, lay_out

    rng = np.random.default_rng(0)
    vocab = [f"w{i}" + "abcdefgh"[: i % 8] for i in range(5000)]
    cfg = PackConfig(input="x", output="y", max_samples_per_shard=args.shard_samples, progress=False)
    list(_scans(10, 5, rng))  # warm: any lazy import happens before the baseline
    meter = _Meter()
    phases: dict[str, tuple[int, int]] = {}
    t0 = time.perf_counter()
    scans = list(_scans(args.items, args.part_items, rng))
    phases["scans_held"] = meter.now()
    meter.start_phase()
    layout = lay_out(cfg, scans, lambda p, r: "")  # consumes scans
    phases["laying_out_peak"] = meter.peak()
    layout_s = time.perf_counter() - t0
    specs = sum(len(s.keys) for s in iter_specs(layout))
    phases["layout_held"] = meter.now()

    with tempfile.TemporaryDirectory() as d:  # done-markers as write_shard leaves them in _work/
        os.mkdir(os.path.join(d, "_work"))
        rows, done = _IndexRows(d, None), 0
        for spec in iter_specs(layout):
            marker = {"shard": spec.shard, "info": {}, "rejects": [], "rows": [
                {"key": k, "shard": spec.shard, "offset": j * 1024, "size": 200_000, "audio_offset": j * 1024 + 512,
                 "audio_size": 199_000, "json_offset": 1, "json_size": 300, "codec": "flac", "duration_s": 10.0,
                 "num_samples": 160_000, "sample_rate_hz": 16000, "channels": 1, "text": _words(rng, vocab, 32),
                 "speaker": k[:4], "language": "en",
                 "source": f"/data/LibriSpeech/train-960/{k[:4]}/{k[5:11]}/{k}.flac"}
                for j, k in enumerate(spec.keys)]}
            with open(os.path.join(d, "_work", f"shard-{spec.shard:06d}.json"), "w") as f:
                json.dump(marker, f, sort_keys=True)
            rows.add(marker)
            done += 1
        del marker
        phases["layout_and_markers_written"] = meter.now()
        meter.start_phase()
        n_rows = rows.write(done)
        index_bytes = os.path.getsize(os.path.join(d, "index.parquet"))
    phases["peak_incl_index_write"] = meter.peak()
    per = 1e6 / args.items
    record = {"bench": "pack_driver", "items": args.items, "shards": layout.shards, "layout_s": round(layout_s, 2),
              "spec_samples": specs, "index_rows": n_rows, "index_parquet_bytes": index_bytes,
              "mb_per_million": {k: {"allocated": round(a * per / 1e6, 1), "rss": round(r * per / 1e6, 1)}
                                 for k, (a, r) in phases.items()}}
    print(json.dumps(record, sort_keys=True))
    print(f"\n{'phase (MB per 1M items)':<30} {'allocated':>10} {'RSS':>8}")
    for k, v in record["mb_per_million"].items():
        print(f"{k:<30} {v['allocated']:>10.1f} {v['rss']:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
