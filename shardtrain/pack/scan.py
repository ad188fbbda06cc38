"""Scan one part of the input: read its items, probe their headers, apply the per-item filters (a pack task).

    SourcePart -> sources.part_items -> Item | Reject
               -> per item: source reject / empty transcript        -> PartScan.early (reject rows, input position)
               -> probe headers (threads)                           -> AudioInfo | AudioError
               -> empty_audio, segment_out_of_range, too_short/long,
                  format limits, impossible_target (pack/itemcheck)  -> PartScan.late (reject rows, keys added later)
    -> (PartScan: the compact columns the global layout needs, records: [(Item, AudioInfo, duration_s, est_bytes)])

Both engines run `scan_part` unchanged: LocalEngine in the driver, RayEngine as a Ray task. Only the PartScan goes
to the driver; it holds per candidate an id, its sanitised key, flags, duration, estimated bytes and a 16-byte
digest of everything else that shapes the sample (so the dataset fingerprint covers text, paths and headers
without the driver holding them). The records stay with the engine (in memory locally, in Ray's object store).
What needs the whole input (duplicate ids, key collisions, the global sort) is decided by layout.py on the driver.
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from shardtrain import storage
from shardtrain.format.arrownp import string_arrow
from shardtrain.format.codecs import ENCODE_RATIO
from shardtrain.pack.itemcheck import item_problem
from shardtrain.pack.keys import sanitize_key
from shardtrain.pack.shard_task import SampleSpec, error_reason

if TYPE_CHECKING:
    from shardtrain.pack.config import PackConfig
    from shardtrain.pack.parts import SourcePart

SAMPLE_OVERHEAD_BYTES = 2048  # two ustar headers + json + padding, for the size estimate only
DIGEST_BYTES = 16


@dataclass(slots=True)
class PartScan:
    """What the driver keeps of one part: ~100 bytes per candidate (ids and keys as Arrow strings)."""

    index: int
    items: int
    """Items read from the input in this part (candidates + early rejects)."""
    early: list[tuple[int, dict]] = field(default_factory=list)
    """(position in the part, reject row): source rejects and empty transcripts."""
    pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    """Position in the part of each candidate (an item with a non-empty transcript)."""
    ids: pa.Array = field(default_factory=lambda: string_arrow([]))
    keys: pa.Array = field(default_factory=lambda: string_arrow([]))
    """sanitize_key(id); layout.assign_keys resolves collisions across the whole input."""
    ok: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    late: dict[int, dict] = field(default_factory=dict)
    """Candidate index -> reject row (probe failures and duration filters), without its key."""
    duration_s: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    est_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    digest: np.ndarray = field(default_factory=lambda: np.zeros(0, f"S{DIGEST_BYTES}"))
    source: np.ndarray = field(default_factory=lambda: np.zeros(0, "S8"))
    """Per accepted candidate, 8 bytes of hash over where its audio is (source_digest); zeros otherwise."""


def source_digest(item, info=None) -> bytes:
    """Where an item's audio comes from (path or URL, segment start and length): equal for two entries that would
    store the same samples, so layout.lay_out can refuse the second (`duplicate_audio`).

    With the file's AudioInfo the segment is compared in samples, as transcode.segment_frames cuts it: seconds
    differing only by float noise name the same samples (a Lhotse supervision seen through two windows of
    `cut_into_windows` comes back at 8.1 and 8.100000000000001 s, which compared as seconds packed it twice), and
    so do a whole file listed with and without its duration. Without `info` (or for a segment the file cannot
    hold, which encoding rejects anyway) the seconds are compared as given."""
    span = f"{item.start_s!r}\0{item.duration_s!r}"
    if info is not None:
        from shardtrain.format.audio import AudioError
        from shardtrain.pack.transcode import segment_frames

        try:
            span = "frames\0%d\0%d" % segment_frames(item, info)
        except AudioError:
            pass
    return hashlib.blake2b(f"{item.audio}\0{span}".encode(), digest_size=8).digest()


def _kept(cfg: PackConfig, info) -> bool:
    """Whether the file's bytes will likely be stored unchanged (then its size is the best size estimate)."""
    a = cfg.audio
    return a.keep_original or (info.codec, info.sample_rate_hz, info.channels) == (a.codec, a.sample_rate_hz, a.channels)


