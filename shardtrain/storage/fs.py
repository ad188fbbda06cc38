"""Every location is an fsspec URL: a local path, `file://...`, or `s3://bucket/prefix`.

This module is the only place that knows how to talk to a filesystem, so pack, index and stream share one set of
choices:

- s3fs defaults (5 MB blocks, `bytes` cache) are slow for large sequential reads; `fs_and_path` sets 8 MB blocks
  and a read-ahead cache unless the caller's storage options say otherwise. Against SeaweedFS on loopback a
  64 MB object then streams in ~0.1 s instead of ~0.35 s (stack.md).
- `region_name` is never injected (bucket creation fails on some S3 servers); set `AWS_DEFAULT_REGION`.
- Writes are atomic: a temp name + `os.replace` locally, one whole-object PUT (or s3fs's multipart upload for a
  file) on S3, where an object only becomes visible once complete.
- `read_range` reads in pieces and on a transient error backs off exponentially (jittered) and resumes at the
  byte reached, so a dropped connection in the middle of a 256 MB shard costs one piece, not the whole shard, and
  an outage shorter than the retry budget (default 120 s without progress) costs time only. Errors are sorted by
  `is_transient`: connection refused/reset, timeouts, HTTP 5xx/408/429 are retried; a missing object, refused
  credentials, other 4xx and programming errors are raised at once; a spent budget raises `StorageUnavailable`.
- Time: one budget per read, of time without progress (storage.clock), covers waiting and retrying alike and is
  enforced while a request waits (connect, answer, body) on the direct path: a silent or trickling server is cut
  at the budget with one line naming the URL and the cause. On the s3fs path the budget bounds each call.
  Until an S3 endpoint has answered once in the process, the first s3fs filesystem for it and every failed read
  probe it (s3http.endpoint_problem): an unresolvable host or https against plain HTTP is named at once, a refused
  connection after ~2 s (FIRST_CONTACT_S), in one line, from every command (pack's lock, inspect, train).
- Credentials: missing or refused ones raise `CredentialsError` at once (never retried), naming what to set.
  Neither path follows an HTTP redirect, so no signed request reaches another host (storage.noredirect).
- `iter_range(..., direct_http=True)` (the loader's hot path), `read_bytes` and `open_ranged` with the same flag
  read S3 objects through presigned URLs over plain HTTP connections (shardtrain.s3http): a quarter of s3fs's
  CPU per byte, bytes handed over as they arrive, and no s3fs start-up when the options hold explicit keys.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, TypeAlias

import fsspec
import fsspec.implementations.local  # noqa: F401  (imported on first use otherwise: ~25 ms of the first batch)

from shardtrain.storage import s3http
from shardtrain.storage.clock import answered as clock_answered
from shardtrain.storage.retry import (FIRST_CONTACT_S, RETRY_BUDGET_S, Backoff, CredentialsError,  # noqa: F401
                                      EndpointUnreachable, StorageUnavailable, credentials_error, http_status,
                                      is_transient, refused_redirect)
from shardtrain.storage.s3http import ObjectChanged  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

S3_BLOCK_BYTES = 8 << 20
"""Block size for s3fs file objects (>= 8 MB: one GET per block, sequential reads amortise the request cost)."""

_S3_DEFAULTS: dict[str, Any] = {
    "default_block_size": S3_BLOCK_BYTES,
    "default_cache_type": "readahead",
    "default_fill_cache": False,
}

_NO_REDIRECT = "shardtrain.storage.noredirect.NoRedirectSession"
"""s3fs requests never follow redirects (storage.noredirect): signed headers stay on the configured endpoint."""


def _protocol(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


_direct_verdict: dict[str, str | None] = {}
"""storage options (opts_key) -> why direct HTTP is not used for them (None: it is); decided once per process."""


def _direct_s3_key(url: str | os.PathLike, direct_http: bool, storage_options: dict | None) -> str | None:
    """"bucket/key" when `url` is read over direct HTTP (an s3:// URL, `direct_http`, and options the direct
    path handles right: s3http.direct_unsupported), else None (s3fs reads it)."""
    url = str(url)
    if not (direct_http and _protocol(url) in ("s3", "s3a")):
        return None
    okey = s3http.opts_key(storage_options)
    if okey not in _direct_verdict:
        _direct_verdict[okey] = why = s3http.direct_unsupported(storage_options)
        if why is not None:
            log.info("reading s3:// through s3fs, not direct HTTP: the storage options need %s", why)
    if _direct_verdict[okey] is not None:
        return None
    return url.split("://", 1)[1]


def _s3fs_factory(url: str | os.PathLike, storage_options: dict | None):
    """The s3fs filesystem for `url`, built only if s3http must have s3fs sign a URL."""
    return lambda: fs_and_path(url, storage_options)[0]


def _backoff(url: str | os.PathLike, storage_options: dict | None, **kw: Any) -> Backoff:
    """A read's Backoff; an S3 read's probes the endpoint after a failure until the endpoint has answered once
    (s3http.endpoint_problem), so a wrong endpoint is named in seconds."""
    s3 = _protocol(str(url)) in ("s3", "s3a")
    return Backoff(str(url), probe=(lambda: s3http.endpoint_problem(storage_options)) if s3 else None, **kw)


_endpoint_ok: set[str] = set()
"""Storage options (opts_key) whose endpoint connected in this process (or its forking parent)."""


def _endpoint_checked(url: str, storage_options: dict | None) -> None:
    """Before the first s3fs filesystem for these options, while no read has had an answer: one connect to the
    endpoint (s3http.endpoint_problem, ~1 ms on loopback). An endpoint that cannot be talked to raises
    EndpointUnreachable in one line at once (a refused one after FIRST_CONTACT_S of re-probing, for a server
    still starting), instead of botocore and s3fs retrying it inside every call (~9 s each) until a traceback."""
    okey = s3http.opts_key(storage_options)
    if okey in _endpoint_ok or clock_answered():
        return
    t0 = time.monotonic()
    while (problem := s3http.endpoint_problem(storage_options)) is not None:
        message, may_start = problem
        if not may_start or time.monotonic() - t0 > FIRST_CONTACT_S:
            raise EndpointUnreachable(f"{url}: {message}", url)
        time.sleep(0.5)
    _endpoint_ok.add(okey)


FileSystem: TypeAlias = fsspec.AbstractFileSystem
"""What `fs_and_path` returns: rooms above storage name the type through here and never import fsspec."""


def fs_is_local(fs: FileSystem) -> bool:
    """True for a local-disk filesystem (`fs_and_path` of a plain path or `file://` URL): fast opens, os.walk."""
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def is_local(url: str | os.PathLike) -> bool:
    """True for plain paths and `file://` URLs (atomic rename is available there)."""
    return _protocol(str(url)) in ("file", "local")


def local_path(url: str | os.PathLike) -> str:
    """The absolute path on this machine that a local `url` names, as every fsspec call here reads it: `file://`
    stripped, a leading `~` expanded, a relative path joined to the working directory. Code that opens local files
    itself (pathlib, os) goes through this, or it writes to `./file:/...` or `./~/...` while the fsspec calls on the
    same URL (locks, sync, reads) go to the folder the user named. ValueError for a non-local URL. Cost: a string
    operation."""
    if not is_local(url):
        raise ValueError(f"{url}: not a local path or file:// URL")
    return fs_and_path(url)[1]


def fs_and_path(url: str | os.PathLike, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Filesystem and in-filesystem path for `url`, with s3fs tuned for large sequential reads.

    fsspec caches filesystem instances per (class, options) and per process, so calling this per file is cheap.
    """
    url = str(url)
    opts = dict(storage_options or {})
    if _protocol(url) in ("s3", "s3a"):
        _endpoint_checked(url, storage_options)
        for k, v in _S3_DEFAULTS.items():
            opts.setdefault(k, v)
        config = dict(opts.get("config_kwargs") or {})
        if "http_session_cls" not in config:
            from shardtrain.storage.noredirect import NoRedirectSession

            opts["config_kwargs"] = {**config, "http_session_cls": NoRedirectSession}
    fs, path = fsspec.core.url_to_fs(url, **opts)
    return fs, path


