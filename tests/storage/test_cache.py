"""storage/cache.py: the local shard cache keeps only copies whose sha256 is the manifest's, in a private folder."""
from __future__ import annotations

import os
import stat

from shardtrain.storage.cache import ShardCache


def test_shard_cache_keeps_only_copies_whose_sha256_matches_the_manifest(tmp_path):
    import hashlib

    good = os.urandom(100_000)
    sha = hashlib.sha256(good).hexdigest()
    calls = []

    def fetch(data):
        def pieces():
            calls.append(1)
            yield data
        return pieces

    cache = ShardCache(str(tmp_path / "c"), 1 << 30)
    bad = bytes(len(good))  # right size, wrong content (a corrupted remote read)
    assert b"".join(cache.read("s.tar", sha, len(good), fetch(bad), 0, 10)) == bad[:10]  # handed over, counted later
    assert not os.path.exists(cache.local_path("s.tar", sha))  # but never kept as the cached shard
    assert b"".join(cache.read("s.tar", sha, len(good), fetch(good), 0, 10)) == good[:10]
    assert b"".join(cache.read("s.tar", sha, len(good), fetch(good), 5, 20)) == good[5:20]
    assert len(calls) == 2  # the good copy is kept and reused
    assert stat.S_IMODE(os.lstat(tmp_path / "c").st_mode) == 0o700
