"""Shard format v1 on the byte level: a reproducible ustar writer and a plain tar sample reader.

    write: [(key, ext, audio bytes, json bytes)] -> ShardWriter -> shard-NNNNNN.tar + [MemberOffsets]
    read:  tar bytes / file object -> iter_tar_samples -> {"__key__": key, "<ext>": bytes, "json": bytes}

Byte-reproducible by construction: every header has mtime 0, uid/gid 0, empty uname/gname, mode 0o644, and the
plain ustar format (names are <= 80 + 5 chars, so no PAX or GNU long-name records are ever needed); the archive
ends with tarfile's standard two zero blocks padded to a 10240-byte record. The writer reports where each member's
header and data lie, which is what index.parquet stores so a reader can slice audio out of a byte range without
parsing tar. Nothing read from a shard is unpickled or evaluated.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import tarfile
import tempfile
from dataclasses import dataclass
from typing import BinaryIO, Iterator

BLOCK = 512
KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,80}$")
AUDIO_EXTS = ("flac", "wav", "opus", "mp3")


@dataclass(frozen=True, slots=True)
class MemberOffsets:
    """Where one sample lies inside its shard (all byte offsets from the start of the tar)."""

    offset: int
    """First byte of the audio member's header."""
    size: int
    """Bytes from `offset` to the end of the json member's padding (= next sample's offset)."""
    audio_offset: int
    audio_size: int
    json_offset: int
    json_size: int


