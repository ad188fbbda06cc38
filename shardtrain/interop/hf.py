"""Hugging Face `datasets`: read shardtrain shards with the stock "webdataset" builder.

    dataset URL -> data_files(url) (the shard URLs, in order) + features(url) (declared columns)
      -> datasets.load_dataset("webdataset", data_files={"train": files}, features=features)
      -> rows {"__key__", "__url__", "<codec>": bytes, "json": {text, duration_s, sample_rate_hz, speaker, ...}}
      -> decode_audio(row) -> (float32 samples, sample_rate_hz)   (soundfile; no torchcodec)

Why declared features: without them the builder types `.flac`/`.wav` members as `datasets.Audio`, whose encoder
needs torchcodec even to store the bytes (datasets >= 4), and torchcodec's current wheels are CUDA builds that
fail on a CPU-only torch (stack.md). Declared as binary, the audio stays the shard's bytes; with torchcodec
installed, `ds.cast_column("flac", datasets.Audio())` should give the usual decoded column (not tested here: no
torchcodec on these machines). The json struct is taken
from the first shard's samples plus the index's metadata fields; keys missing from a sample read as None, and keys
only later samples have are dropped by `datasets` (they stay in the shards).

Use it from Hugging Face datasets:

    from shardtrain.interop import hf
    ds = datasets.load_dataset("webdataset", data_files={"train": hf.data_files("shards/train")},
                               features=hf.features("shards/train"), split="train")
    samples, rate = hf.decode_audio(ds[0]); text = ds[0]["json"]["text"]
"""
from __future__ import annotations

import io
import json
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import soundfile as sf

from shardtrain import storage
from shardtrain.format.codecs import CODECS
from shardtrain.format.manifest import open_dataset

_SAMPLE_ROWS = 64
"""Samples of the first shard whose json is read to type the json struct."""
_CORE = pa.schema([("id", pa.string()), ("text", pa.string()), ("duration_s", pa.float64()),
                   ("sample_rate_hz", pa.int64()), ("num_samples", pa.int64()), ("channels", pa.int64()),
                   ("codec", pa.string()), ("speaker", pa.string()), ("language", pa.string()),
                   ("source", pa.string())])


def data_files(url: str, storage_options: dict | None = None) -> list[str]:
    """The shard URLs of the dataset at `url`, in shard order (what `data_files=` takes)."""
    ds = open_dataset(url, storage_options)
    return [ds.shard_url(i) for i in range(len(ds.shards))]


def features(url: str, storage_options: dict | None = None) -> datasets.Features:
    """Columns for `load_dataset("webdataset", ...)`: key, url, one binary column per stored codec, json struct."""
    ds = open_dataset(url, storage_options)
    idx = ds.read_index(columns=["shard", "codec", "json_offset", "json_size"])
    codecs = sorted(set(idx.column("codec").to_pylist()) & set(CODECS)) or ["flac"]
    first = idx.filter(pc.equal(idx.column("shard"), 0)).slice(0, _SAMPLE_ROWS).to_pylist()
    samples: list[dict] = []
    if first:
        lo = first[0]["json_offset"]
        hi = max(r["json_offset"] + r["json_size"] for r in first)
        blob = storage.read_range(ds.shard_url(0), lo, hi, storage_options)
        samples = [json.loads(blob[r["json_offset"] - lo: r["json_offset"] - lo + r["json_size"]]) for r in first]
    schema = pa.unify_schemas([_CORE, pa.Table.from_pylist(samples).schema] if samples else [_CORE],
                              promote_options="permissive")
    cols: dict[str, Any] = {"__key__": datasets.Value("string"), "__url__": datasets.Value("string")}
    cols.update({c: datasets.Value("binary") for c in codecs})
    cols["json"] = datasets.Features.from_arrow_schema(schema)
    return datasets.Features(cols)


def decode_audio(row: dict[str, Any]) -> tuple[np.ndarray, int]:
    """A row's audio as float32 samples ([n] mono, [n, channels] otherwise) and its rate, decoded with soundfile."""
    codec = row["json"].get("codec") if isinstance(row.get("json"), dict) else None
    names = [codec] if codec in row else [c for c in CODECS if row.get(c) is not None]
    if not names or row.get(names[0]) is None:
        raise KeyError(f"row {row.get('__key__')!r} has no audio column (one of {CODECS})")
    samples, rate = sf.read(io.BytesIO(row[names[0]]), dtype="float32")
    return samples, int(rate)
