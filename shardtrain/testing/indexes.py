"""A metadata-only dataset of any size: manifest.json + index.parquet, no shard files (for planning and index
caches, which never read a shard). Rows are consistent with the packer's: (shard, offset) order, ascending
durations, num_samples = duration x 16 kHz, members laid out like the tar writer's. ~1 s per 1M rows.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROW_BYTES = 2560
RATE = 16000


def write_index_dataset(folder: str | Path, rows: int, *, per_shard: int = 1000, text: str = "SOME WORDS",
                        lo_s: float = 1.0, hi_s: float = 15.0, row_group: int = 100_000) -> str:
    """Write a dataset of `rows` rows under `folder`; returns its path. Every row's transcript is `text`."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    dur = np.round(np.linspace(lo_s, hi_s, rows), 4)
    shard = (np.arange(rows) // per_shard).astype(np.int32)
    offset = (np.arange(rows) % per_shard).astype(np.int64) * ROW_BYTES
    n_shards = int(shard[-1]) + 1 if rows else 0
    cols = {
        "key": pa.array([f"utt-{i:09d}" for i in range(rows)]), "shard": shard, "offset": offset,
        "size": np.full(rows, ROW_BYTES, np.int64), "audio_offset": offset + 512,
        "audio_size": np.full(rows, 1000, np.int64), "json_offset": offset + 2048,
        "json_size": np.full(rows, 100, np.int64), "codec": pa.array(["flac"] * rows),
        "duration_s": dur, "num_samples": np.round(dur * RATE).astype(np.int64),
        "sample_rate_hz": np.full(rows, RATE, np.int32), "channels": np.ones(rows, np.int16),
        "text": pa.array([text] * rows), "speaker": pa.nulls(rows, pa.string()),
        "language": pa.nulls(rows, pa.string()), "source": pa.array([f"/in/{i}.flac" for i in range(rows)]),
    }
    pq.write_table(pa.table(cols), out / "index.parquet", row_group_size=row_group, compression="zstd")
    counts = np.bincount(shard, minlength=n_shards)
    shards = []
    for i, c in enumerate(counts.tolist()):
        d = dur[shard == i]
        shards.append({"name": f"shard-{i:06d}.tar", "samples": c, "bytes": c * ROW_BYTES + 1024,
                       "seconds": float(d.sum()), "min_duration_s": float(d.min()), "max_duration_s": float(d.max()),
                       "sha256": "0" * 64})
    manifest = {"format": "shardtrain", "format_version": 1, "index": "index.parquet", "rejects": "rejects.jsonl",
                "fingerprint": "f" * 64, "created_utc": "2026-01-01T00:00:00Z", "tool_version": "0.1.0",
                "options": {"sample_rate_hz": RATE, "channels": 1, "codec": "flac"}, "shards": shards,
                "totals": {"samples": rows, "seconds": float(dur.sum()), "bytes": sum(s["bytes"] for s in shards),
                           "shards": n_shards, "rejects": 0}}
    (out / "manifest.json").write_text(json.dumps(manifest, sort_keys=True))
    return str(out)
