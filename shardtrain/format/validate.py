"""Dataset metadata is untrusted input: check manifest.json and index.parquet before anything uses them.

    manifest bytes -> parse_manifest (size bound, JSON errors and over-deep nesting -> DatasetError)
                   -> check_manifest (types, names, sha256, counts, totals)          -> [ShardInfo]
    index table    -> check_index (whatever columns were read: keys, shard range, per-shard row counts,
                      offsets/sizes inside the shard and non-overlapping, durations, rates, sample counts)

A dataset URL is often someone else's bucket, so every name that is joined onto the dataset URL must match the
format's patterns (`shard-NNNNNN.tar`, `<name>.parquet`) as whole strings (fullmatch: `$` accepts a trailing
newline): no `/`, no `..`, no scheme, so every path stays inside the dataset. Every byte count is bounded before a
reader allocates by it, and every count that sizes a buffer is tied to the row's duration: num_samples must be
duration_s x sample_rate_hz (1% + 1 ms; the planner budgets durations, the reader allocates sample counts), and
audio_size within what a codec stores for it. The index file itself (footer, string lengths) is bounded before it
is read: format/indexread.py. A violation is one `DatasetError` naming the file,
the field and the (escaped, shortened) value, raised when the dataset is opened or its index read, before any
shard byte is read.

Cost: the manifest check is O(shards) Python; the index check is vectorised numpy over the columns read plus one
stable sort by (shard, offset) for the overlap check: ~0.2 s per million rows, paid once per `read_index`.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np
import pyarrow.compute as pc

from shardtrain.format.arrownp import filled, numpy_of

BLOCK = 512
SHARD_NAME_RE = re.compile(r"shard-[0-9]{6,9}\.tar")
INDEX_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,100}\.parquet")
REJECTS_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,100}\.jsonl")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
KEY_PATTERN = r"\A[A-Za-z0-9_-]{1,80}\z"
"""Sample keys (format/tar.KEY_RE): they name tar members and land in logs and loader state."""

MAX_MANIFEST_BYTES = 512 << 20
"""~1.5M shards' worth of manifest; a larger one is refused before parsing."""
MAX_SHARDS = 10_000_000
MAX_SHARD_SAMPLES = 100_000_000
MAX_SHARD_BYTES = 1 << 44
"""16 TiB: beyond any real shard; what bounds allocation is the per-row bounds below."""
from shardtrain.format.limits import (MAX_AUDIO_BYTES, MAX_CHANNELS, MAX_DURATION_S,  # noqa: E402,F401 - one set
                                     MAX_JSON_BYTES, MAX_SAMPLE_RATE_HZ)
SAMPLES_REL_TOL = 0.01
SAMPLES_ABS_TOL_S = 0.001
"""num_samples may differ from duration_s x sample_rate_hz by 1% + 1 ms + 1 sample (pack writes duration_s =
num_samples / rate exactly; the slack admits durations rounded by other tools). It bounds what a batch can
hold: at most 1.01 x its budget + 1 ms a row, where an unrelated num_samples put 150x the budget in a batch."""
RELATED_COLUMNS = ("duration_s", "num_samples", "sample_rate_hz")
"""Checked against each other: a read that asks for one of them reads all three (Dataset.read_index)."""
MEMBER_SLACK_BYTES = 8 * BLOCK
"""A sample's `size` may exceed its two members' data by at most two headers, padding and this slack."""


class DatasetError(RuntimeError):
    """A dataset URL that cannot be read as shard format v1 (missing/incomplete/unsupported/invalid)."""


