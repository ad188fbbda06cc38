"""The global layout of a pack, on the driver, from PartScans only: duplicates, keys, rejects, sort, shards, fingerprint.

    [PartScan] (input order) -> duplicate ids (first kept)         -> rejects (with the source rejects, input order)
                             -> keys: sanitised ids, collision-free  (keys.assign_keys' rule, over the whole input)
                             -> late rejects get their keys         -> rejects (input order)
                             -> sort accepted by (duration_s, key)   -> cut by estimated bytes / samples
                             -> fingerprint (options + per sample: shard, key, digest)
    = Layout: per shard the (part, row) of each sample in order, and its keys; the records stay with the engine.

Pure functions of the scans and the options, so both engines and any number of workers get the same layout.
Memory: Arrow string columns and numpy arrays, about 100-150 bytes per item at the peak (see README, "Packing on
Ray"); no Python object per item except transiently for the rare duplicate or key collision.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardtrain.format import manifest as index
from shardtrain.format.arrownp import arrow_of, bool_arrow, numpy_of, string_arrow
from shardtrain.pack.keys import _sha8, assign_keys
from shardtrain.pack.scan import DIGEST_BYTES, PartScan
from shardtrain.pack.shard_task import PackError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Rejects:
    """Reject rows in the order they are written to rejects.jsonl; under `strict` the first one raises."""

    strict: bool
    rows: list[dict]

    def add(self, row: dict) -> None:
        if self.strict:
            detail = row.get("detail", "")
            raise PackError(
                f"--strict: bad input item {row['id']!r} ({row['path']}): {row['reason']}"
                f"{': ' + detail if detail else ''}. "
                "Fix the input, or drop --strict to skip it and record it in rejects.jsonl")
        log.debug("reject %s (%s): %s %s", row["id"], row["path"], row["reason"], row.get("detail", ""))
        self.rows.append(row)


@dataclass(slots=True)
class ShardSpec:
    """One shard of the layout: the (part, row) of each sample in layout order and its key."""

    shard: int
    parts: np.ndarray
    rows: np.ndarray
    keys: list[str]


@dataclass(slots=True)
class Layout:
    fingerprint: str
    samples: int
    shards: int
    items: int
    """Items read from the input (samples + rejects before encoding)."""
    rejects: Rejects
    _order: np.ndarray
    """Global candidate index of each accepted sample, in layout order."""
    _cuts: np.ndarray
    """Shard i is _order[_cuts[i]:_cuts[i + 1]]."""
    _starts: np.ndarray
    """First global candidate index of each part."""
    _keys: pa.Array
    """Keys in layout order."""

    def spec(self, i: int) -> ShardSpec:
        g = self._order[self._cuts[i]: self._cuts[i + 1]]
        parts = np.searchsorted(self._starts, g, side="right") - 1
        return ShardSpec(shard=i, parts=parts, rows=g - self._starts[parts],
                         keys=self._keys[self._cuts[i]: self._cuts[i + 1]].to_pylist())

    def shard_sizes(self) -> np.ndarray:
        return np.diff(self._cuts)


def _duplicates(ids: pa.ChunkedArray) -> np.ndarray:
    """Mask of ids equal to an earlier id (the first one in input order is kept). Stable sort, no Python set."""
    n = len(ids)
    dup = np.zeros(n, bool)
    if n < 2:
        return dup
    order = numpy_of(pc.sort_indices(ids))  # stable: equal ids stay in input order
    s = ids.take(arrow_of(order))
    same = numpy_of(pc.equal(s.slice(1), s.slice(0, n - 1)))
    dup[order[1:][same]] = True
    return dup


def _adjacent_equal(values: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Positions (original) of values that occur more than once."""
    n = len(values)
    if n < 2:
        return np.zeros(0, np.int64)
    order = numpy_of(pc.sort_indices(values))
    s = values.take(arrow_of(order))
    same = numpy_of(pc.equal(s.slice(1), s.slice(0, n - 1)))
    return np.unique(np.concatenate([order[1:][same], order[:-1][same]]))


