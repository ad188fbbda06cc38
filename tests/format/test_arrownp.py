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



@pytest.mark.parametrize("values,type_", [
    ([1, None, 3, -7], pa.int32()), ([2, 3], pa.int16()), ([1 << 40, None], pa.int64()), ([1.5, None, 0.0], pa.float64()),
    (["a", None, "é", ""], pa.string()), ([], pa.int64()), ([], pa.string()), ([None, None], pa.string()),
])
def test_column_arrow_is_pa_array(values, type_):
    """column_arrow builds the same array pa.array does (values, nulls, type), from buffers."""
    from shardtrain.format.arrownp import column_arrow

    got = column_arrow(values, type_)
    got.validate(full=True)
    assert got.type == type_ and got.equals(pa.array(values, type_)) and got.null_count == values.count(None)


def test_column_arrow_refuses_what_does_not_fit():
    from shardtrain.format.arrownp import column_arrow

    with pytest.raises(OverflowError):
        column_arrow([70000], pa.int16())
    with pytest.raises(OverflowError):
        column_arrow([1 << 40], pa.int32())
    with pytest.raises(TypeError):
        column_arrow([3.7, 1], pa.int64())  # never truncated to 3


def test_bool_and_int_arrays_from_numpy():
    import numpy as np

    from shardtrain.format.arrownp import arrow_of, bool_arrow, numpy_of

    mask = np.array([True, False, True, True, False, False, False, False, True])
    assert bool_arrow(mask).to_pylist() == mask.tolist()
    assert numpy_of(arrow_of(np.array([5, -1, 9]))).tolist() == [5, -1, 9]
