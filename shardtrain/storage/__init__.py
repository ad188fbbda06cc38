"""storage: where bytes live. The only room that talks to a filesystem or an object store.

    fs.py       fsspec access (path, file://, s3://): exists/ls/read/atomic write, ranged reads with retry
    s3http.py   direct S3 reads over presigned URLs and keep-alive http.client connections (the loader's path)
    cache.py    whole-shard LRU cache on local disk for remote datasets
    lock.py     an exclusive lock object (OUTPUT/_pack.lock) that works on local paths and S3
    redact.py   secret-looking storage options and credentials in log lines, replaced before they are shown

Imports nothing from the rest of shardtrain. `from shardtrain import storage; storage.read_range(...)` is the API.
"""
from shardtrain.storage.fs import (RETRY_BUDGET_S, S3_BLOCK_BYTES, StorageUnavailable, atomic_write_bytes, commit_local_file, exists, fs_and_path,
                                   is_local, iter_range, join, ls_names, makedirs, open_ranged, presign, read_bytes,
                                   is_transient, read_range, remove, size)

__all__ = ["RETRY_BUDGET_S", "S3_BLOCK_BYTES", "StorageUnavailable", "is_transient", "atomic_write_bytes", "commit_local_file", "exists", "fs_and_path", "is_local",
           "iter_range", "join", "ls_names", "makedirs", "open_ranged", "presign", "read_bytes", "read_range",
           "remove", "size"]
