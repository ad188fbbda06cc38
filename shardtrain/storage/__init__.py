"""storage: where bytes live. The only room that talks to a filesystem or an object store.

    fs.py         fsspec access (path, file://, s3://): exists/ls/read/atomic write/sync, ranged reads with retry,
                  local runs read straight into the caller's buffer or mapped read-only (map_range)
    s3http.py     direct S3 reads over presigned URLs and keep-alive http.client connections (the loader's path)
    clock.py      time without progress per read, enforced while waiting by a watchdog (stall, trickle)
    retry.py      transient vs hopeless errors, backoff, StorageUnavailable, CredentialsError
    noredirect.py s3fs requests that never follow a redirect (signed headers stay on the endpoint)
    cache.py      whole-shard LRU cache on local disk for remote datasets
    lock.py       an exclusive lock object (OUTPUT/_pack.lock) that works on local paths and S3
    redact.py     secret-looking storage options and credentials in log lines and reprs, replaced before shown
    private.py    per-user private folders (0700, owner checked) for caches, mirrors, locks and temp files

Imports nothing from the rest of shardtrain. `from shardtrain import storage; storage.read_range(...)` is the API.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names as types; at run time each is imported on first use (__getattr__)
    from shardtrain.storage.fs import (RETRY_BUDGET_S, S3_BLOCK_BYTES, CredentialsError, FileSystem,
                                       StorageUnavailable, atomic_write_bytes, commit_local_file, copy_into,
                                       credentials_error, exists, fill_range, fs_and_path, fs_is_local, is_local,
                                       is_transient, iter_range, join, local_path, ls_names, makedirs, map_range,
                                       open_ranged, presign, read_bytes, read_range, remove, size, sync, version)
    from shardtrain.storage.redact import StorageOptions
    from shardtrain.storage.s3http import ObjectChanged

_FS = ("RETRY_BUDGET_S", "S3_BLOCK_BYTES", "CredentialsError", "FileSystem", "StorageUnavailable",
       "atomic_write_bytes", "commit_local_file", "copy_into", "credentials_error", "exists", "fill_range",
       "fs_and_path", "fs_is_local", "is_local", "is_transient", "iter_range", "join", "local_path", "ls_names",
       "makedirs", "map_range", "open_ranged", "presign", "read_bytes", "read_range", "remove", "size", "sync",
       "version")
_LAZY = {**{name: "fs" for name in _FS}, "StorageOptions": "redact", "ObjectChanged": "s3http"}
"""Imported on first use: the CLI's log filter (redact.py) and a command's first checks then cost no fsspec/s3fs
(~0.1 s of CPU)."""
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"shardtrain.storage.{_LAZY[name]}"), name)
        globals()[name] = value  # later lookups are plain attribute reads (the loader's hot path calls these)
        return value
    raise AttributeError(f"module 'shardtrain.storage' has no attribute {name!r}")