def assign_keys_columnar(ids: pa.ChunkedArray, sanitized: pa.ChunkedArray) -> pa.Array:
    """keys.assign_keys for Arrow columns: the same keys, without a dict entry per id. Ids sharing a sanitised
    key get `-sha1[:8]` (one equal to its key keeps it); any remaining clash (astronomically rare) falls back to
    keys.assign_keys itself over all ids, so the result is always exactly assign_keys'."""
    keys = sanitized.combine_chunks() if isinstance(sanitized, pa.ChunkedArray) else sanitized
    clash = _adjacent_equal(keys)
    if len(clash):
        mask = np.zeros(len(keys), bool)
        mask[clash] = True
        clash_ids = ids.take(arrow_of(clash)).to_pylist()
        clash_keys = keys.take(arrow_of(clash)).to_pylist()
        new = [k if i == k else k[:71] + "-" + _sha8(i) for i, k in zip(clash_ids, clash_keys)]
        keys = pc.replace_with_mask(keys, bool_arrow(mask), string_arrow(new))
        if len(_adjacent_equal(keys)):
            all_ids = ids.to_pylist()
            table = assign_keys(all_ids)
            keys = string_arrow([table[i] for i in all_ids])
    return keys


def _concat(scans: list[PartScan], name: str) -> np.ndarray:
    arrays = [getattr(s, name) for s in scans]
    return np.concatenate(arrays) if arrays else getattr(PartScan(index=0, items=0), name)


def _early_rejects(scans: list[PartScan], dup: np.ndarray, starts: np.ndarray, rejects: Rejects,
                   path_of: Callable[[int, int], str]) -> None:
    """Source rejects, empty transcripts and duplicate ids, merged in input order."""
    for p, scan in enumerate(scans):
        dups = np.flatnonzero(dup[starts[p]: starts[p] + len(scan.pos)])
        rows = [(pos, row) for pos, row in scan.early]
        for j in dups.tolist():
            rows.append((int(scan.pos[j]), {"id": scan.ids[j].as_py(), "key": None, "path": path_of(p, j),
                                            "reason": "duplicate_id",
                                            "detail": "an earlier item has the same id; the first one is kept"}))
        for _, row in sorted(rows, key=lambda r: r[0]):
            rejects.add(row)


def _duplicate_audio(source: np.ndarray, eligible: np.ndarray, ids: pa.ChunkedArray, starts: np.ndarray,
                     rejects: Rejects, path_of: Callable[[int, int], str]) -> np.ndarray:
    """Mask of eligible candidates whose audio (path, segment start and length: scan.source_digest) an earlier
    eligible one already stores, each added to `rejects` as `duplicate_audio` naming the first. Why: a manifest
    merged from two versions lists an utterance under two ids, twice the weight in training, or twice with
    different transcripts, one of them wrong. Cost: one stable sort of 8-byte hashes."""
    out = np.zeros(len(eligible), bool)
    cand = np.flatnonzero(eligible)
    if len(cand) < 2:
        return out
    order = cand[np.argsort(source[cand], kind="stable")]
    same = source[order[1:]] == source[order[:-1]]
    if not same.any():
        return out
    first = order.copy()
    for i in np.flatnonzero(same).tolist():  # runs of equal hashes: every later one points at the run's first
        first[i + 1] = first[i]
    for i in sorted(np.flatnonzero(same).tolist(), key=lambda i: int(order[i + 1])):  # rejects in input order
        g, f = int(order[i + 1]), int(first[i + 1])
        p = int(np.searchsorted(starts, g, "right")) - 1
        out[g] = True
        rejects.add({"id": ids[g].as_py(), "key": None, "path": path_of(p, g - int(starts[p])),
                     "reason": "duplicate_audio",
                     "detail": f"the same audio (path, start, length) as id {ids[f].as_py()!r}; the first is kept"})
    return out


def cut_shards(est_bytes: np.ndarray, target_bytes: int, max_samples: int | None) -> np.ndarray:
    """Cut points over samples in layout order: a shard ends before the sample that would pass `target_bytes`
    (estimated) or `max_samples`. Returns [0, ..., n]. Walks the sizes in chunks (no Python int per item)."""
    cuts = [0]
    cur, start = 0, 0
    for a in range(0, len(est_bytes), 1 << 16):
        for i, b in enumerate(est_bytes[a: a + (1 << 16)].tolist(), a):
            if i > start and (cur + b > target_bytes or (max_samples is not None and i - start >= max_samples)):
                cuts.append(i)
                cur, start = 0, i
            cur += b
    if len(est_bytes):
        cuts.append(len(est_bytes))
    return np.asarray(cuts, np.int64)