def join(url: str | os.PathLike, name: str) -> str:
    """`url` + "/" + `name` without doubling slashes; works for paths and URLs alike."""
    return str(url).rstrip("/") + "/" + name.lstrip("/")


@contextlib.contextmanager
def _credentials(url: str | os.PathLike):
    """Missing or refused credentials (CredentialsError) and a refused redirect (PermissionError), however deep in
    the S3 stack they were raised, leave as the OSErrors they are."""
    try:
        yield
    except CredentialsError:
        raise
    except Exception as e:  # noqa: BLE001 - botocore's credential errors are not OSErrors
        hopeless = credentials_error(e, str(url)) or refused_redirect(e, str(url))
        if hopeless is None:
            raise
        raise hopeless from e


def _call(fs: fsspec.AbstractFileSystem, method: str, *args, budget_s: float | None = None, **kw):
    """`fs.method(*args, **kw)`, bounded by `budget_s` in all on an async filesystem (s3fs: fsspec's `timeout`)."""
    if budget_s is not None and getattr(fs, "async_impl", False):
        kw["timeout"] = max(budget_s, 0.05)
    return getattr(fs, method)(*args, **kw)


def exists(url: str | os.PathLike, storage_options: dict | None = None, *, budget_s: float = RETRY_BUDGET_S) -> bool:
    fs, path = fs_and_path(url, storage_options)
    with _credentials(url):
        return bool(_call(fs, "exists", path, budget_s=budget_s))


