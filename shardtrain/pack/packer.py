"""Pack a speech corpus into duration-sorted shards (format v1) plus index.parquet and manifest.json.

    INPUT -> sources.iter_parts -> SourcePart (~part_items items, input order)             (driver: listing)
          -> engine.scan: scan.scan_part per part                                          (tasks)
               read items, probe headers (threads), per-item filters -> PartScan + records (records stay in the engine)
          -> layout.lay_out: duplicate ids, keys, rejects, sort by (duration_s, key),
               cut shards by estimated bytes / samples, fingerprint                         (driver: the global layout)
          -> engine.write: shard_task.write_shard per shard of the layout not yet done            (tasks)
               encode_for_shard, json, ustar, sha256, temp name + rename / one PUT, done-marker
          -> index.parquet -> rejects.jsonl -> manifest.json (LAST: the commit point)       (driver)

Engines (engine.py): "local" scans in this process and writes in a process pool; "ray" runs the same two task
functions as Ray tasks. Everything that shapes the output is decided by the layout, so both engines, any worker
count and any task order give the same bytes.

Resumable: each finished shard leaves `_work/shard-NNNNNN.json` (its index rows, sha256, rejects). Re-running the
same command re-probes (cheap: headers), rebuilds the same layout, and writes only shards without a valid marker.
An OUTPUT holding a dataset with a different fingerprint (options + layout) is refused unless `overwrite`.

Deterministic: the layout depends only on the input and options, each shard only on its layout entry, so the same
input and options give byte-identical shards, index and manifest (except `created_utc`), for any `workers`.
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from shardtrain import storage
from shardtrain._version import __version__
from shardtrain.format import manifest as index
from shardtrain.pack.config import (DEFAULT_MAX_CHARS_PER_S, DEFAULT_MIN_DURATION_S, AudioTarget,  # noqa: F401
                                    PackConfig)
from shardtrain.pack.shard_task import PackError, marker_name
from shardtrain.storage.redact import redact_url

log = logging.getLogger(__name__)

WORK = "_work"
REJECTS = "rejects.jsonl"
@dataclass(slots=True)
class PackResult:
    output: str
    samples: int
    seconds: float
    shards: int
    bytes: int
    rejects: int
    rejects_by_reason: dict[str, int]
    shards_written: int
    """Shards written by this run (the rest were complete from an earlier run)."""
    wall_s: float
    probe_s: float = 0.0
    """Listing + scan + layout: the time before the first shard can be written."""
    write_s: float = 0.0
    """Writing the shards (read, decode check or transcode, tar, sha256, publish) on the engine."""
    scan_s: float = 0.0
    """Of probe_s: listing the input and scanning it (transcripts, headers, filters; pool start-up included)."""
    layout_s: float = 0.0
    """Of probe_s: the global layout (duplicates, keys, sort, cut, fingerprint) on the driver."""
    commit_s: float = 0.0
    """index.parquet from the done-markers, rejects.jsonl, manifest.json, removing _work/."""
    items: int = 0
    """Items read from INPUT (samples + rejects)."""
    clipped: int = 0
    """Accepted float sources with samples past full scale, clipped (each also a warning naming the file)."""
    already_complete: bool = False

    @property
    def hours(self) -> float:
        return self.seconds / 3600.0

    @property
    def files_per_s(self) -> float:
        return self.items / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def audio_hours_per_s(self) -> float:
        return self.hours / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__slots__}
        d.update(hours=self.hours, files_per_s=self.files_per_s, audio_hours_per_s=self.audio_hours_per_s,
                 mb_per_s=self.mb_per_s)
        return d


class _Progress:
    """The one progress bar of a pack, on the driver: items scanned, then samples written (total grows as the
    layout becomes known), with shards and MB written in its postfix. Made at the first scanned part, and only
    when shown: any tqdm, even a disabled one, starts tqdm's monitor thread (alive ~10 s after), and a thread
    alive when LocalEngine forks its pool (start_workers, before the scan) would be one more owner of locks the
    workers inherit, and makes the next pack in the same process fall back to a forkserver (packer._engine)."""

    def __init__(self, cfg: PackConfig) -> None:
        self.show = bool(cfg.progress and sys.stderr.isatty())
        self.bar: Any = None
        self.shards = self.shards_total = self.bytes = 0

    def _bar(self) -> Any:
        if self.bar is None and self.show:
            self.bar = tqdm(dynamic_ncols=True, desc="pack", unit="utt", total=0)
        return self.bar

    def scanned(self, scan) -> None:
        if (bar := self._bar()) is not None:  # not truthiness: a tqdm is falsy while its total is 0
            bar.total += scan.items
            bar.update(scan.items)

    def laid_out(self, samples: int, shards: int) -> None:
        self.shards_total = shards
        if (bar := self._bar()) is not None:
            bar.total += samples
            bar.set_description("pack (write)")
            bar.refresh()

    def written(self, marker: dict) -> None:
        self.shards += 1
        self.bytes += marker["info"]["bytes"]
        if (bar := self._bar()) is not None:
            bar.set_postfix_str(f"shards {self.shards}/{self.shards_total}, {self.bytes / 1e6:.0f} MB", refresh=False)
            bar.update(marker["info"]["samples"] + len(marker["rejects"]))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _IndexRows:
    """index.parquet from the done-markers in `_work/` (they hold each shard's index rows), read back one shard at
    a time in shard order and streamed into row groups of index.ROW_GROUP rows in a local temp file. The driver
    never holds more than one row group of rows (~45 MB with LibriSpeech-length transcripts), whatever the dataset
    size; the cost is one read of each marker (~1.5 KB of JSON per sample). Same bytes as index.index_bytes of the
    whole table."""

    def __init__(self, out: str, so: dict | None) -> None:
        self.out, self.so = out, so

    @staticmethod
    def add(marker: dict) -> dict:
        """The marker without its rows (they are read back from `_work/` by write)."""
        return {k: v for k, v in marker.items() if k != "rows"}

    def _tables(self, n: int):
        storage.ls_names(storage.join(self.out, WORK), self.so)  # refreshes s3fs's listing cache of _work/
        for i in range(n):
            marker = json.loads(storage.read_bytes(storage.join(self.out, f"{WORK}/{marker_name(i)}"), self.so))
            yield index.index_table(marker["rows"])

    def write(self, n: int) -> int:
        """Write index.parquet from shards 0..n-1 (through a local temp file: renamed, or uploaded whole); returns
        the row count."""
        import os
        import tempfile

        import pyarrow as pa
        import pyarrow.parquet as pq

        url = storage.join(self.out, index.INDEX)
        local_dir = storage.fs_and_path(storage.join(self.out, WORK), self.so)[1] if storage.is_local(self.out) \
            else None
        fd, tmp = tempfile.mkstemp(prefix=index.INDEX + ".", suffix=".tmp", dir=local_dir)
        os.close(fd)
        group, rows = index.ROW_GROUP, 0
        try:
            with pq.ParquetWriter(tmp, index.INDEX_SCHEMA.remove_metadata(), compression="zstd",
                                  write_statistics=True, store_schema=False) as w:
                pending: list = []
                held = 0
                for t in self._tables(n):
                    pending.append(t)
                    held, rows = held + len(t), rows + len(t)
                    if held >= group:
                        c = pa.concat_tables(pending)
                        k = len(c) // group * group
                        w.write_table(c.slice(0, k), row_group_size=group)
                        pending, held = [c.slice(k)], len(c) - k
                if held or not rows:
                    w.write_table(pa.concat_tables(pending) if pending else index.index_table([]),
                                  row_group_size=group)
            storage.commit_local_file(tmp, url, self.so)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return rows


def _engine(cfg: PackConfig):
    from shardtrain.pack.engine import LocalEngine, RayEngine

    if cfg.engine == "ray":
        return RayEngine(cfg.ray_address)
    local = storage.is_local(str(cfg.input)) and storage.is_local(str(cfg.output))
    # fork (see LocalEngine) only from a process with no other Python thread: a caller's thread could hold a lock
    # (logging, an import) that the forked workers would then wait on forever
    alone = threading.active_count() == 1
    return LocalEngine(cfg.workers, fork=local and alone and sys.platform.startswith("linux"))


def _fingerprint_in(url: str, so: dict | None) -> str | None:
    """The `fingerprint` recorded in a manifest or layout.json; "unreadable" when it is not a JSON object with one
    (a damaged or hostile file counts as a different dataset: refused unless --overwrite)."""
    from shardtrain.format.validate import DatasetError, parse_manifest

    try:
        found = parse_manifest(storage.read_bytes(url, so), url).get("fingerprint")
    except DatasetError:
        return "unreadable"
    return found if isinstance(found, str) else "unreadable"


def _existing_state(cfg: PackConfig, out: str, fp: str) -> str:
    """'complete' | 'resume' | 'fresh'; raises PackError for a different dataset unless cfg.overwrite."""
    so = cfg.storage_options
    names = set(storage.ls_names(out, so))
    found = None
    if index.MANIFEST in names:
        found = _fingerprint_in(storage.join(out, index.MANIFEST), so)
        if found == fp:
            return "complete"
    elif WORK in names:
        work = set(storage.ls_names(storage.join(out, WORK), so))
        for name in ("layout.json", "plan.json"):  # plan.json: a pack interrupted before the name changed
            if name in work:
                found = _fingerprint_in(storage.join(out, f"{WORK}/{name}"), so)
                break
        if found == fp:
            return "resume"
    ours = {n for n in names if n.startswith("shard-") or n in (index.MANIFEST, index.INDEX, REJECTS)}
    if WORK in names and storage.ls_names(storage.join(out, WORK), so):
        ours.add(WORK)  # an empty _work/ (crash before layout.json) holds nothing to protect
    if not ours:
        return "fresh"
    if not cfg.overwrite:
        what = "a different dataset (other input or options)" if found else "shardtrain files of an unknown run"
        raise PackError(f"OUTPUT {out} already holds {what}; choose another OUTPUT or pass --overwrite to replace it")
    log.warning("--overwrite: removing %d dataset files from %s", len(ours), out)
    for n in sorted(ours):
        storage.remove(storage.join(out, n), so, recursive=(n == WORK))
    return "fresh"


def pack(cfg: PackConfig) -> PackResult:
    """Run the whole pipeline (see module docstring). Raises PackError for --strict failures and refused OUTPUTs.

    The whole run holds OUTPUT's lock (storage.lock: `OUTPUT/_pack.lock`, exclusive locally and on S3), so a
    second pack into the same OUTPUT is refused with the holder's host, pid and start time instead of racing
    the first past the different-dataset guard and interleaving shards.
    """
    from shardtrain.pack.sources import resolve_format
    from shardtrain.storage.lock import LockHeld, acquire_lock

    # an input that is not there (or not a corpus) is refused before OUTPUT is created or the pool starts
    source_format = resolve_format(str(cfg.input), cfg.source_format, cfg.storage_options)
    out = str(cfg.output).rstrip("/")
    storage.makedirs(out, cfg.storage_options)
    try:
        lock = acquire_lock(out, cfg.storage_options)
    except LockHeld as e:
        raise PackError(str(e)) from None
    with lock:
        return _pack_locked(cfg, source_format)


def _pack_locked(cfg: PackConfig, source_format: str) -> PackResult:
    engine, progress = _engine(cfg), _Progress(cfg)
    try:
        return _pack(cfg, engine, progress, source_format)
    finally:
        progress.close()
        engine.close()


def _pack(cfg: PackConfig, engine, progress: _Progress, source_format: str) -> PackResult:
    """The pipeline (module docstring) for the input's resolved `source_format` (detected once, by `pack`)."""
    from shardtrain.pack.engine import WriteJob
    from shardtrain.pack.layout import iter_specs, lay_out
    from shardtrain.pack.parts import iter_parts

    t0 = time.perf_counter()
    out, so = str(cfg.output).rstrip("/"), cfg.storage_options
    target = cfg.audio
    parts = iter_parts(str(cfg.input), source_format, so, cfg.part_items, text_column=cfg.text_column,
                       split=cfg.split, audio_column=cfg.audio_column, delimiter=cfg.delimiter)
    if cfg.engine == "local" and cfg.workers > 1:
        engine.start_workers()  # their start (~0.8 s) overlaps the input listing
    scans = engine.scan(cfg, parts, progress.scanned)
    scan_s = time.perf_counter() - t0
    layout = lay_out(cfg, scans, engine.path_of)
    items = layout.items
    fp, rejects = layout.fingerprint, layout.rejects
    probe_s = time.perf_counter() - t0
    log.info("laid out %d samples in %d shards (%d rejected before encoding) in %.1fs",
             layout.samples, layout.shards, len(rejects.rows), probe_s)

    if not layout.samples:  # every utterance rejected before encoding: refuse, write nothing
        from shardtrain.pack.nothing import NothingAccepted, nothing_accepted_message
        raise NothingAccepted(nothing_accepted_message(str(cfg.input), cfg.source_format, rejects.rows, so))
    state = _existing_state(cfg, out, fp)
    if state == "complete":
        log.info("%s already holds this dataset (same fingerprint); nothing to write", out)
        return _result_from_manifest(out, so, t0, probe_s, items)
    storage.makedirs(storage.join(out, WORK), so)
    if state == "fresh":
        storage.atomic_write_bytes(storage.join(out, WORK + "/layout.json"),
                                   json.dumps({"fingerprint": fp, "shards": layout.shards}).encode(), so)

    rows = _IndexRows(out, so)
    done = {i: rows.add(m) for i, m in _load_markers(out, so, fp, layout.shards).items()}
    todo = layout.shards - len(done)
    log.info("%d shards to write (%d complete from an earlier run), engine=%s, workers=%d", todo, len(done),
             cfg.engine, cfg.workers)
    progress.laid_out(int(layout.shard_sizes()[[i for i in range(layout.shards) if i not in done]].sum()), todo)
    t1 = time.perf_counter()
    job = WriteJob(output=out, storage_options=so, target=target, fingerprint=fp, strict=cfg.strict)
    for marker in engine.write(job, iter_specs(layout, set(done)), todo):
        progress.written(marker)
        done[marker["shard"]] = rows.add(marker)
    write_s = time.perf_counter() - t1

    markers = [done[i] for i in range(layout.shards)]
    manifest, all_rejects = _commit(cfg, out, fp, markers, rows, rejects.rows)
    commit_s = time.perf_counter() - t1 - write_s
    return _result(out, manifest, all_rejects, markers, shards_written=todo, wall_s=time.perf_counter() - t0,
                   probe_s=probe_s, write_s=write_s, scan_s=scan_s, layout_s=probe_s - scan_s, commit_s=commit_s)


def _result(out: str, manifest: dict, all_rejects: list[dict], markers: list[dict], **timings) -> PackResult:
    """The PackResult of a committed pack: totals from the manifest, rejects counted by reason, clipped floats
    (warned about once, with the first file)."""
    clipped = [c for m in markers for c in m.get("clipped", ())]
    if clipped:
        log.warning("%d float files had samples past full scale, clipped (first: %s, %d samples)", len(clipped),
                    clipped[0]["path"], clipped[0]["samples"])
    by_reason: dict[str, int] = {}
    for r in all_rejects:
        by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
    t = manifest["totals"]
    return PackResult(output=out, samples=t["samples"], seconds=t["seconds"], shards=t["shards"], bytes=t["bytes"],
                      rejects=len(all_rejects), rejects_by_reason=dict(sorted(by_reason.items())),
                      items=t["samples"] + len(all_rejects), clipped=len(clipped), **timings)


def _commit(cfg: PackConfig, out: str, fp: str, markers: list[dict], rows: _IndexRows,
            early_rejects: list[dict]) -> tuple[dict, list[dict]]:
    """Write index.parquet, rejects.jsonl and manifest.json (last: the commit point), then drop `_work/`.
    Returns (manifest, every reject: those found while scanning, then those of each shard in shard order)."""
    so = cfg.storage_options
    all_rejects = early_rejects + [r for m in markers for r in m["rejects"]]
    n_rows = rows.write(len(markers))
    storage.atomic_write_bytes(storage.join(out, REJECTS),
                               b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in all_rejects), so)
    shards = [index.ShardInfo.from_dict(m["info"]) for m in markers]
    manifest: dict[str, Any] = {
        "format": index.FORMAT,
        "format_version": index.FORMAT_VERSION,
        "tool_version": __version__,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fingerprint": fp,
        "options": {"input": redact_url(str(cfg.input)), **cfg.dataset_options(), "decode_check": cfg.audio.verify_decode},
        "index": index.INDEX,
        "rejects": REJECTS,
        "totals": {"samples": n_rows, "seconds": sum(s.seconds for s in shards),
                   "bytes": sum(s.bytes for s in shards), "shards": len(shards), "rejects": len(all_rejects)},
        "shards": [s.to_dict() for s in shards],
    }
    if not n_rows:  # every utterance rejected while encoding: remove what was written, write no dataset
        from shardtrain.pack.nothing import NothingAccepted, nothing_accepted_message
        for n in storage.ls_names(out, so):
            if n.startswith("shard-") or n in (index.INDEX, REJECTS, WORK):
                storage.remove(storage.join(out, n), so, recursive=(n == WORK))
        raise NothingAccepted(nothing_accepted_message(str(cfg.input), cfg.source_format, all_rejects, so))
    index.write_manifest(out, manifest, so)  # commit point
    storage.remove(storage.join(out, WORK), so, recursive=True)
    return manifest, all_rejects


