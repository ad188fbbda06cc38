"""storage: where bytes live. The only room that talks to a filesystem or an object store.

    fs.py         fsspec access (path, file://, s3://): exists/ls/read/atomic write/sync, ranged reads with retry,
                  local runs read straight into the caller's buffer
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
from shardtrain.storage.fs import (RETRY_BUDGET_S, S3_BLOCK_BYTES, CredentialsError, FileSystem,
                                   StorageUnavailable, atomic_write_bytes, commit_local_file, copy_into,
                                   credentials_error, exists, fill_range, fs_and_path, fs_is_local, is_local,
                                   is_transient, iter_range, join, ls_names, makedirs, open_ranged, presign,
                                   read_bytes, read_range, remove, size, sync)
from shardtrain.storage.redact import StorageOptions
from shardtrain.storage.s3http import ObjectChanged

__all__ = ["RETRY_BUDGET_S", "S3_BLOCK_BYTES", "CredentialsError", "FileSystem", "ObjectChanged", "StorageOptions",
           "StorageUnavailable", "atomic_write_bytes", "commit_local_file", "copy_into", "credentials_error",
           "exists", "fill_range", "fs_and_path", "fs_is_local", "is_local", "is_transient", "iter_range", "join",
           "ls_names", "makedirs", "open_ranged", "presign", "read_bytes", "read_range", "remove", "size", "sync"]