def show(value: object, limit: int = 80) -> str:
    """A value as escaped, bounded text for messages and logs: repr (so control characters and quotes are
    escaped), cut to `limit` characters. Use it for anything that came from a dataset."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_manifest(raw: bytes, where: str) -> dict:
    """manifest.json bytes -> dict, or DatasetError (too large, not UTF-8 JSON, nested too deep, not an object)."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise DatasetError(f"{where}: {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have")
    try:
        manifest = json.loads(raw)
    except RecursionError:
        raise DatasetError(f"{where}: JSON nested too deeply to be a manifest") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DatasetError(f"{where}: not valid JSON ({show(str(e), 200)})") from None
    if not isinstance(manifest, dict):
        raise DatasetError(f"{where}: a manifest is a JSON object, found {type(manifest).__name__}")
    return manifest


def _int(d: dict, k: str, where: str, lo: int, hi: int) -> int:
    v: Any = d.get(k)
    if type(v) is not int or not lo <= v <= hi:  # noqa: E721 - bool is an int subclass and is not a count
        raise DatasetError(f"{where}.{k} = {show(v)} must be an integer in [{lo}, {hi}]")
    return v


def _float(d: dict, k: str, where: str, lo: float, hi: float) -> float:
    v: Any = d.get(k)
    if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
        raise DatasetError(f"{where}.{k} = {show(v)} must be a number in [{lo}, {hi}]")
    return float(v)


def _name(d: dict, k: str, where: str, pattern: re.Pattern, default: str | None = None) -> str:
    v = d.get(k, default)
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise DatasetError(f"{where}.{k} = {show(v)} must match {pattern.pattern} (a file inside the dataset)")
    return v


def check_shard_entry(s: object, where: str) -> dict:
    """One manifest `shards[i]` entry, type- and range-checked; returns the fields ShardInfo takes."""
    if not isinstance(s, dict):
        raise DatasetError(f"{where} = {show(s)} must be an object")
    out: dict[str, Any] = {
        "name": _name(s, "name", where, SHARD_NAME_RE),
        "samples": _int(s, "samples", where, 0, MAX_SHARD_SAMPLES),
        "seconds": _float(s, "seconds", where, 0.0, MAX_DURATION_S * MAX_SHARD_SAMPLES),
        "min_duration_s": _float(s, "min_duration_s", where, 0.0, MAX_DURATION_S),
        "max_duration_s": _float(s, "max_duration_s", where, 0.0, MAX_DURATION_S),
        "bytes": _int(s, "bytes", where, 0, MAX_SHARD_BYTES),
        "sha256": s.get("sha256"),
    }
    if not isinstance(out["sha256"], str) or not SHA256_RE.fullmatch(out["sha256"]):
        raise DatasetError(f"{where}.sha256 = {show(out['sha256'])} must be 64 lowercase hex digits")
    if out["min_duration_s"] > out["max_duration_s"]:
        raise DatasetError(f"{where}: min_duration_s {out['min_duration_s']} > max_duration_s {out['max_duration_s']}")
    return out


def check_manifest(m: dict, where: str) -> list[dict]:
    """Check the fields readers use; returns the shard entries (dicts for ShardInfo) or raises DatasetError."""
    shards = m.get("shards")
    if not isinstance(shards, list) or len(shards) > MAX_SHARDS:
        raise DatasetError(f"{where}: shards = {show(shards)} must be a list of at most {MAX_SHARDS} objects")
    entries = [check_shard_entry(s, f"{where}: shards[{i}]") for i, s in enumerate(shards)]
    seen: dict[str, int] = {}
    for i, e in enumerate(entries):
        if e["name"] in seen:
            raise DatasetError(f"{where}: shards[{i}].name {e['name']!r} repeats shards[{seen[e['name']]}]")
        seen[e["name"]] = i
    _name(m, "index", f"{where}:", INDEX_NAME_RE, default="index.parquet")
    if "rejects" in m:
        _name(m, "rejects", f"{where}:", REJECTS_NAME_RE)
    if "options" in m and not isinstance(m["options"], dict):
        raise DatasetError(f"{where}: options = {show(m['options'])} must be an object")
    totals = m.get("totals")
    if not isinstance(totals, dict):
        raise DatasetError(f"{where}: totals = {show(totals)} must be an object")
    tw = f"{where}: totals"
    samples = _int(totals, "samples", tw, 0, MAX_SHARDS * MAX_SHARD_SAMPLES)
    _float(totals, "seconds", tw, 0.0, math.inf)
    _int(totals, "bytes", tw, 0, MAX_SHARDS * MAX_SHARD_BYTES)
    n = _int(totals, "shards", tw, 0, MAX_SHARDS)
    if n != len(entries) or samples != sum(e["samples"] for e in entries):
        raise DatasetError(f"{where}: totals say {n} shards / {samples} samples, the shard list has "
                           f"{len(entries)} / {sum(e['samples'] for e in entries)}")
    return entries


# ---- index ---------------------------------------------------------------------------------------------------
def _col(table, name: str, dtype) -> np.ndarray | None:
    if name not in table.column_names:
        return None
    col = table.column(name)
    if col.null_count:
        raise DatasetError(f"index.parquet: column {name} has {col.null_count} null values")
    try:
        return np.asarray(numpy_of(col), dtype=dtype)
    except (TypeError, ValueError) as e:
        raise DatasetError(f"index.parquet: column {name} is not numeric ({show(str(e))})") from None


def _fail(table, what: str, bad: np.ndarray, values: dict[str, np.ndarray], first_row: int = 0) -> None:
    """Raise for the first row flagged in `bad`, naming it by row number and (when read and valid) key."""
    if not bad.any():
        return
    row = int(np.flatnonzero(bad)[0])
    key = ""
    if "key" in table.column_names:
        key = f" (key {show(table.column('key')[row].as_py())})"
    shown = ", ".join(f"{k} = {v[row].item()!r}" for k, v in values.items())
    raise DatasetError(f"index.parquet row {first_row + row}{key}: {shown}: {what} ({int(bad.sum())} rows like it)")


def check_index(table, shard_bytes: list[int], shard_samples: list[int] | None, first_row: int = 0) -> None:
    """Check the columns of `table` that were read (any projection of INDEX_SCHEMA) against the manifest's
    shard list; raises DatasetError for the first violation. Rows must all be present (projections are by column),
    unless `shard_samples` is None: then `table` is one slice of the index (a row group, load/mapped.py) whose
    first row is `first_row`, and the whole-table checks (rows per shard, unique keys) are the caller's."""
    names = set(table.column_names)
    if "key" in names:
        keys = table.column("key")
        ok = numpy_of(filled(pc.match_substring_regex(keys, KEY_PATTERN), False))
        _fail(table, f"key must match {KEY_PATTERN}", ~ok, {}, first_row=first_row)
        if shard_samples is not None and len(pc.unique(keys)) != len(keys):
            raise DatasetError("index.parquet: column key holds duplicate keys")
    if "codec" in names:
        from shardtrain.format.codecs import CODECS

        odd = set(table.column("codec").unique().to_pylist()) - set(CODECS)
        if odd:
            raise DatasetError(f"index.parquet: column codec holds {show(sorted(map(str, odd))[:3])}, not one of "
                               f"{CODECS}")
    shard = _col(table, "shard", np.int64)
    if shard is not None:
        _fail(table, f"shard must be in [0, {len(shard_bytes)})", (shard < 0) | (shard >= len(shard_bytes)),
              {"shard": shard}, first_row=first_row)
        counts = np.bincount(shard, minlength=len(shard_bytes))
        wrong = (np.flatnonzero(counts != np.asarray(shard_samples, np.int64)) if shard_samples is not None
                 else np.zeros(0, np.int64))
        if len(wrong):
            i = int(wrong[0])
            raise DatasetError(f"index.parquet: {counts[i]} rows for shard {i}, the manifest says "
                               f"{shard_samples[i]}")  # type: ignore[index]
    _check_numbers(table, first_row)
    _check_offsets(table, shard, np.asarray(shard_bytes, np.int64), first_row)


def _check_numbers(table, first_row: int = 0) -> None:
    dur = _col(table, "duration_s", np.float64)
    rate = _col(table, "sample_rate_hz", np.int64)
    chans = _col(table, "channels", np.int64)
    n = _col(table, "num_samples", np.int64)
    if dur is not None:
        _fail(table, f"duration_s must be finite and in [0, {MAX_DURATION_S}]",
              ~np.isfinite(dur) | (dur < 0) | (dur > MAX_DURATION_S), {"duration_s": dur}, first_row=first_row)
    if rate is not None:
        _fail(table, f"sample_rate_hz must be in [1, {MAX_SAMPLE_RATE_HZ}]", (rate < 1) | (rate > MAX_SAMPLE_RATE_HZ),
              {"sample_rate_hz": rate}, first_row=first_row)
    if chans is not None:
        _fail(table, f"channels must be in [1, {MAX_CHANNELS}]", (chans < 1) | (chans > MAX_CHANNELS),
              {"channels": chans}, first_row=first_row)
    if n is not None:
        _fail(table, f"num_samples must be in [0, {MAX_DURATION_S * MAX_SAMPLE_RATE_HZ:.0f}]",
              (n < 0) | (n > MAX_DURATION_S * MAX_SAMPLE_RATE_HZ), {"num_samples": n}, first_row=first_row)
    if n is not None and dur is not None and rate is not None:
        # the planner budgets duration_s, a reader allocates num_samples: they must be the same length of audio
        expect = dur * rate
        tol = expect * SAMPLES_REL_TOL + rate * SAMPLES_ABS_TOL_S + 1
        _fail(table, f"num_samples must be duration_s x sample_rate_hz (within {SAMPLES_REL_TOL:.0%} + "
                     f"{SAMPLES_ABS_TOL_S * 1e3:.0f} ms)", np.abs(n - expect) > tol,
              {"num_samples": n, "duration_s": dur, "sample_rate_hz": rate}, first_row=first_row)
    asize = _col(table, "audio_size", np.int64)
    if asize is not None and dur is not None and rate is not None and chans is not None:
        limit = 4096 + dur * rate * chans * 8  # 8 bytes per sample: float64 WAV, the largest codec stores
        _fail(table, "audio_size is larger than any codec stores for the row's duration", asize > limit,
              {"audio_size": asize, "duration_s": dur}, first_row=first_row)


def _check_offsets(table, shard: np.ndarray | None, shard_bytes: np.ndarray, first_row: int = 0) -> None:
    cols = {k: _col(table, k, np.int64) for k in ("offset", "size", "audio_offset", "audio_size", "json_offset",
                                                   "json_size")}
    present = {k: v for k, v in cols.items() if v is not None}
    for k, v in present.items():
        _fail(table, f"{k} must be >= 0", v < 0, {k: v}, first_row=first_row)
    for k, hi in (("audio_size", MAX_AUDIO_BYTES), ("json_size", MAX_JSON_BYTES)):
        if k in present:
            _fail(table, f"{k} must be <= {hi}", present[k] > hi, {k: present[k]}, first_row=first_row)
    end = shard_bytes[shard] if shard is not None else None
    for a, s in (("audio_offset", "audio_size"), ("json_offset", "json_size"), ("offset", "size")):
        if a in present and s in present:
            if a != "offset":
                _fail(table, f"{a} must leave room for its {BLOCK}-byte tar header", present[a] < BLOCK,
                      {a: present[a]}, first_row=first_row)
            if end is not None:
                _fail(table, "member ends past the end of its shard (manifest bytes)",
                      present[a] + present[s] > end, {a: present[a], s: present[s]}, first_row=first_row)
    if len(present) < 6:
        return
    off, size, ao, asz, jo, jsz = (present[k] for k in ("offset", "size", "audio_offset", "audio_size",
                                                        "json_offset", "json_size"))
    stop = off + size
    inside = (ao - BLOCK >= off) & (ao + asz <= stop) & (jo - BLOCK >= off) & (jo + jsz <= stop)
    _fail(table, "audio and json members (with their headers) must lie inside [offset, offset + size)", ~inside,
          {"offset": off, "size": size, "audio_offset": ao, "json_offset": jo}, first_row=first_row)
    apart = (ao + asz <= jo - BLOCK) | (jo + jsz <= ao - BLOCK)
    _fail(table, "audio and json members overlap", ~apart, {"audio_offset": ao, "json_offset": jo}, first_row=first_row)
    _fail(table, f"size exceeds its members by more than {MEMBER_SLACK_BYTES} bytes",
          size > asz + jsz + MEMBER_SLACK_BYTES, {"size": size, "audio_size": asz, "json_size": jsz},
          first_row=first_row)
    if shard is not None and len(off) > 1:
        order = np.lexsort((off, shard))
        same = shard[order][1:] == shard[order][:-1]
        overlap = same & (off[order][1:] < stop[order][:-1])
        if overlap.any():
            i = int(np.flatnonzero(overlap)[0])
            r0, r1 = int(order[i]), int(order[i + 1])
            raise DatasetError(f"index.parquet rows {first_row + r0} and {first_row + r1} overlap in shard "
                               f"{int(shard[r0])}: bytes "
                               f"[{off[r0]}, {stop[r0]}) and [{off[r1]}, {stop[r1]}) ({int(overlap.sum())} such pairs)")
