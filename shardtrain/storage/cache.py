"""A whole-shard LRU cache on local disk, for remote datasets read more than once (`StreamConfig.cache_dir`).

Costs the shard's size on local disk; a hit turns a remote ranged read into a local one. Files are named by the
shard's sha256 prefix and name (`cache_file_name`: never outside the folder), streamed to a temp name as the remote
read delivers them (never held whole in memory; hashed on the way, and a copy whose sha256 differs from the
manifest's is not kept) and renamed, and evicted oldest-first past `max_bytes`. The folder is private to the user
(storage.private: 0700, owner checked), so no other local user can plant a shard there.

Concurrency, between threads and processes alike (DataLoader workers, the ranks of a node share one folder): every
step that lists, opens, renames or deletes a cached file runs under an exclusive `fcntl.flock` on ROOT/.lock,
taken through a fresh open file each time (so threads of one process exclude each other too, and a fork inherits
no held lock). A reader gets an open file, opened under that lock, so eviction can never delete a file between
"it is cached" and "it is open"; once open, a POSIX unlink leaves the reader's bytes intact. A download is
renamed into place and opened under that lock too. One process per node downloads a shard while the others wait
for its copy (a second flock, one of FETCH_STRIPES per shard name). Cost: two flocks and an open per shard read.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import stat
import threading
from typing import BinaryIO, Callable, Iterable, Iterator

from shardtrain.storage.private import pid_gone, private_dir

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


FETCH_STRIPES = 64
"""Download locks per cache folder (a shard's lock is chosen by a hash of its file name): bounded, never deleted."""
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@contextlib.contextmanager
def _flock(path: str) -> Iterator[None]:
    """An exclusive flock on `path` through a new open file description (excludes threads and processes)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class ShardCache:
    """Whole remote shards kept on local disk across epochs; LRU by mtime, evicted past `max_bytes`."""

    def __init__(self, root: str, max_bytes: int):
        self.root, self.max_bytes = str(private_dir(root, setting="stream.cache_dir")), max_bytes
        self._lock_path = os.path.join(self.root, ".lock")

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
        stripe = int(hashlib.sha1(os.path.basename(local).encode()).hexdigest()[:8], 16) % FETCH_STRIPES
        with _flock(os.path.join(self.root, f".fetch-{stripe:02d}.lock")):  # one download per shard per node
            f = self._open_cached(local, size)
            if f is None:
                f = self._download(local, sha256, fetch)
        self._evict()
        return f

    def _open_cached(self, local: str, size: int) -> BinaryIO | None:
        """Open `local` if it is there with the right size, else None. Runs under the eviction lock: what it
        opens stays readable whatever is evicted afterwards."""
        with _flock(self._lock_path):
            try:
                fd = os.open(local, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            f = os.fdopen(fd, "rb")
            st = os.fstat(fd)
            if st.st_size != size or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                f.close()  # a truncated copy is fetched again; anything not a file of ours is never read
                return None
            os.utime(fd)
            return f

    def _download(self, local: str, sha256: str, fetch: Fetch) -> BinaryIO:
        """Stream the remote shard to a temp file piece by piece (hashing it), then rename it into place and open
        it, both under the eviction lock (so the fresh copy cannot be evicted before it is open). A shard shorter
        than its manifest size (truncated remotely) is cached as it is; the reader sees where it ends. One whose
        sha256 is not the manifest's is handed to this reader but not kept (its samples fail their checks)."""
        tmp = f"{local}.tmp{os.getpid()}.{threading.get_ident()}"
        h = hashlib.sha256()
        try:
            with open(tmp, "xb") as out:
                for piece in fetch():
                    out.write(piece)
                    h.update(piece)
            with _flock(self._lock_path):
                os.replace(tmp, local)
                f = open(local, "rb")
                if _SHA256.match(sha256) and h.hexdigest() != sha256:
                    os.unlink(local)
                return f
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _evict(self) -> None:
        """Delete least recently used shards past `max_bytes` (never the newest one), and temp files of processes
        that are gone. Open readers keep theirs."""
        with _flock(self._lock_path):
            files = []
            for n in os.listdir(self.root):
                p = os.path.join(self.root, n)
                if ".tar.tmp" in n and _gone(n.rsplit(".tmp", 1)[1].split(".")[0]):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(p)
                elif n.endswith(".tar"):
                    try:
                        st = os.lstat(p)
                    except FileNotFoundError:
                        continue
                    files.append((st.st_mtime, st.st_size, p))
            files.sort()
            total = sum(s for _, s, _ in files)
            while total > self.max_bytes and len(files) > 1:
                _, s, victim = files.pop(0)
                total -= s
                with contextlib.suppress(FileNotFoundError):
                    os.remove(victim)



def _gone(pid: str) -> bool:
    """True when a download temp file's `pid` names no running process (the file can go)."""
    return pid.isdigit() and pid_gone(int(pid))
