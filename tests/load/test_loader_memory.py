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


def test_a_small_request_takes_no_much_larger_block():
    pool = BatchBuffers(keep=4)
    big = pool.take(4, 5 << 20, "int16")  # 40 MiB, written full
    big[:] = 1
    del big
    assert pool.free_blocks() == 1
    near = pool.take(4, (5 << 20) - 1000, "int16")  # nearly the same size: the same block, no fresh pages
    assert pool.fresh == 1
    del near
    small = pool.take(1, 1 << 20, "uint8")  # 1 MiB: a block of its own; the 40 MiB one is given back, not kept
    assert pool.fresh == 2 and small.nbytes == 1 << 20
    assert pool.free_blocks() == 0