def fingerprint(options: dict, keys: pa.Array, digests: np.ndarray, cuts: np.ndarray) -> str:
    """sha256 over the output-shaping options and, per shard, each sample's key and digest (sample_digest)."""
    h = hashlib.sha256()
    h.update(json.dumps({"format_version": index.FORMAT_VERSION, **options}, sort_keys=True).encode())
    raw = digests.view(np.uint8).reshape(-1, DIGEST_BYTES) if len(digests) else digests
    for i in range(len(cuts) - 1):
        a, b = int(cuts[i]), int(cuts[i + 1])
        h.update(f"\nshard {i}\n".encode())
        for k, d in zip(keys[a:b].to_pylist(), raw[a:b]):
            h.update(k.encode() + b"\t" + d.tobytes() + b"\n")
    return h.hexdigest()


def lay_out(cfg, scans: list[PartScan], path_of: Callable[[int, int], str]) -> Layout:
    """The whole layout from the scans (any order; sorted by part here). `path_of(part, row)` gives a candidate's
    audio path (only asked for duplicates). Raises PackError under cfg.strict at the first reject in input order.
    Consumes `scans`: the list is emptied once its columns are concatenated, so that the driver's peak holds each
    column once (pass a list nobody else keeps)."""
    scans.sort(key=lambda s: s.index)
    items = sum(s.items for s in scans)
    sizes = np.asarray([len(s.pos) for s in scans], np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(scans) else np.zeros(0, np.int64)
    ids = pa.chunked_array([s.ids for s in scans], pa.string())
    sanitized = pa.chunked_array([s.keys for s in scans], pa.string())
    dup = _duplicates(ids)
    rejects = Rejects(strict=cfg.strict, rows=[])
    _early_rejects(scans, dup, starts, rejects, path_of)
    late = [(int(starts[p]) + j, scan.late[j]) for p, scan in enumerate(scans) for j in sorted(scan.late)]
    ok, dur, est, digest = (_concat(scans, name) for name in ("ok", "duration_s", "est_bytes", "digest"))
    ok = ok.astype(bool) & ~_duplicate_audio(_concat(scans, "source"), ok.astype(bool) & ~dup, ids, starts,
                                             rejects, path_of)
    scans.clear()

    kept = np.flatnonzero(~dup)
    keys = string_arrow([])
    if len(kept) == len(dup) and len(kept):  # no duplicates: no copies
        keys = assign_keys_columnar(ids, sanitized)
    elif len(kept):
        sel = arrow_of(kept)
        keys = assign_keys_columnar(ids.take(sel), sanitized.take(sel))
    del ids, sanitized
    key_of = np.full(len(dup), -1, np.int64)
    key_of[kept] = np.arange(len(kept))
    for g, reject in late:  # probe failures and duration filters, input order, now with their keys
        if not dup[g]:
            rejects.add({**reject, "key": keys[int(key_of[g])].as_py()})

    acc = np.flatnonzero(ok.astype(bool) & ~dup)
    del dup, ok
    acc_keys = keys.take(arrow_of(key_of[acc])) if len(acc) < len(keys) else keys
    del key_of, keys
    key_rank = np.empty(len(acc), np.int64)  # (duration_s, key) order: numpy lexsort on (rank of key, duration)
    key_rank[numpy_of(pc.sort_indices(acc_keys))] = np.arange(len(acc))
    by = np.lexsort((key_rank, dur[acc]))
    del key_rank, dur
    order = acc[by]
    sorted_keys = acc_keys.take(arrow_of(by)) if len(by) else acc_keys
    del acc_keys, acc, by
    cuts = cut_shards(est[order], int(cfg.target_shard_mb * (1 << 20)), cfg.max_samples_per_shard)
    del est
    fp = fingerprint(cfg.dataset_options(), sorted_keys, digest[order] if len(order) else digest[:0], cuts)
    return Layout(fingerprint=fp, samples=len(order), shards=len(cuts) - 1 if len(cuts) else 0, items=items,
                  rejects=rejects, _order=order, _cuts=cuts, _starts=starts, _keys=sorted_keys)


def iter_specs(layout: Layout, skip: set[int] | frozenset = frozenset()) -> Iterator[ShardSpec]:
    for i in range(layout.shards):
        if i not in skip:
            yield layout.spec(i)