class _HashingWriter:
    """File-like wrapper that counts and sha256-hashes what passes through (tarfile only calls write/tell)."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.pos = 0
        self.sha = hashlib.sha256()

    def write(self, b) -> int:
        self.raw.write(b)
        self.sha.update(b)
        self.pos += len(b)
        return len(b)

    def tell(self) -> int:
        return self.pos


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = 0
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.type = tarfile.REGTYPE
    return ti


class ShardWriter:
    """Write samples (audio member, then json member) to a binary file object as reproducible ustar.

    Use as a context manager; `close()` writes the end-of-archive blocks. `sha256` and `bytes` are valid after
    close. The caller decides sample order (the packer sorts by (duration_s, key)).
    """

    def __init__(self, fileobj: BinaryIO) -> None:
        self._out = _HashingWriter(fileobj)
        self._tar = tarfile.TarFile(fileobj=self._out, mode="w", format=tarfile.USTAR_FORMAT, encoding="utf-8")
        self._keys: set[str] = set()
        self.closed = False

    def add(self, key: str, ext: str, audio: bytes, meta_json: bytes) -> MemberOffsets:
        if not KEY_RE.match(key):
            raise ValueError(f"shard key {key!r} must match [A-Za-z0-9_-]{{1,80}}")
        if ext not in AUDIO_EXTS:
            raise ValueError(f"audio extension {ext!r} not in {AUDIO_EXTS}")
        if key in self._keys:
            raise ValueError(f"duplicate key {key!r} in one shard")
        self._keys.add(key)
        offset = self._tar.offset
        self._tar.addfile(_tarinfo(f"{key}.{ext}", len(audio)), io.BytesIO(audio))
        json_header = self._tar.offset
        self._tar.addfile(_tarinfo(f"{key}.json", len(meta_json)), io.BytesIO(meta_json))
        return MemberOffsets(
            offset=offset,
            size=self._tar.offset - offset,
            audio_offset=offset + BLOCK,
            audio_size=len(audio),
            json_offset=json_header + BLOCK,
            json_size=len(meta_json),
        )

    def close(self) -> None:
        if not self.closed:
            self._tar.close()
            self.closed = True

    @property
    def sha256(self) -> str:
        return self._out.sha.hexdigest()

    @property
    def bytes(self) -> int:
        return self._out.pos

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parse_header(block: bytes) -> tuple[str, int]:
    """(name, size) of one 512-byte ustar header; raises ValueError when it is not a valid header."""
    ti = tarfile.TarInfo.frombuf(block, "utf-8", "strict")
    return ti.name, ti.size


def iter_tar_members(fileobj: BinaryIO) -> Iterator[tuple[str, int, bytes]]:
    """(name, data_offset, data) for each regular member, in file order. Raises tarfile.TarError on damage."""
    with tarfile.open(fileobj=fileobj, mode="r|") as tf:
        for ti in tf:
            if not ti.isreg():
                continue
            f = tf.extractfile(ti)
            data = f.read() if f is not None else b""
            if len(data) != ti.size:
                raise tarfile.ReadError(f"member {ti.name} truncated: {len(data)} of {ti.size} bytes")
            yield ti.name, ti.offset_data, data


def iter_tar_samples(fileobj: BinaryIO) -> Iterator[dict]:
    """Group adjacent members by key (text before the first dot), webdataset-style:
    `{"__key__": key, "flac": b"...", "json": b"..."}`. A sample is emitted when the key changes."""
    current: dict | None = None
    for name, _, data in iter_tar_members(fileobj):
        base = name.rsplit("/", 1)[-1]
        key, _, ext = base.partition(".")
        prefix = name[: len(name) - len(base)]
        key = prefix + key
        if current is not None and current["__key__"] != key:
            yield current
            current = None
        if current is None:
            current = {"__key__": key}
        current[ext] = data
    if current is not None:
        yield current


# ---- keys ---------------------------------------------------------------------------------------------------
def _sha8(s: str, n: int = 8) -> str:
    return hashlib.sha1(s.encode("utf-8", "surrogatepass")).hexdigest()[:n]


def sanitize_key(source_id: str) -> str:
    """Map a source id to `[A-Za-z0-9_-]{1,80}`: every other character becomes `_`; ids longer than 80 characters
    keep their first 71 and get `-` + sha1[:8] of the full id, so distinct long ids stay distinct."""
    k = re.sub(r"[^A-Za-z0-9_-]", "_", source_id)
    if not k:
        return "id-" + _sha8(source_id)
    if len(k) > 80:
        return k[:71] + "-" + _sha8(source_id)
    return k


def assign_keys(ids: list[str]) -> dict[str, str]:
    """Collision-free keys for distinct ids, stable for a given set of ids (independent of their order).

    Ids that sanitise to the same key all get `-` + sha1(id)[:8] appended, except an id that already *is* that
    key (it keeps it). A second-level clash (a suffixed key equal to another key) retries with 16 hex digits.
    """
    groups: dict[str, list[str]] = {}
    for i in ids:
        groups.setdefault(sanitize_key(i), []).append(i)
    out: dict[str, str] = {}
    for k, members in groups.items():
        if len(members) == 1:
            out[members[0]] = k
            continue
        for i in members:
            out[i] = k if i == k else k[:71] + "-" + _sha8(i)
    taken: dict[str, str] = {}
    for i in sorted(out):
        k = out[i]
        if k in taken:
            k = sanitize_key(i)[:63] + "-" + _sha8(i, 16)
            if k in taken:
                raise ValueError(f"cannot find a collision-free key for ids {taken.get(k)!r} and {i!r}")
            out[i] = k
        taken[k] = i
    return out


# ---- one shard = one task (run in a worker process, or by a cluster engine) ------------------------------------
class PackError(RuntimeError):
    """Packing stopped: a bad item under --strict, or an OUTPUT holding another dataset."""


ENCODE_RATIO = {"wav": 1.0, "flac": 0.6, "opus": 0.08, "mp3": 0.1}
"""Stored bytes / 16-bit PCM bytes, for planning only (real FLAC speech is ~0.5-0.65)."""

TEST_KILL_ENV = "SHARDTRAIN_TEST_KILL_AT_SHARD"
"""Test hook: the process that starts writing this shard number SIGKILLs itself (simulates a crash)."""


def error_reason(e: BaseException, default: str) -> tuple[str, str]:
    """(reason code, detail) of a failure: AudioError carries the code in `.reason` and "code: detail" as its
    message; FileNotFoundError is missing_file; anything else is `default` with the exception as detail."""
    if isinstance(e, FileNotFoundError):
        return "missing_file", str(e)
    reason = getattr(e, "reason", None)
    if reason:
        code, _, detail = str(reason).partition(": ")
        msg = str(e)
        return code, detail or (msg[len(code) + 2:] if msg.startswith(code + ": ") else msg)
    return default, f"{type(e).__name__}: {e}"


def _extra_pairs(extra) -> list[tuple[str, object]]:
    if not extra:
        return []
    pairs = extra.items() if isinstance(extra, dict) else extra
    return sorted((str(k), v) for k, v in pairs)


@dataclass(frozen=True, slots=True)
class PlannedSample:
    """One accepted item with its probe result, in the global plan."""

    key: str
    item: object
    """sources.Item"""
    info: object
    """audio.AudioInfo of the source file (headers)."""
    duration_s: float
    """Duration of the utterance (the segment, for a cut), the sort key."""
    est_bytes: int

    def identity(self) -> dict:
        """Everything that shapes this sample's bytes; hashed into the dataset fingerprint."""
        it, inf = self.item, self.info
        return {
            "key": self.key, "id": it.id, "audio": str(it.audio), "text": it.text, "start_s": it.start_s,
            "item_duration_s": it.duration_s, "speaker": it.speaker, "language": it.language,
            "extra": _extra_pairs(it.extra), "duration_s": self.duration_s, "est_bytes": self.est_bytes,
            "info": [inf.sample_rate_hz, inf.num_samples, inf.channels, inf.codec],
        }


