"""Pack a speech corpus into duration-sorted shards (format v1) plus index.parquet and manifest.json.

    INPUT -> sources.iter_items -> Item | Reject                                   (input order)
          -> filters: duplicate id, empty transcript                              -> rejects
          -> keys: sanitise ids to [A-Za-z0-9_-]{1,80}, collision-free            (stable: depends on ids only)
          -> audio.probe in a thread pool (headers only)      -> AudioInfo | AudioError -> rejects
          -> filters: zero length, --min/--max-duration                           -> rejects
          -> sort by (duration_s, key) -> cut shards by estimated bytes / samples  = the plan (+ fingerprint)
          -> process pool, one task per shard: encode_for_shard, json, ustar, sha256, atomic write, done-marker
          -> index.parquet -> rejects.jsonl -> manifest.json (LAST: the commit point)

Resumable: each finished shard leaves `_work/shard-NNNNNN.json` (its index rows, sha256, rejects). Re-running the
same command re-probes (cheap: headers), rebuilds the same plan, and writes only shards without a valid marker.
An OUTPUT holding a dataset with a different fingerprint (options + plan) is refused unless `overwrite`.

Deterministic: the plan depends only on the input and options, each shard only on its plan entry, so the same
input and options give byte-identical shards, index and manifest (except `created_utc`), for any `workers`.

Threads for probing (soundfile.info releases the GIL and is I/O-bound; no pickling of results); processes for
encoding (FLAC/Opus encoders and resamplers are CPU-bound). The per-shard task is a plain function of a
picklable `ShardTask`, so a cluster engine can run the same tasks later.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
import time
from typing import Any
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from tqdm import tqdm

from shardtrain import storage
from shardtrain._version import __version__
from shardtrain.format import manifest as index
from shardtrain.format.codecs import CODECS, ENCODE_RATIO
from shardtrain.pack.shard_task import PackError, PlannedSample, ShardTask, error_reason, marker_name, write_shard
from shardtrain.pack.keys import assign_keys
from shardtrain.pack.lifeline import die_with_parent
from shardtrain.storage.redact import redact_url

log = logging.getLogger(__name__)

WORK = "_work"
REJECTS = "rejects.jsonl"
_SAMPLE_OVERHEAD_BYTES = 2048  # two ustar headers + json + padding, for the size estimate only


@dataclass(frozen=True, kw_only=True, slots=True)
class PackConfig:
    input: str
    """Corpus: folder, TSV/CSV/JSONL manifest, LibriSpeech folder or Lhotse CutSet (any fsspec URL)."""
    output: str
    """Dataset folder or prefix (local path, file://, s3://bucket/prefix)."""
    source_format: str = "auto"
    """Input format (`--source-format`): auto, or one of sources.SOURCE_FORMATS."""
    text_column: str | None = None
    """Transcript column of a Hugging Face dataset input (`--text-column`); None tries text, sentence, ..."""
    storage_options: dict | None = field(default=None, repr=False)
    """fsspec options for INPUT and OUTPUT (`--storage-option k=v`), e.g. endpoint_url for S3."""
    codec: str = "flac"
    """Stored audio codec (`--codec`): flac, wav, opus or mp3."""
    sample_rate_hz: int = 16000
    """Stored sample rate (`--sample-rate`)."""
    channels: int = 1
    """Stored channel count (`--channels`)."""
    keep_original: bool = False
    """Store the input bytes unchanged, whatever their codec/rate/channels (`--keep-original`)."""
    decode_check: bool = True
    """Fully decode audio that is kept byte for byte, so a truncated file is rejected at pack time instead of
    failing in the training loader (`--no-decode-check` skips it: ~2 ms per 10 s of FLAC, most of a kept-FLAC
    pack's CPU time). Transcoded audio is always decoded anyway."""
    target_shard_mb: float = 256.0
    """Target shard size in MiB, estimated from headers before encoding (`--target-shard-mb`)."""
    max_samples_per_shard: int | None = None
    """Also cut a shard after this many samples (`--max-samples-per-shard`)."""
    min_duration_s: float | None = None
    """Reject utterances shorter than this (`--min-duration`)."""
    max_duration_s: float | None = None
    """Reject utterances longer than this (`--max-duration`)."""
    workers: int = 1
    """Processes writing shards (`--workers`); 1 writes in this process. Output does not depend on it."""
    probe_threads: int = 8
    """Threads reading audio headers (I/O-bound; more helps on S3)."""
    strict: bool = False
    """Fail at the first bad item instead of rejecting it (`--strict`)."""
    overwrite: bool = False
    """Replace a different dataset already at OUTPUT (`--overwrite`)."""
    progress: bool = True
    """tqdm progress bars on stderr (`--no-progress` to disable; off anyway when stderr is not a TTY)."""

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"--codec must be one of {CODECS}, got {self.codec!r}")
        if self.sample_rate_hz <= 0:
            raise ValueError(f"--sample-rate must be > 0, got {self.sample_rate_hz}")
        if self.channels < 1:
            raise ValueError(f"--channels must be >= 1, got {self.channels}")
        if not self.target_shard_mb > 0:
            raise ValueError(f"--target-shard-mb must be > 0, got {self.target_shard_mb}")
        if self.max_samples_per_shard is not None and self.max_samples_per_shard < 1:
            raise ValueError(f"--max-samples-per-shard must be >= 1, got {self.max_samples_per_shard}")
        if self.min_duration_s is not None and self.max_duration_s is not None:
            if self.min_duration_s > self.max_duration_s:
                raise ValueError("--min-duration must be <= --max-duration")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.probe_threads < 1:
            raise ValueError(f"probe_threads must be >= 1, got {self.probe_threads}")

    def dataset_options(self) -> dict:
        """Options that shape the output (recorded in the manifest, part of the fingerprint)."""
        return {
            "codec": self.codec,
            "sample_rate_hz": self.sample_rate_hz,
            "channels": self.channels,
            "keep_original": self.keep_original,
            "target_shard_mb": self.target_shard_mb,
            "max_samples_per_shard": self.max_samples_per_shard,
            "min_duration_s": self.min_duration_s,
            "max_duration_s": self.max_duration_s,
            "source_format": self.source_format,
            **({"text_column": self.text_column} if self.text_column else {}),
        }


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
    write_s: float = 0.0
    items: int = 0
    """Items read from INPUT (samples + rejects)."""
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


