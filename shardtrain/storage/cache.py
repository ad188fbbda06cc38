"""A whole-shard LRU cache on local disk, for remote datasets read more than once (`StreamConfig.cache_dir`).

Costs the shard's size on local disk; a hit turns a remote ranged read into a local one. Files are named by the
shard's sha256 prefix and name, written to a temp name and renamed, and evicted oldest-first past `max_bytes`.
"""
from __future__ import annotations

import hashlib
import os
import re
import threading

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,200}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def cache_file_name(name: str, sha256: str) -> str:
    """`<sha256[:16]>-<name>` when both are plain (hex digits; a file name without `/` or `..`), otherwise a
    digest of both: the name comes from a (possibly hostile) manifest and must never leave the cache folder."""
    if _HEX16.match(sha256[:16]) and _SAFE_NAME.match(name) and ".." not in name and name.endswith(".tar"):
        return f"{sha256[:16]}-{name}"
    return hashlib.sha256(f"{sha256}\0{name}".encode("utf-8", "replace")).hexdigest()[:32] + ".tar"


class ShardCache:
    """Whole remote shards kept on local disk across epochs; LRU by mtime, evicted past `max_bytes`."""

    def __init__(self, root: str, max_bytes: int):
        self.root, self.max_bytes = root, max_bytes
        os.makedirs(root, exist_ok=True)
        self._lock = threading.Lock()

    def path(self, name: str, sha256: str, size: int, read_whole) -> str:
        """Local path of shard `name` (fetched with `read_whole()` unless a copy of the right size is cached)."""
        local = os.path.join(self.root, cache_file_name(name, sha256))
        if os.path.exists(local) and os.path.getsize(local) == size:
            os.utime(local)
            return local
        data = read_whole()
        tmp = f"{local}.tmp{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, local)
        self._evict()
        return local

    def _evict(self) -> None:
        with self._lock:
            files = [os.path.join(self.root, n) for n in os.listdir(self.root) if n.endswith(".tar")]
            files.sort(key=lambda p: os.path.getmtime(p))
            total = sum(os.path.getsize(p) for p in files)
            while total > self.max_bytes and len(files) > 1:
                victim = files.pop(0)
                total -= os.path.getsize(victim)
                os.remove(victim)
