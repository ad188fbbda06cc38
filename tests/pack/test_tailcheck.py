"""pack/tailcheck.py: the FLAC tail check accepts exactly the files whose content reaches the length their header
claims (the fast path the packer takes instead of a full decode; issue 20)."""
from __future__ import annotations

import soundfile as sf

from shardtrain.pack.tailcheck import _flac_tail_ok
from shardtrain.testing.corpus import make_corpus


def test_flac_tail_fast_path(tmp_path):
    src = make_corpus(tmp_path / "c", [0.3, 0.77, 1.0, 2.5, 4.1], seed=9)
    for p in sorted(src.glob("*.flac")):
        data, n = p.read_bytes(), sf.info(str(p)).frames
        assert _flac_tail_ok(data, n)
        assert not _flac_tail_ok(data, n + 1) and not _flac_tail_ok(data, 2 * n)
        assert not _flac_tail_ok(data[:-3], n) and not _flac_tail_ok(data[: len(data) // 2], n)
