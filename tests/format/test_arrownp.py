"""lean_memory_pool: the loader's process leaves mimalloc (~20 MB of RSS for a small index) unless told not to."""
import pyarrow as pa
import pytest

from shardtrain.format.arrownp import lean_memory_pool


@pytest.fixture
def mimalloc_default():
    before = pa.default_memory_pool()
    try:
        pa.set_memory_pool(pa.mimalloc_memory_pool())
    except NotImplementedError:
        pytest.skip("this pyarrow build has no mimalloc")
    yield
    pa.set_memory_pool(before)


def test_mimalloc_default_becomes_the_system_pool(mimalloc_default, monkeypatch):
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    assert lean_memory_pool() == "system"
    assert pa.default_memory_pool().backend_name == "system"
    assert pa.array(["a", "bc"]).take(pa.array([1])).to_pylist() == ["bc"]


def test_an_explicit_choice_is_kept(mimalloc_default, monkeypatch):
    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "mimalloc")
    assert lean_memory_pool() == "mimalloc"
    assert pa.default_memory_pool().backend_name == "mimalloc"

