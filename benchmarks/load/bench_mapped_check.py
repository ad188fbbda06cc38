"""What the memory-mapped index's check at open costs: ms per million rows, against the open itself.

    synthetic dataset of N rows (shardtrain.testing.indexes: every index column, LibriSpeech-length transcripts)
      -> open_mapped once (build, timed)
      -> interleaved, --repeat times each: open_mapped (index footer read + folder check + mapfiles.verify + maps)
         vs the bare maps (mapped._open: what an open cost before the check), page cache warm for both
      -> mapped_blocks with its check (mapfiles.check_blocks against the durations) vs make_blocks alone

Absolute times are noisy on a loaded machine; the ratios and per-row figures are from the same interleaved run.
Run:

    .venv/bin/python -m benchmarks.load.bench_mapped_check --rows 1000000
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from shardtrain.format.manifest import open_dataset
from shardtrain.load import mapped
from shardtrain.load.blockplan import make_blocks
from shardtrain.load.plan import BucketConfig, cost_s
from shardtrain.testing.indexes import write_index_dataset

TEXT = "HE HOPED THERE WOULD BE STEW FOR DINNER TURNIPS AND CARROTS AND BRUISED POTATOES AND FAT MUTTON PIECES"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-mapcheck-"))
    try:
        ds = open_dataset(write_index_dataset(work / "ds", args.rows, text=TEXT, per_shard=5000))
        t = time.perf_counter()
        mi = mapped.open_mapped(ds, str(work / "cache"), text=True)
        build_s = time.perf_counter() - t
        checked, bare = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            mapped.open_mapped(ds, str(work / "cache"), text=True)
            checked.append(time.perf_counter() - t)
            t = time.perf_counter()
            mapped._open(mi.folder, mi.meta)
            bare.append(time.perf_counter() - t)
        cfg = BucketConfig(max_batch_seconds=200.0)
        t = time.perf_counter()
        mapped.mapped_blocks(mi, cfg, 30.0, 64)  # made and saved
        t = time.perf_counter()
        mapped.mapped_blocks(mi, cfg, 30.0, 64)  # read back and checked
        blocks_checked = time.perf_counter() - t
        t = time.perf_counter()
        make_blocks(mi.idx.duration_s, mi.idx.size, 30.0, 200.0, lambda d: cost_s(d, cfg), 64)
        blocks_made = time.perf_counter() - t
        m = args.rows / 1e6
        out = {"rows": args.rows, "build_s": round(build_s, 2),
               "open_checked_ms_per_1M_rows": round(statistics.median(checked) * 1e3 / m, 1),
               "open_bare_ms_per_1M_rows": round(statistics.median(bare) * 1e3 / m, 2),
               "check_share_of_build": round(statistics.median(checked) / build_s, 3),
               "blocks_read_checked_ms_per_1M_rows": round(blocks_checked * 1e3 / m, 1),
               "blocks_made_ms_per_1M_rows": round(blocks_made * 1e3 / m, 1),
               "copy_mb": round(sum(p.stat().st_size for p in mi.folder.iterdir()) / 1e6, 1)}
        print(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