def _probe_one(cfg: PackConfig, item):
    """(AudioInfo, file size or 0, stamp) or (exception, None, ""); never raises, so one bad file costs one reject.

    A local file's stamp (size and mtime_ns, one stat) goes into its sample digest, so the dataset fingerprint
    changes when a file is rewritten in place: a re-pack (or a resumed pack) over edited audio of the same length
    writes the new bytes instead of finding the old dataset "already complete". Remote inputs have no stamp (it
    would cost a HEAD each); their size is fetched only for files that will be kept."""
    from shardtrain.pack.probe import probe

    try:
        info = probe(str(item.audio), cfg.storage_options)
    except Exception as e:  # noqa: BLE001 - AudioError, soundfile/OS errors: all reject this item
        return e, None, ""
    nbytes, stamp, path = 0, "", str(item.audio)
    try:
        if _is_local(path) and "#bytes=" not in path:
            st = os.stat(path)
            nbytes, stamp = st.st_size, f"{st.st_size}:{st.st_mtime_ns}"
        elif _kept(cfg, info):
            nbytes = storage.size(path, cfg.storage_options)
    except Exception:  # noqa: BLE001 - only used for the size estimate and the stamp
        pass
    return info, nbytes, stamp


def _is_local(path: str) -> bool:
    """A plain local path (what a local input's items carry): read in this process, one core per worker process;
    remote URLs are I/O-bound and probed by `probe_threads` threads."""
    return "://" not in path


def _estimate_bytes(cfg: PackConfig, info, duration_s: float, file_bytes: int) -> int:
    """Stored size guess from headers: original bytes (pro rata for a segment) when kept, else PCM x ratio."""
    if _kept(cfg, info) and file_bytes and info.duration_s > 0:
        est = file_bytes * min(1.0, duration_s / info.duration_s)
    else:
        a = cfg.audio
        est = duration_s * a.sample_rate_hz * a.channels * 2 * ENCODE_RATIO[a.codec]
    return int(est) + SAMPLE_OVERHEAD_BYTES


def _filter(cfg: PackConfig, item, info) -> tuple[float, dict | None]:
    """(duration_s, None) for a usable probe result, else (0, reject row without key)."""
    from shardtrain.pack.probe import SEGMENT_TOLERANCE_S

    path = str(item.audio)

    def reject(reason: str, detail: str = "") -> tuple[float, dict]:
        row = {"id": item.id, "key": None, "path": path, "reason": reason}
        if detail:
            row["detail"] = detail
        return 0.0, row

    if isinstance(info, BaseException):
        return reject(*error_reason(info, "unreadable_audio"))
    start_s = float(item.start_s or 0.0)
    duration_s = float(item.duration_s) if item.duration_s is not None else info.duration_s - start_s
    if info.num_samples <= 0 or duration_s <= 0:
        return reject("empty_audio", "0 samples")
    if start_s + duration_s > info.duration_s + SEGMENT_TOLERANCE_S:
        return reject("segment_out_of_range", f"{start_s}+{duration_s}s > {info.duration_s}s")
    if cfg.min_duration_s is not None and duration_s < cfg.min_duration_s:
        return reject("too_short", f"{duration_s:.3f} s < --min-duration-s {cfg.min_duration_s:g}")
    if cfg.max_duration_s is not None and duration_s > cfg.max_duration_s:
        return reject("too_long", f"{duration_s:.3f} s > --max-duration-s {cfg.max_duration_s:g}")
    problem = item_problem(cfg, item, duration_s)  # format limits, CTC-impossible transcripts
    return (duration_s, None) if problem is None else reject(*problem)


