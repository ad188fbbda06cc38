"""A whole-shard LRU cache on local disk, for remote datasets read more than once (`StreamConfig.cache_dir`).

Costs the shard's size on local disk; a hit turns a remote ranged read into a local one. Files are named by the
shard's sha256 prefix and name (`cache_file_name`: never outside the folder), streamed to a temp name as the remote read delivers them (never held whole in
memory) and renamed, and evicted oldest-first past `max_bytes`.

Concurrency: a reader gets an open file, opened under the same lock eviction takes, so eviction can never delete
a file between "it is cached" and "it is open"; once open, a POSIX unlink (eviction here or in another worker
process sharing the folder) leaves the reader's bytes intact. A download is renamed into place and opened under
that lock too. Within a process one thread downloads a shard while others wanting it wait for its copy.
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
from typing import BinaryIO, Callable, Iterable, Iterator

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,200}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def cache_file_name(name: str, sha256: str) -> str:
    """`<sha256[:16]>-<name>` when both are plain (hex digits; a file name without `/` or `..`), otherwise a
    digest of both: the name comes from a (possibly hostile) manifest and must never leave the cache folder."""
    if _HEX16.match(sha256[:16]) and _SAFE_NAME.match(name) and ".." not in name and name.endswith(".tar"):
        return f"{sha256[:16]}-{name}"
    return hashlib.sha256(f"{sha256}\0{name}".encode("utf-8", "replace")).hexdigest()[:32] + ".tar"

Fetch = Callable[[], Iterable[bytes]]
"""Yields the whole remote shard in pieces (storage.iter_range: retried and resumed at the byte reached)."""


class ShardCache:
    """Whole remote shards kept on local disk across epochs; LRU by mtime, evicted past `max_bytes`."""

    def __init__(self, root: str, max_bytes: int):
        self.root, self.max_bytes = root, max_bytes
        os.makedirs(root, exist_ok=True)
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}

    def local_path(self, name: str, sha256: str) -> str:
        return os.path.join(self.root, cache_file_name(name, sha256))

    def read(self, name: str, sha256: str, size: int, fetch: Fetch, start: int, end: int,
             piece_bytes: int = 8 << 20) -> Iterator[bytes]:
        """Bytes [start, end) of shard `name` from its cached copy (fetched first on a miss); ends early when the
        shard is shorter (a truncated remote shard is cached as it is)."""
        with self.open(name, sha256, size, fetch) as f:
            f.seek(start)
            pos = start
            while pos < end:
                piece = f.read(min(piece_bytes, end - pos))
                if not piece:
                    return
                pos += len(piece)
                yield piece

    def open(self, name: str, sha256: str, size: int, fetch: Fetch) -> BinaryIO:
        """The cached shard, open for reading (fetched by streaming it to disk unless a copy of `size` exists)."""
        local = self.local_path(name, sha256)
        f = self._open_cached(local, size)
        if f is not None:
            return f
        with self._lock:
            fetching = self._fetching.setdefault(local, threading.Lock())
        with fetching:  # one download per shard per process; the others wait for it, then open its copy
            f = self._open_cached(local, size)
            if f is None:
                f = self._download(local, fetch)
        self._evict()
        return f

    def _open_cached(self, local: str, size: int) -> BinaryIO | None:
        """Open `local` if it is there with the right size, else None. Runs under the eviction lock: what it
        opens stays readable whatever is evicted afterwards."""
        with self._lock:
            try:
                if os.path.getsize(local) != size:
                    return None
                f = open(local, "rb")
            except FileNotFoundError:
                return None
            os.utime(local)
            return f

    def _download(self, local: str, fetch: Fetch) -> BinaryIO:
        """Stream the remote shard to a temp file piece by piece, then rename it into place and open it, both
        under the eviction lock (so the fresh copy cannot be evicted before it is open). A shard shorter than
        its manifest size (truncated remotely) is cached as it is; the reader sees where it ends."""
        tmp = f"{local}.tmp{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                for piece in fetch():
                    f.write(piece)
            with self._lock:
                os.replace(tmp, local)
                return open(local, "rb")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _evict(self) -> None:
        """Delete least recently used shards past `max_bytes` (never the newest one). Open readers keep theirs."""
        with self._lock:
            files = []
            for n in os.listdir(self.root):
                p = os.path.join(self.root, n)
                if n.endswith(".tar"):
                    try:
                        files.append((os.path.getmtime(p), os.path.getsize(p), p))
                    except FileNotFoundError:  # evicted by another process meanwhile
                        continue
            files.sort()
            total = sum(s for _, s, _ in files)
            while total > self.max_bytes and len(files) > 1:
                _, s, victim = files.pop(0)
                total -= s
                try:
                    os.remove(victim)
                except FileNotFoundError:
                    pass