@dataclass(slots=True)
class _Rejects:
    strict: bool
    rows: list[dict] = field(default_factory=list)

    def add(self, *, id: str, path: str, reason: str, key: str | None = None, detail: str = "") -> None:
        row = {"id": id, "key": key, "path": path, "reason": reason}
        if detail:
            row["detail"] = detail
        if self.strict:
            raise PackError(
                f"--strict: bad input item {id!r} ({path}): {reason}{': ' + detail if detail else ''}. "
                "Fix the input, or drop --strict to skip it and record it in rejects.jsonl"
            )
        log.debug("reject %s (%s): %s %s", id, path, reason, detail)
        self.rows.append(row)


def _bar(cfg: PackConfig, **kw) -> tqdm:
    return tqdm(disable=not (cfg.progress and sys.stderr.isatty()), dynamic_ncols=True, **kw)


def _collect(cfg: PackConfig, rejects: _Rejects) -> list:
    from shardtrain.pack.sources import Item, iter_items

    items, seen = [], set()
    for x in iter_items(str(cfg.input), cfg.source_format, cfg.storage_options, text_column=cfg.text_column):
        if not isinstance(x, Item):
            code, _, detail = str(x.reason).partition(": ")
            rejects.add(id=str(x.id), path=str(x.path), reason=code, detail=detail)
        elif not (x.text or "").strip():
            rejects.add(id=str(x.id), path=str(x.audio), reason="empty_transcript")
        elif x.id in seen:
            rejects.add(id=str(x.id), path=str(x.audio), reason="duplicate_id",
                        detail="an earlier item has the same id; the first one is kept")
        else:
            seen.add(x.id)
            items.append(x)
    return items