@dataclass(frozen=True, slots=True)
class ShardTask:
    shard: int
    output: str
    storage_options: dict | None
    samples: list
    """[PlannedSample] in plan order."""
    target: object
    """audio.AudioTarget"""
    fingerprint: str
    strict: bool = False


def marker_name(i: int) -> str:
    return f"shard-{i:06d}.json"


def sample_json(s: PlannedSample, stored) -> bytes:
    """`<key>.json`: UTF-8, sorted keys, compact. Extra input fields never override the reserved ones."""
    it = s.item
    meta: dict = {
        "id": it.id, "text": it.text, "duration_s": stored.duration_s, "sample_rate_hz": stored.sample_rate_hz,
        "num_samples": stored.num_samples, "channels": stored.channels, "codec": stored.codec,
        "source": str(it.audio),
    }
    if it.speaker is not None:
        meta["speaker"] = it.speaker
    if it.language is not None:
        meta["language"] = it.language
    if it.start_s or it.duration_s is not None:
        meta["start_s"] = float(it.start_s or 0.0)
    for k, v in _extra_pairs(it.extra):
        meta.setdefault(k, v)
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def write_shard(task: ShardTask) -> dict:
    """Encode, tar, hash and atomically publish one shard, then its done-marker. Returns the marker:
    `{"fingerprint", "shard", "info": ShardInfo dict, "rows": [index rows], "rejects": [reject rows]}`.

    A sample whose audio fails to encode is left out and recorded (deterministically: same input, same result);
    under `strict` it raises PackError instead. Samples are written in (stored duration_s, key) order.
    Memory: one encoded sample at a time plus the encoded shard's audio (~target_shard_mb); the tar streams
    to a temp file in `_work/` (locally) or the system temp folder (remote OUTPUT, then uploaded whole).
    """
    from shardtrain import storage
    from shardtrain.audio import encode_for_shard

    if os.environ.get(TEST_KILL_ENV) == str(task.shard):
        os.kill(os.getpid(), signal.SIGKILL)
    encoded, rejects = [], []
    for s in task.samples:
        try:
            data, stored = encode_for_shard(s.item, s.info, task.target, task.storage_options)
            if stored.codec not in AUDIO_EXTS:
                raise ValueError(f"stored codec {stored.codec!r} is not one of {AUDIO_EXTS}")
            if stored.num_samples <= 0 or not data:
                raise ValueError("encoded audio is empty")
        except Exception as e:  # noqa: BLE001 - any failure of one sample rejects that sample only
            reason, detail = error_reason(e, "encode_failed")
            if task.strict:
                raise PackError(f"--strict: cannot encode {s.item.id!r} ({s.item.audio}): {reason}: {detail}. "
                                "Fix the input, or drop --strict to skip it and record it in rejects.jsonl") from e
            rejects.append({"id": s.item.id, "key": s.key, "path": str(s.item.audio), "reason": reason,
                            "detail": detail})
            continue
        encoded.append((stored.duration_s, s.key, s, stored, data))
    encoded.sort(key=lambda e: (e[0], e[1]))

    name = f"shard-{task.shard:06d}.tar"
    url = storage.join(task.output, name)
    if storage.is_local(task.output):
        _, work_dir = storage.fs_and_path(storage.join(task.output, "_work"), task.storage_options)
        os.makedirs(work_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=work_dir)
    else:
        fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp")
    rows = []
    try:
        with os.fdopen(fd, "wb") as f:
            w = ShardWriter(f)
            for duration_s, key, s, stored, data in encoded:
                o = w.add(key, stored.codec, data, sample_json(s, stored))
                rows.append({
                    "key": key, "shard": task.shard, "offset": o.offset, "size": o.size,
                    "audio_offset": o.audio_offset, "audio_size": o.audio_size, "json_offset": o.json_offset,
                    "json_size": o.json_size, "codec": stored.codec, "duration_s": duration_s,
                    "num_samples": stored.num_samples, "sample_rate_hz": stored.sample_rate_hz,
                    "channels": stored.channels, "text": s.item.text, "speaker": s.item.speaker,
                    "language": s.item.language, "source": str(s.item.audio),
                })
            w.close()
            f.flush()
            os.fsync(f.fileno())
        storage.commit_local_file(tmp, url, task.storage_options)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    durations = [e[0] for e in encoded]
    marker = {
        "fingerprint": task.fingerprint,
        "shard": task.shard,
        "info": {"name": name, "samples": len(rows), "seconds": sum(durations),
                 "min_duration_s": min(durations, default=0.0), "max_duration_s": max(durations, default=0.0),
                 "bytes": w.bytes, "sha256": w.sha256},
        "rows": rows,
        "rejects": rejects,
    }
    storage.atomic_write_bytes(storage.join(task.output, "_work/" + marker_name(task.shard)),
                               json.dumps(marker, sort_keys=True).encode(), task.storage_options)
    return marker