def size(url: str | os.PathLike, storage_options: dict | None = None, *, budget_s: float = RETRY_BUDGET_S) -> int:
    fs, path = fs_and_path(url, storage_options)
    with _credentials(url):
        return int(_call(fs, "size", path, budget_s=budget_s))


def ls_names(url: str | os.PathLike, storage_options: dict | None = None, *,
             budget_s: float = RETRY_BUDGET_S) -> list[str]:
    """Base names directly under `url` (empty when it does not exist). Refreshes s3fs's listing cache."""
    fs, path = fs_and_path(url, storage_options)
    try:
        fs.invalidate_cache(path)
        with _credentials(url):
            entries = _call(fs, "ls", path, detail=False, budget_s=budget_s)
    except FileNotFoundError:
        return []
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)


def makedirs(url: str | os.PathLike, storage_options: dict | None = None) -> None:
    """Create a local folder; a no-op on object stores (prefixes need no creation)."""
    if is_local(url):
        fs, path = fs_and_path(url, storage_options)
        fs.makedirs(path, exist_ok=True)


def remove(url: str | os.PathLike, storage_options: dict | None = None, *, recursive: bool = False) -> None:
    """Delete a file (or a folder/prefix with `recursive`); missing is fine."""
    fs, path = fs_and_path(url, storage_options)
    try:
        with _credentials(url):
            fs.rm(path, recursive=recursive)
    except FileNotFoundError:
        pass


def read_bytes(url: str | os.PathLike, storage_options: dict | None = None, *, direct_http: bool = False,
               budget_s: float = RETRY_BUDGET_S) -> bytes:
    """Whole small object (manifest, markers), retried under `budget_s` of time without progress. Large shards go
    through `read_range`."""
    if _direct_s3_key(url, direct_http, storage_options) is not None:
        return read_range(url, 0, None, storage_options, direct_http=True, budget_s=budget_s)
    fs, path = fs_and_path(url, storage_options)
    backoff = _backoff(url, storage_options, budget_s=budget_s)
    return _with_retry(lambda: _call(fs, "cat_file", path, budget_s=backoff.call_budget()), url, backoff)


def version(url: str | os.PathLike, storage_options: dict | None = None, *, direct_http: bool = False,
            budget_s: float = RETRY_BUDGET_S) -> str:
    """An object's version, without reading it: a local file's (inode, size, mtime_ns), an S3 object's ETag (a
    1-byte GET through the presigned path when `direct_http` applies, else a HEAD). Equal versions: the same bytes;
    a re-written or replaced object has another. Cost: one stat, or one small request."""
    if is_local(url):
        st = os.stat(fs_and_path(url, storage_options)[1])
        return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    if _direct_s3_key(url, direct_http, storage_options) is not None:
        pins: dict = {}
        for _ in iter_range(url, 0, 1, storage_options, direct_http=True, budget_s=budget_s, pins=pins,
                            allow_short=True):
            pass
        return str(next(iter(pins.values()), ""))
    fs, path = fs_and_path(url, storage_options)
    backoff = _backoff(url, storage_options, budget_s=budget_s)
    fs.invalidate_cache(path)
    info = _with_retry(lambda: _call(fs, "info", path, budget_s=backoff.call_budget()), url, backoff)
    return str(info.get("ETag") or info.get("etag") or (info.get("size"), info.get("LastModified")))


def atomic_write_bytes(url: str | os.PathLike, data: bytes, storage_options: dict | None = None) -> None:
    """Write `data` so readers see either nothing/the old content or all of it.

    Locally: write a unique temp name in the same folder, fsync, rename over the target (atomic on POSIX).
    On object stores a single PUT is atomic by itself.
    """
    url = str(url)
    fs, path = fs_and_path(url, storage_options)
    if is_local(url):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    else:
        with _credentials(url):
            fs.pipe_file(path, data)
        fs.invalidate_cache(path)


