"""The loader's one error type, in a module of its own so the CLI can classify an error without importing torch
(load/reader.py needs it for batches): `shardtrain pack` with a mistyped path answers in ~0.4 s, not ~3 s."""
from __future__ import annotations


class StreamError(RuntimeError):
    """Raised on a shard that cannot be read (403, 404, storage down past the retry budget), on too many skipped
    samples, in strict mode on the first bad sample, and on invalid resume state. One line: URL and what to do."""
