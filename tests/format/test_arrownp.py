"""lean_memory_pool: the loader's process leaves mimalloc (~20 MB of RSS for a small index) unless told not to; and
importing shardtrain before pyarrow makes glibc's allocator Arrow's C++ default, the one the Parquet reader's own
buffers come from (shardtrain/__init__.py: mimalloc's first allocation cost 35-115 ms at the loader's start)."""
import os
import subprocess
import sys

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



READ = """
import sys, os
{first}
import pyarrow as pa, pyarrow.parquet as pq
from shardtrain.format.indexread import dictionary_columns, read_bounded
try:
    mimalloc = pa.mimalloc_memory_pool()
except NotImplementedError:
    print("NO-MIMALLOC"); sys.exit(0)
path = sys.argv[1]
pq.write_table(pa.table({{"key": [f"k{{i}}" for i in range(5000)], "n": list(range(5000))}}), path, compression="zstd")
with open(path, "rb") as f:
    pf = pq.ParquetFile(f)
    pf = pq.ParquetFile(f, metadata=pf.metadata, read_dictionary=dictionary_columns(pf.schema_arrow))
    assert read_bounded(pf, None, path).num_rows == 5000
print(os.environ.get("ARROW_DEFAULT_MEMORY_POOL", "-"), pa.default_memory_pool().backend_name, mimalloc.max_memory())
"""


def _read_in_fresh_process(tmp_path, first: str, pool_env: str | None = None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}  # this process set it
    if pool_env is not None:
        env["ARROW_DEFAULT_MEMORY_POOL"] = pool_env
    r = subprocess.run([sys.executable, "-c", READ.format(first=first), str(tmp_path / "i.parquet")], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.split()
    if out == ["NO-MIMALLOC"]:
        pytest.skip("this pyarrow build has no mimalloc")
    return out


def test_importing_shardtrain_first_keeps_the_parquet_reader_off_mimalloc(tmp_path):
    env, pool, mimalloc_peak = _read_in_fresh_process(tmp_path, "import shardtrain")
    assert (env, pool) == ("system", "system")
    assert mimalloc_peak == "0", "the Parquet reader's buffers came from mimalloc (Arrow's C++ default)"


def test_importing_shardtrain_keeps_an_explicit_pool_and_a_pyarrow_imported_before(tmp_path):
    assert _read_in_fresh_process(tmp_path, "import shardtrain", pool_env="mimalloc")[:2] == ["mimalloc", "mimalloc"]
    env, _, mimalloc_peak = _read_in_fresh_process(tmp_path, "import pyarrow; import shardtrain")
    assert env == "-", "the variable was set after pyarrow had read it: a change that changes nothing"
    assert int(mimalloc_peak) > 0  # what the first test avoids: the reader's buffers do come from the C++ default


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
