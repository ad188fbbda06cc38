"""load/mapfiles.py: the memory-mapped index copy's files written from real Arrow row groups and read back as numpy
maps, and the checks at open that catch a file changed, resized or missing, columns out of order, and a block table
that disagrees with its columns (the copies in use: tests/load/test_mapped.py,
tests/storage/test_trust_local.py)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from shardtrain.load.blockplan import Blocks
from shardtrain.load.mapfiles import ColumnFiles, check_blocks, digests, verify

N = 6
DUR = np.array([0.5, 0.7, 1.0, 1.0, 2.5, 4.0])


def build(folder):
    dtypes = {"duration_s": np.dtype(np.float64), "num_samples": np.dtype(np.int64)}
    files = ColumnFiles(folder, N, dtypes, ("text",))
    texts = ["a", "", "héllo", "b c", "x" * 100, "z"]
    for lo, hi in ((0, 4), (4, 6)):  # two row groups, as the index is read
        files.add(pa.table({"duration_s": DUR[lo:hi], "num_samples": (DUR[lo:hi] * 16000).astype(np.int64),
                            "text": texts[lo:hi]}))
    files.close()
    meta = {"rows": N, "files": digests(folder)}
    return meta, texts


def arrays(folder):
    return {c: np.load(folder / f"{c}.npy", mmap_mode="r") for c in ("duration_s", "num_samples")}


def test_written_columns_read_back_and_verify(tmp_path):
    meta, texts = build(tmp_path)
    a = arrays(tmp_path)
    assert np.array_equal(a["duration_s"], DUR) and a["num_samples"].tolist() == [8000, 11200, 16000, 16000, 40000,
                                                                                  64000]
    offs, raw = np.load(tmp_path / "text.offsets.npy"), (tmp_path / "text.bytes").read_bytes()
    assert [raw[offs[i]:offs[i + 1]].decode() for i in range(N)] == texts
    assert meta["files"]["duration_s.npy"][2] is True and meta["files"]["text.bytes"][2] is False
    assert verify(tmp_path, meta, a) is None


def test_verify_names_what_changed(tmp_path):
    meta, _ = build(tmp_path)
    p = tmp_path / "num_samples.npy"
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    assert verify(tmp_path, meta, arrays(tmp_path)) == "num_samples.npy changed since it was built"
    p.write_bytes(bytes(data[:-8]))
    assert verify(tmp_path, meta, {}) == f"num_samples.npy has {len(data) - 8} bytes, {len(data)} when built"
    (tmp_path / "text.bytes").unlink()
    meta2 = {**meta, "files": {k: v for k, v in meta["files"].items() if k != "num_samples.npy"}}
    assert verify(tmp_path, meta2, {}) == "text.bytes is missing"
    assert verify(tmp_path, {"rows": N}, {}) == "no file digests (an older layout)"
    bad = {"duration_s": DUR[::-1].copy(), "num_samples": np.zeros(N, np.int64)}
    assert verify(tmp_path, {"rows": N, "files": {}}, bad) == "duration_s is not finite, non-negative and ascending"
    assert verify(tmp_path, {"rows": N + 1, "files": {}}, bad).startswith("duration_s holds (6,) values")


def test_check_blocks(tmp_path):
    size = np.array([10, 20, 30, 40, 50, 60])
    blocks = lambda starts, rows, **kw: Blocks(  # noqa: E731
        start=np.array(starts), rows=np.array(rows), cost=kw.get("cost", np.array([2.2, 7.5])),
        max_cost=np.array([1.0, 4.0]), nbytes=kw.get("nbytes", np.array([100, 110])),
        too_long=kw.get("too_long", np.array([False, False])))
    ident = lambda d: d  # noqa: E731
    assert check_blocks(blocks([0, 3], [3, 3], cost=np.array([2.2, 7.5]), nbytes=np.array([60, 150])), DUR, size,
                        ident, budget=10.0) is None
    assert check_blocks(blocks([0, 2], [3, 3]), DUR, size, ident, 10.0) == "blocks do not tile the rows"
    assert check_blocks(blocks([0, 3], [3, 3], nbytes=np.array([60, 151])), DUR, size, ident, 10.0) \
        == "blocks 0..1 disagree with the index's durations or sizes"
    # a block whose every row is over the budget must be flagged too_long
    assert check_blocks(blocks([0, 3], [3, 3], nbytes=np.array([60, 150])), DUR, size, ident, budget=0.9) is not None
    assert check_blocks(blocks([0, 3], [3, 3], nbytes=np.array([60, 150]), too_long=np.array([False, True])), DUR,
                        size, ident, budget=0.9) is None