def _kept(cfg: PackConfig, info) -> bool:
    """Whether the file's bytes will likely be stored unchanged (then its size is the best size estimate)."""
    return cfg.keep_original or (info.codec, info.sample_rate_hz, info.channels) == (
        cfg.codec, cfg.sample_rate_hz, cfg.channels)


def _probe_one(cfg: PackConfig, item):
    """(AudioInfo, file size or 0) or (exception, None); never raises, so one bad file costs one reject.
    The size costs one extra stat (a HEAD on S3), so it is fetched only for files that will be kept."""
    from shardtrain.pack.probe import probe

    try:
        info = probe(str(item.audio), cfg.storage_options)
    except Exception as e:  # noqa: BLE001 - AudioError, soundfile/OS errors: all reject this item
        return e, None
    nbytes = 0
    if _kept(cfg, info):
        try:
            nbytes = storage.size(str(item.audio), cfg.storage_options)
        except Exception:  # noqa: BLE001 - only used for the size estimate
            pass
    return info, nbytes


def _probed(cfg: PackConfig, items: list, chunk: int = 4096):
    """(item, probe result) in input order; at most `chunk` probes in flight, so memory stays flat."""
    with ThreadPoolExecutor(cfg.probe_threads) as ex:
        for i in range(0, len(items), chunk):
            part = items[i: i + chunk]
            yield from zip(part, ex.map(lambda it: _probe_one(cfg, it), part))


def _probe_and_filter(cfg: PackConfig, items: list, keys: dict, rejects: _Rejects) -> list[PlannedSample]:
    from shardtrain.pack.probe import SEGMENT_TOLERANCE_S

    planned: list[PlannedSample] = []
    with _bar(cfg, total=len(items), desc="probe", unit="file") as bar:
        for item, (info, nbytes) in _probed(cfg, items):
            bar.update(1)
            key, path = keys[item.id], str(item.audio)
            if isinstance(info, BaseException):
                reason, detail = error_reason(info, "unreadable_audio")
                rejects.add(id=item.id, path=path, key=key, reason=reason, detail=detail)
                continue
            start_s = float(item.start_s or 0.0)
            duration_s = float(item.duration_s) if item.duration_s is not None else info.duration_s - start_s
            if info.num_samples <= 0 or duration_s <= 0:
                rejects.add(id=item.id, path=path, key=key, reason="empty_audio", detail="0 samples")
                continue
            if start_s + duration_s > info.duration_s + SEGMENT_TOLERANCE_S:
                rejects.add(id=item.id, path=path, key=key, reason="segment_out_of_range",
                            detail=f"{start_s}+{duration_s}s > {info.duration_s}s")
                continue
            if cfg.min_duration_s is not None and duration_s < cfg.min_duration_s:
                rejects.add(id=item.id, path=path, key=key, reason="too_short")
                continue
            if cfg.max_duration_s is not None and duration_s > cfg.max_duration_s:
                rejects.add(id=item.id, path=path, key=key, reason="too_long")
                continue
            planned.append(PlannedSample(key=key, item=item, info=info, duration_s=duration_s,
                                         est_bytes=_estimate_bytes(cfg, info, duration_s, nbytes)))
    return planned


def _estimate_bytes(cfg: PackConfig, info, duration_s: float, file_bytes: int) -> int:
    """Stored size guess from headers: original bytes (pro rata for a segment) when kept, else PCM x ratio."""
    if _kept(cfg, info) and file_bytes and info.duration_s > 0:
        est = file_bytes * min(1.0, duration_s / info.duration_s)
    else:
        est = duration_s * cfg.sample_rate_hz * cfg.channels * 2 * ENCODE_RATIO[cfg.codec]
    return int(est) + _SAMPLE_OVERHEAD_BYTES


