"""Where the loader's memory comes from: Arrow's pool and the batch blocks (see load/buffers.py)."""
import mmap

import numpy as np
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


def _block_of(a):
    """The whole pooled block under an array from BatchBuffers.take."""
    base = a
    while not isinstance(base, memoryview):
        base = base.base
    return np.frombuffer(base.obj.base.obj, np.uint8)


def test_a_small_request_reuses_a_larger_block_and_gives_back_its_tail():
    pool = BatchBuffers(keep=4)
    big = pool.take(4, 5 << 20, "int16")  # 40 MiB, written full
    big[:] = 1
    addr = big.ctypes.data
    del big
    assert pool.free_blocks() == 1
    small = pool.take(1, 1 << 20, "uint8")  # 1 MiB: the same block, no fresh pages
    assert pool.fresh == 1 and small.ctypes.data == addr
    block = _block_of(small)
    assert len(block) == 40 << 20
    assert not block[1 << 20:].any()  # the tail the large batch wrote is released (reads as zeros again)
    assert pool.free_blocks() == 0


def test_blocks_are_made_as_large_as_the_largest_batch_expected():
    """A block made for a small batch early in a chunk also holds the chunk's larger batches later: one fresh
    block, where sizing it to the first batch made a second (the first then unmapped)."""
    for expect, fresh in ((0, 2), (8 << 20, 1)):
        pool = BatchBuffers(keep=4)
        pool.expect(expect)
        a = pool.take(2, 1 << 20, "int16")  # 4 MiB
        a[:] = 3
        del a
        b = pool.take(4, 1 << 20, "int16")  # 8 MiB
        assert pool.fresh == fresh, expect
