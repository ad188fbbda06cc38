"""Where the loader's memory comes from: Arrow's pool and the batch blocks (see load/buffers.py)."""
import mmap

import pyarrow as pa
import pytest
from conftest import pack_subset

from shardtrain.load.buffers import BatchBuffers
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.world import World


def test_build_loader_leaves_mimalloc(tone_corpus, tmp_path, monkeypatch):
    before = pa.default_memory_pool()
    try:
        pa.set_memory_pool(pa.mimalloc_memory_pool())
    except NotImplementedError:
        pytest.skip("this pyarrow build has no mimalloc")
    try:
        monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
        ld = build_loader(pack_subset(tone_corpus, tmp_path, 4), world=World(), seed=0, cfg=StreamConfig())
        assert pa.default_memory_pool().backend_name == "system"
        assert sum(len(b.keys) for b, _ in ld) == 4
    finally:
        pa.set_memory_pool(before)


def test_blocks_are_mapped_outside_malloc():
    pool = BatchBuffers(keep=2)
    a = pool.take(3, 1000, "int16")
    base = a
    while not isinstance(base, memoryview):
        base = base.base
    assert isinstance(base.obj.base.obj, mmap.mmap)  # the block: an array over a mapping of its own
    a[:] = 7
    assert int(a.sum()) == 7 * 3000