def plan_shards(samples: list[PlannedSample], target_bytes: int, max_samples: int | None) -> list[list[PlannedSample]]:
    """Sort by (duration_s, key) and cut consecutive runs of about `target_bytes` (estimated) or `max_samples`."""
    samples = sorted(samples, key=lambda s: (s.duration_s, s.key))
    shards: list[list[PlannedSample]] = []
    cur: list[PlannedSample] = []
    cur_bytes = 0
    for s in samples:
        if cur and (cur_bytes + s.est_bytes > target_bytes or (max_samples is not None and len(cur) >= max_samples)):
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(s)
        cur_bytes += s.est_bytes
    if cur:
        shards.append(cur)
    return shards


def fingerprint(cfg: PackConfig, plan: list[list[PlannedSample]]) -> str:
    """sha256 over the output-shaping options and every planned sample (key, source, segment, text, metadata)."""
    import hashlib

    h = hashlib.sha256()
    h.update(json.dumps({"format_version": index.FORMAT_VERSION, **cfg.dataset_options()}, sort_keys=True).encode())
    for i, shard in enumerate(plan):
        h.update(f"\nshard {i}\n".encode())
        for s in shard:
            h.update(json.dumps(s.identity(), sort_keys=True, default=str).encode() + b"\n")
    return h.hexdigest()