def _load_markers(out: str, so: dict | None, fp: str, n: int) -> dict[int, dict]:
    """Done-markers of shards finished by an earlier run whose shard file is present with the recorded size."""
    work = storage.join(out, WORK)
    marker_names, shard_names = set(storage.ls_names(work, so)), set(storage.ls_names(out, so))
    done = {}
    for i in range(n):
        m = marker_name(i)
        if m not in marker_names or index.shard_name(i) not in shard_names:
            continue
        try:
            marker = json.loads(storage.read_bytes(storage.join(work, m), so))
        except (OSError, ValueError):
            continue
        if marker.get("fingerprint") == fp and storage.size(storage.join(out, index.shard_name(i)), so) == \
                marker["info"]["bytes"]:
            done[i] = marker
    return done


def _result_from_manifest(out: str, so: dict | None, t0: float, probe_s: float, items: int) -> PackResult:
    m = index.open_dataset(out, so).manifest
    by_reason: dict[str, int] = {}
    try:
        for line in storage.read_bytes(storage.join(out, REJECTS), so).splitlines():
            r = json.loads(line)["reason"]
            by_reason[r] = by_reason.get(r, 0) + 1
    except FileNotFoundError:
        pass
    t = m["totals"]
    return PackResult(output=out, samples=t["samples"], seconds=t["seconds"], shards=t["shards"], bytes=t["bytes"],
                      rejects=sum(by_reason.values()), rejects_by_reason=dict(sorted(by_reason.items())),
                      shards_written=0, wall_s=time.perf_counter() - t0, probe_s=probe_s, items=items,
                      already_complete=True)


__all__ = ["PackConfig", "PackResult", "PackError", "pack"]