def sample_digest(s: SampleSpec, stamp: str = "") -> bytes:
    """sha256[:16] of everything that shapes a sample's bytes except its key (the driver adds the key), and the
    source file's stamp (`_probe_one`)."""
    ident = s.identity()
    ident.pop("key")
    if stamp:
        ident["stamp"] = stamp
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).digest()[:DIGEST_BYTES]


def _early_reject(x) -> dict | None:
    """Reject row for a source Reject or an empty transcript (decided without audio), else None."""
    from shardtrain.pack.item import Item

    if not isinstance(x, Item):
        code, _, detail = str(x.reason).partition(": ")
        row = {"id": str(x.id), "key": None, "path": str(x.path), "reason": code}
        if detail:
            row["detail"] = detail
        return row
    if not (x.text or "").strip():
        return {"id": str(x.id), "key": None, "path": str(x.audio), "reason": "empty_transcript"}
    return None


def collapse_whitespace(text: str) -> str:
    """Runs of whitespace (spaces, tabs, line breaks, any Unicode space) -> one space; ends stripped."""
    return " ".join(text.split())


def _collapse_text(item):
    """The item with its transcript's whitespace collapsed: what the index and `<key>.json` store as `text`.
    A double space, a tab or a line break inside a transcript is never meaningful, and kept it would become a
    vocabulary symbol or a scoring difference. Anything beyond whitespace (case, punctuation, Unicode form) is
    left to the trainer's normaliser, so `text` stays the transcript as written."""
    from dataclasses import replace

    text = item.text
    if text is None or text == collapse_whitespace(text):
        return item
    return replace(item, text=collapse_whitespace(text))


def scan_part(cfg: PackConfig, part: SourcePart) -> tuple[PartScan, list[Any]]:
    """Read, probe and filter one part. Returns its PartScan and one record per candidate,
    `(Item, AudioInfo, duration_s, est_bytes)` (AudioInfo None for a late reject). Never raises for bad items.
    Cost: one header read (plus a stat for kept files) per item, `cfg.probe_threads` at a time."""
    from shardtrain.pack.parts import part_items
    from shardtrain.pack.item import Item

    early: list[tuple[int, dict]] = []
    cands: list[Item] = []
    positions: list[int] = []
    n = 0
    for n, x in enumerate(part_items(part, cfg.storage_options), 1):
        row = _early_reject(x)
        if row is not None:
            early.append((n - 1, row))
        elif isinstance(x, Item):
            cands.append(_collapse_text(x))
            positions.append(n - 1)
    if cfg.probe_threads == 1 or all(_is_local(str(c.audio)) for c in cands):
        probed = [_probe_one(cfg, it) for it in cands]  # local files: threads only add hand-offs (the GIL)
    else:
        with ThreadPoolExecutor(min(cfg.probe_threads, max(1, len(cands)))) as ex:
            probed = list(ex.map(lambda it: _probe_one(cfg, it), cands))
    m = len(cands)
    ok, dur, est = np.zeros(m, bool), np.zeros(m, np.float64), np.zeros(m, np.int64)
    digest, source = np.zeros(m, f"S{DIGEST_BYTES}"), np.zeros(m, "S8")
    late: dict[int, dict] = {}
    records: list[Any] = []
    for j, (item, (info, nbytes, stamp)) in enumerate(zip(cands, probed)):
        duration_s, reject = _filter(cfg, item, info)
        if reject is not None:
            late[j] = reject
            records.append((item, None, 0.0, 0))
            continue
        e = _estimate_bytes(cfg, info, duration_s, nbytes)
        ok[j], dur[j], est[j] = True, duration_s, e
        digest[j] = sample_digest(SampleSpec(key="", item=item, info=info, duration_s=duration_s, est_bytes=e),
                                  stamp)
        source[j] = source_digest(item, info)
        records.append((item, info, duration_s, e))
    scan = PartScan(index=part.index, items=n, early=early, pos=np.asarray(positions, np.int32),
                    ids=string_arrow([c.id for c in cands]), keys=string_arrow([sanitize_key(c.id) for c in cands]),
                    ok=ok, late=late, duration_s=dur, est_bytes=est, digest=digest,
                    source=source)
    return scan, records