def sync(url: str | os.PathLike, storage_options: dict | None = None) -> None:
    """Make a written file durable: fsync a local file by path; nothing on an object store, where an object is
    durable once its PUT returned. For data whose readiness is recorded elsewhere (a done-marker, a manifest)
    after the bytes reach the disk, not before."""
    url = str(url)
    if not is_local(url):
        return
    fd = os.open(fs_and_path(url, storage_options)[1], os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_local_file(tmp_path: str | os.PathLike, url: str | os.PathLike, storage_options: dict | None = None) -> None:
    """Publish a finished local temp file at `url` and remove the temp: rename locally, upload whole on S3.

    The temp must already sit in the target folder for a local `url` (rename cannot cross filesystems).
    s3fs uploads files above its block size as multipart; the object appears only when the upload completes.
    """
    url = str(url)
    fs, path = fs_and_path(url, storage_options)
    if is_local(url):
        os.replace(tmp_path, path)
        return
    try:
        with _credentials(url):
            fs.put_file(str(tmp_path), path)
        fs.invalidate_cache(path)
    finally:
        Path(tmp_path).unlink(missing_ok=True)


def _fetcher(url: str | os.PathLike, end: int | None, storage_options: dict | None, direct_http: bool,
             backoff: Backoff, pins: dict) -> tuple[Callable[[int, int], Iterator[bytes]], int | None]:
    """(fetch(a, b) -> pieces of bytes [a, b), end): direct presigned HTTP for s3:// when allowed (end may stay
    None: the responses say where the object ends), else fsspec `cat_file` (end from the object's size).
    Both run under `backoff.clock`: s3http watches every wait; an s3fs call is bounded by the time left."""
    key = _direct_s3_key(url, direct_http, storage_options)
    clock = backoff.clock
    if key is not None:
        sign_with = _s3fs_factory(url, storage_options)

        def fetch_http(a: int, b: int) -> Iterator[bytes]:
            return s3http.iter_range(key, storage_options, sign_with, a, b, clock, pins)
        return fetch_http, end
    fs, path = fs_and_path(url, storage_options)
    if end is None:
        end = _with_retry(lambda: int(_call(fs, "size", path, budget_s=backoff.call_budget())), url, backoff)

    def fetch_fs(a: int, b: int) -> Iterator[bytes]:
        try:
            piece = _call(fs, "cat_file", path, start=a, end=b, budget_s=backoff.call_budget())
        except OSError as e:  # s3fs: HTTP 416 (a range from the object's end on) is OSError(EINVAL), not b""
            if http_status(e) != 416:
                raise
            piece = b""  # the object ends before `a`: what the direct path and local files say (allow_short/EOF)
        if piece:
            clock.done()
        return iter((piece,) if piece else ())
    return fetch_fs, end


def iter_range(
    url: str | os.PathLike,
    start: int = 0,
    end: int | None = None,
    storage_options: dict | None = None,
    *,
    retries: int | None = None,
    budget_s: float = RETRY_BUDGET_S,
    piece_bytes: int = 8 << 20,
    backoff_s: float = 0.2,
    max_backoff_s: float = 5.0,
    allow_short: bool = False,
    direct_http: bool = False,
    pins: dict | None = None,
) -> Iterator[bytes]:
    """Bytes `[start, end)` of `url` (to the end of the object when `end` is None), a piece at a time.

    Each request covers up to `piece_bytes`. The read may go `budget_s` seconds without progress (storage.clock:
    64 KiB received or a response completed), waiting or retrying alike; a transient error (`is_transient`) is
    retried with jittered exponential backoff (`Backoff`, at most `retries` times in a row, when given), resuming
    at the first byte not yet delivered. So a dropped connection costs at most one piece of re-transfer, an
    outage only its length, and never a lost or duplicated byte. Hopeless errors (404, 403, other 4xx) and programming errors raise at once; a
    spent budget raises StorageUnavailable naming the cause (refused, stall, trickle, the last error); missing or
    refused credentials raise CredentialsError. 8 MB pieces keep the per-request overhead (~1-5 ms on loopback S3)
    near 1% of transfer time. An object shorter than `end` raises EOFError, or with `allow_short` just ends (a
    truncated shard keeps its head). `direct_http` reads `s3://` objects through presigned URLs
    (shardtrain.s3http) and yields each request's bytes as they arrive (up to 1 MB at a time), every request after
    the first pinned to the object's first ETag (If-Match; `pins`, when given, carries the pin to the caller's
    later reads): an object replaced mid-read raises s3http.ObjectChanged, never retried into spliced bytes.
    """
    if start < 0 or (end is not None and end < start):
        raise ValueError(f"read_range: bad range [{start}, {end}) for {url}")
    backoff = _backoff(url, storage_options, budget_s=budget_s, retries=retries, backoff_s=backoff_s,
                       max_backoff_s=max_backoff_s)
    fetch, end = _fetcher(url, end, storage_options, direct_http, backoff, {} if pins is None else pins)
    pos = start
    while end is None or pos < end:  # end None: direct HTTP learns where the object ends from the responses
        stop = pos + piece_bytes if end is None else min(end, pos + piece_bytes)
        asked, got = stop - pos, 0
        try:
            for piece in fetch(pos, stop):
                pos += len(piece)
                got += len(piece)
                yield piece
        except Exception as e:  # noqa: BLE001 - network stacks raise many types; is_transient sorts them
            if not is_transient(e):
                cred = credentials_error(e, str(url))
                if cred is not None:
                    raise cred from e
                raise
            backoff.wait(e, f"at byte {pos} of [{start}, {end if end is not None else 'end'})")
            continue
        if end is None and 0 < got < asked:
            return  # the object ended inside this piece
        if not got:
            if allow_short or end is None:
                return
            raise EOFError(f"{url}: object ended at byte {pos}, expected {end}")


LOCAL_PIECE_BYTES = 1 << 20
"""A local read's first piece (then the rest of the range in one): the first rows can start decoding after the
first MiB instead of after a whole 8 MB request, and the per-piece work (row checks, decode hand-offs) stays
batched."""


def fill_range(url: str | os.PathLike, start: int, out: memoryview, storage_options: dict | None = None,
               **iter_kw: Any) -> Iterator[int]:
    """Fill `out` with bytes `[start, start + len(out))` of `url`, yielding the bytes filled after each piece;
    ends early (a shorter count) where the object ends.

    Why a second way in: the loader reads most of a local dataset's bytes, and `iter_range` hands them over as
    new `bytes` per piece that are then copied into the run buffer: a 7 MB local run took ~10 ms that way, ~3 ms
    read straight into `out` with `readinto` (no intermediate object, no page faults of a fresh piece). Remote
    objects still go through `iter_range` (`iter_kw`: its retries, budget and piece size) and are copied in."""
    if is_local(url):
        path = fs_and_path(url, storage_options)[1]
        with open(path, "rb", buffering=0) as f:
            _check_pin(path, f.fileno(), iter_kw.get("pins"))
            f.seek(start)
            have, piece = 0, LOCAL_PIECE_BYTES
            while have < len(out):
                n = f.readinto(out[have:have + piece])
                if not n:
                    return
                have += n
                piece = len(out)  # then the rest at once: fewer, fuller hand-offs (row checks, decode tasks)
                yield have
        return
    yield from copy_into(iter_range(url, start, start + len(out), storage_options, allow_short=True, **iter_kw), out)


def map_range(url: str | os.PathLike, start: int, end: int, storage_options: dict | None = None,
              pins: dict | None = None) -> memoryview | None:
    """Bytes `[start, end)` of a local file as a read-only view of a private memory map of it, shorter where the
    file ends; None when `url` is not a local file, or not one that can be mapped (a pipe, some FUSE mounts; or
    this platform has no private maps): read it with `fill_range` then. The mapping lives as long as any view of it.

    Why a third way in: `fill_range` copies every byte from the page cache into fresh anonymous memory, and the
    loader paid for that copy, for a page fault per 4 KB of the fresh memory (zeroing and charging each page)
    and for freeing it again: ~9% of its CPU on the benchmark corpora (107k page faults an epoch of the 4k
    speech corpus, 24k mapped). Mapped, the decoder reads the page cache itself; the kernel maps 64 KB a fault.
    Cost and hazard: one mmap and one munmap a run, and a file truncated in place while mapped ends the process
    with SIGBUS where a read would have reported a truncated shard. Packing never truncates (it renames a new
    file over the old: the map keeps the old inode), and `pins` refuses a file replaced or rewritten since the
    run first opened it (ObjectChanged); the loader's `StreamConfig.map_local=False` reads instead."""
    flags = getattr(mmap, "MAP_PRIVATE", None)
    if flags is None or not is_local(url):
        return None
    path = fs_and_path(url, storage_options)[1]
    with open(path, "rb", buffering=0) as f:
        st = _check_pin(path, f.fileno(), pins) or os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return None
        end = min(end, st.st_size)
        if end <= start:
            return memoryview(b"")
        lo = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            mapped = mmap.mmap(f.fileno(), end - lo, flags=flags, prot=mmap.PROT_READ, offset=lo)
        except (OSError, ValueError) as e:  # not mappable (a pipe, a device, some FUSE mounts): read it instead
            log.debug("%s: not mapped (%s); reading it", path, e)
            return None
    return memoryview(mapped)[start - lo:]


def _check_pin(path: str, fd: int, pins: dict | None) -> os.stat_result | None:
    """The local counterpart of an ETag pin: (inode, size, mtime_ns) of the first open, compared at every later open
    through the same `pins` (one fstat, ~1 us). A re-pack renames new files over the old (a new inode) or rewrites
    them (a new mtime): either raises ObjectChanged. One open reads one version, so a run is never spliced.
    Returns the fstat it took (None without pins), so a caller needing the size asks once."""
    if pins is None:
        return None
    st = os.fstat(fd)
    now = (st.st_ino, st.st_size, st.st_mtime_ns)
    first = pins.setdefault(path, now)
    if first != now:
        raise ObjectChanged(f"{path}: the file was replaced or rewritten while the run read it (inode, size, "
                            f"mtime_ns {first} first, now {now}); its bytes would mix two versions")
    return st


def copy_into(pieces: Iterator[bytes], out: memoryview) -> Iterator[int]:
    """Copy `pieces` into `out` one after another, yielding the bytes filled so far (`fill_range`'s remote half,
    for any iterator of pieces, e.g. a cached shard's)."""
    have = 0
    for piece in pieces:
        out[have:have + len(piece)] = piece
        have += len(piece)
        yield have


def presign(urls: list[str], storage_options: dict | None = None) -> None:
    """Sign `urls` (s3://) for `iter_range(direct_http=True)` ahead of time (~20 us each signed locally, ~0.25 ms
    by s3fs). Why: a DataLoader worker forked afterwards finds them signed and needs no S3 client of its own."""
    for url in urls:
        key = _direct_s3_key(url, True, storage_options)
        if key is not None:
            with _credentials(url):
                s3http.presigned(key, storage_options, _s3fs_factory(url, storage_options))


def open_ranged(url: str | os.PathLike, storage_options: dict | None = None, *, direct_http: bool = False,
                retries: int | None = None, budget_s: float = RETRY_BUDGET_S, backoff_s: float = 0.2):
    """A read-only seekable binary file for random access (Parquet): s3fs's, or over direct HTTP ranged GETs."""
    key = _direct_s3_key(url, direct_http, storage_options)
    if key is not None:
        pins: dict = {}  # footer and column chunks from one version of the object

        def block(a: int, b: int) -> bytes:
            return read_range(url, a, b, storage_options, direct_http=True, retries=retries, budget_s=budget_s,
                              backoff_s=backoff_s, pins=pins)

        backoff = _backoff(url, storage_options, budget_s=budget_s, retries=retries, backoff_s=backoff_s)
        return _with_retry(lambda: s3http.RangeFile(key, storage_options, _s3fs_factory(url, storage_options), block,
                                                    clock=backoff.clock, pins=pins), url, backoff)
    fs, path = fs_and_path(url, storage_options)
    with _credentials(url):
        return fs.open(path, "rb")


def read_range(url: str | os.PathLike, start: int = 0, end: int | None = None,
               storage_options: dict | None = None, **kw) -> bytes:
    """All of `iter_range(...)` as one bytes object (one copy at most); same keywords."""
    pieces = list(iter_range(url, start, end, storage_options, **kw))
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _with_retry(fn, url, backoff: Backoff):
    """`fn()`, retried on transient errors under `backoff`'s budget (hopeless and programming errors raise)."""
    while True:
        try:
            with _credentials(url):
                out = fn()
            backoff.clock.done()  # an answer: the endpoint works (storage.clock.answered)
            return out
        except Exception as e:  # noqa: BLE001 - is_transient sorts them
            if not is_transient(e):
                raise
            backoff.wait(e, "(size/footer/whole object)")
