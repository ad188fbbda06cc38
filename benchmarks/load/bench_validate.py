"""What checking untrusted metadata costs the loader at start-up, on a synthetic index.

    synthetic index of N rows (bench_plan_scale.synthetic_columns + keys + ~90-char transcripts) -> index.parquet
      -> read the loader's columns without checks (the peer), with checks (Dataset.read_index),
         and with the key/text columns the reader now checks samples against

    packed tone corpus (--utterances of 8-12 s FLAC) -> per row: the reader's checks (_check_row: two ustar headers,
      names, sizes, json text vs index) against one FLAC decode of the same row (the peer)

Prints one JSON object and a table: seconds per step, MB of Arrow memory for the key/text columns, and
microseconds per row for the checks and for a decode.
Run: python -m benchmarks.load.bench_validate --rows 1000000 --utterances 60
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.load.bench_plan_scale import synthetic_columns

from shardtrain.format.manifest import Dataset, ShardInfo, index_bytes, index_table  # noqa: E402
from shardtrain.format.validate import check_index  # noqa: E402
from shardtrain.load.plan import PLAN_COLUMNS  # noqa: E402


def _dataset(root: str, n: int) -> Dataset:
    cols = synthetic_columns(n)
    rng = np.random.default_rng(0)
    words = np.array("the quiet river garden window captain morning letter village teacher station".split())
    texts = [" ".join(words[rng.integers(0, len(words), 15)]) for _ in range(n)]
    rows = {**cols, "key": [f"utt-{i:09d}" for i in range(n)], "text": texts, "codec": ["flac"] * n,
            "sample_rate_hz": np.full(n, 16000, np.int32)}
    table = index_table([]).schema.empty_table()
    table = pa.table({name: rows.get(name, [None] * n) for name in table.schema.names}, schema=table.schema)
    with open(os.path.join(root, "index.parquet"), "wb") as f:
        f.write(index_bytes(table))
    shard = cols["shard"]
    ends = np.zeros(int(shard.max()) + 1, np.int64)
    np.maximum.at(ends, shard, cols["offset"] + cols["size"])
    counts = np.bincount(shard)
    shards = [ShardInfo(name=f"shard-{i:06d}.tar", samples=int(counts[i]), seconds=0.0, min_duration_s=0.0,
                        max_duration_s=0.0, bytes=int(ends[i]) + 10240, sha256="0" * 64) for i in range(len(ends))]
    return Dataset(url=root, manifest={"index": "index.parquet"}, shards=shards)


def row_check_cost(n: int, repeats: int) -> dict:
    """Microseconds per row: the reader's per-row checks vs decoding the row's FLAC (same bytes, same process)."""
    from shardtrain.format.audio import decode_into
    from shardtrain.format.manifest import open_dataset
    from shardtrain.load.config import StreamConfig
    from shardtrain.load.plan import PlanIndex
    from shardtrain.load.reader import CHECK_COLUMNS, ChunkReader
    from shardtrain.pack.packer import PackConfig, pack
    from shardtrain.testing.corpus import make_corpus

    with tempfile.TemporaryDirectory() as root:
        corpus = make_corpus(os.path.join(root, "c"), [8.0 + (i % 5) for i in range(n)], seed=0)
        pack(PackConfig(input=str(corpus), output=os.path.join(root, "ds"), workers=1, progress=False))
        ds = open_dataset(os.path.join(root, "ds"))
        idx = PlanIndex.from_table(ds.read_index(list(PLAN_COLUMNS) + ["sample_rate_hz", *CHECK_COLUMNS]))
        reader = ChunkReader(ds, idx, StreamConfig())
        with open(os.path.join(root, "ds", ds.shards[0].name), "rb") as f:
            buf = memoryview(f.read())
        rows = [i for i in range(len(idx)) if idx.shard[i] == 0]

        def checks():
            for i in rows:
                reader._check_row(buf, 0, len(buf), i)

        def decodes():
            for i in rows:
                a = int(idx.audio_offset[i])
                decode_into(buf[a:a + int(idx.audio_size[i])], np.zeros(int(idx.num_samples[i]), np.float32))
        check_us = _best(checks, repeats) / len(rows) * 1e6
        decode_us = _best(decodes, repeats) / len(rows) * 1e6
        reader.decode_pool.shutdown()
        reader.io_pool.shutdown()
    return {"row_check_us": round(check_us, 1), "row_decode_us": round(decode_us, 1),
            "row_check_vs_decode_x": round(check_us / decode_us, 4)}


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--utterances", type=int, default=60, help="packed utterances for the per-row check cost")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        ds = _dataset(root, args.rows)
        plan_cols = list(PLAN_COLUMNS) + ["sample_rate_hz"]
        path = os.path.join(root, "index.parquet")
        raw = lambda cols: pq.ParquetFile(path).read(columns=cols)  # noqa: E731 - the unchecked peer
        bytes_, samples = [s.bytes for s in ds.shards], [s.samples for s in ds.shards]
        out = {
            "rows": args.rows,
            "read_plan_columns_unchecked_s": _best(lambda: raw(plan_cols), args.repeats),
            "check_plan_columns_s": _best(lambda: check_index(raw(plan_cols), bytes_, samples), args.repeats),
            "read_key_text_unchecked_s": _best(lambda: raw(["key", "text"]), args.repeats),
            "check_key_text_s": _best(lambda: check_index(raw(["key", "text"]), bytes_, samples), args.repeats),
        }
        kt = raw(["key", "text"])
        out["key_text_arrow_mb"] = round(kt.nbytes / 1e6, 1)
        out["plan_columns_numpy_mb"] = round(raw(plan_cols).nbytes / 1e6, 1)
        out["checked_vs_unchecked_x"] = round((out["check_plan_columns_s"] + out["check_key_text_s"]) /
                                              (out["read_plan_columns_unchecked_s"] + out["read_key_text_unchecked_s"]),
                                              2)
    out.update(row_check_cost(args.utterances, args.repeats))
    print(json.dumps(out))
    for k, v in out.items():
        print(f"{k:<34} {v:.3f}" if isinstance(v, float) else f"{k:<34} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