def _fingerprint_in(url: str, so: dict | None) -> str | None:
    """The `fingerprint` recorded in a manifest or plan.json; "unreadable" when it is not a JSON object with one
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
    elif WORK in names and "plan.json" in storage.ls_names(storage.join(out, WORK), so):
        found = _fingerprint_in(storage.join(out, WORK + "/plan.json"), so)
        if found == fp:
            return "resume"
    ours = {n for n in names if n.startswith("shard-") or n in (index.MANIFEST, index.INDEX, REJECTS)}
    if WORK in names and storage.ls_names(storage.join(out, WORK), so):
        ours.add(WORK)  # an empty _work/ (crash before plan.json) holds nothing to protect
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
    from shardtrain.storage.lock import LockHeld, acquire_lock

    out = str(cfg.output).rstrip("/")
    storage.makedirs(out, cfg.storage_options)
    try:
        lock = acquire_lock(out, cfg.storage_options)
    except LockHeld as e:
        raise PackError(str(e)) from None
    with lock:
        return _pack_locked(cfg)


def _pack_locked(cfg: PackConfig) -> PackResult:
    from shardtrain.pack.transcode import AudioTarget

    t0 = time.perf_counter()
    out, so = str(cfg.output).rstrip("/"), cfg.storage_options
    target = AudioTarget(codec=cfg.codec, sample_rate_hz=cfg.sample_rate_hz, channels=cfg.channels,
                         keep_original=cfg.keep_original, verify_decode=cfg.decode_check)
    rejects = _Rejects(strict=cfg.strict)
    items = _collect(cfg, rejects)
    keys = assign_keys([it.id for it in items])
    planned = _probe_and_filter(cfg, items, keys, rejects)
    plan = plan_shards(planned, int(cfg.target_shard_mb * (1 << 20)), cfg.max_samples_per_shard)
    fp = fingerprint(cfg, plan)
    probe_s = time.perf_counter() - t0
    log.info("planned %d samples in %d shards (%d rejected before encoding) in %.1fs",
             len(planned), len(plan), len(rejects.rows), probe_s)

    state = _existing_state(cfg, out, fp)
    if state == "complete":
        log.info("%s already holds this dataset (same fingerprint); nothing to write", out)
        return _result_from_manifest(out, so, t0, probe_s, len(planned) + len(rejects.rows))
    storage.makedirs(storage.join(out, WORK), so)
    if state == "fresh":
        storage.atomic_write_bytes(storage.join(out, WORK + "/plan.json"),
                                   json.dumps({"fingerprint": fp, "shards": len(plan)}).encode(), so)

    done = _load_markers(out, so, fp, len(plan))
    tasks = [ShardTask(shard=i, output=out, storage_options=so, samples=shard, target=target,
                       fingerprint=fp, strict=cfg.strict)
             for i, shard in enumerate(plan) if i not in done]
    log.info("%d shards to write (%d complete from an earlier run), workers=%d", len(tasks), len(done), cfg.workers)
    t1 = time.perf_counter()
    done.update(_run_tasks(cfg, tasks))
    write_s = time.perf_counter() - t1

    markers = [done[i] for i in range(len(plan))]
    rows = [r for m in markers for r in m["rows"]]
    all_rejects = rejects.rows + [r for m in markers for r in m["rejects"]]
    index.write_index(out, index.index_table(rows), so)
    storage.atomic_write_bytes(storage.join(out, REJECTS),
                               b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in all_rejects), so)
    shards = [index.ShardInfo.from_dict(m["info"]) for m in markers]
    manifest: dict[str, Any] = {
        "format": index.FORMAT,
        "format_version": index.FORMAT_VERSION,
        "tool_version": __version__,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fingerprint": fp,
        "options": {"input": redact_url(str(cfg.input)), **cfg.dataset_options(), "decode_check": cfg.decode_check},
        "index": index.INDEX,
        "rejects": REJECTS,
        "totals": {"samples": len(rows), "seconds": sum(s.seconds for s in shards),
                   "bytes": sum(s.bytes for s in shards), "shards": len(shards), "rejects": len(all_rejects)},
        "shards": [s.to_dict() for s in shards],
    }
    if not rows:
        log.warning("no sample was accepted from %s (%d rejects); see %s", cfg.input, len(all_rejects),
                    storage.join(out, REJECTS))
    index.write_manifest(out, manifest, so)  # commit point
    storage.remove(storage.join(out, WORK), so, recursive=True)
    by_reason: dict[str, int] = {}
    for r in all_rejects:
        by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
    t = manifest["totals"]
    return PackResult(output=out, samples=t["samples"], seconds=t["seconds"], shards=t["shards"], bytes=t["bytes"],
                      rejects=len(all_rejects), rejects_by_reason=dict(sorted(by_reason.items())),
                      shards_written=len(tasks), wall_s=time.perf_counter() - t0, probe_s=probe_s, write_s=write_s,
                      items=t["samples"] + len(all_rejects))


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


def _run_tasks(cfg: PackConfig, tasks: list[ShardTask]) -> dict[int, dict]:
    results: dict[int, dict] = {}
    total = sum(len(t.samples) for t in tasks)
    with _bar(cfg, total=total, desc="write", unit="utt") as bar:
        if cfg.workers == 1 or len(tasks) <= 1:
            for t in tasks:
                results[t.shard] = write_shard(t)
                bar.update(len(t.samples))
            return results
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["shardtrain.pack.shard_task", "shardtrain.pack.transcode",
                                    "shardtrain.pack.lifeline"])
        try:
            with ProcessPoolExecutor(max_workers=min(cfg.workers, len(tasks)), mp_context=ctx,
                                     initializer=die_with_parent, initargs=(os.getpid(),)) as ex:
                # Bounded submission: at most 2 tasks per worker in flight, so a huge plan is not pickled up front.
                pending, it = {}, iter(tasks)
                for t in it:
                    pending[ex.submit(write_shard, t)] = t
                    if len(pending) >= 2 * cfg.workers:
                        break
                while pending:
                    finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for f in finished:
                        t = pending.pop(f)
                        results[t.shard] = f.result()  # re-raises worker errors (PackError, ...)
                        bar.update(len(t.samples))
                        nxt = next(it, None)
                        if nxt is not None:  # submitting to a pool broken meanwhile raises here, not in result()
                            pending[ex.submit(write_shard, nxt)] = nxt
        except BrokenProcessPool as e:
            raise PackError(
                f"a worker process died (killed, or out of memory) while writing shards; {len(results)} "
                "finished in this run are kept: re-run the same command to write only the rest") from e
    return results


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


__all__ = ["PackConfig", "PackResult", "PackError", "pack", "plan_shards", "fingerprint"]
