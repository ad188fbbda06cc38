"""format/indexread.py: index.parquet is untrusted input; its footer is checked before a row is read and its
strings before they are materialised. The hostile datasets are a packed one (conftest's trust_dataset) with its
index.parquet rewritten, manifest and shards untouched.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from conftest import TRUST_DURS as DURS, rewrite_index as _rewrite, set_column as _set
from shardtrain.format.manifest import DatasetError, open_dataset

ROOT = Path(__file__).resolve().parents[2]


# ---- sizes bounded before anything is materialised ------------------------------------------------------------
BOMB = r"""
import sys
from shardtrain.format.manifest import DatasetError, open_dataset
try:
    open_dataset(sys.argv[1]).read_index()
    print("read")
except DatasetError as e:
    print("refused:", e)
peak = [x for x in open("/proc/self/status") if x.startswith("VmHWM")][0].split()[1]  # this exec's peak, kB
print("peak_mb", int(peak) / 1024)
"""


def test_index_bomb_is_refused_from_its_footer_before_rows_are_read(trust_dataset, tmp_path):
    """One 64 MiB transcript shared by every row: a few KB on disk (dictionary + zstd), 0.5 GB once read plainly.
    Refused from the footer's column-chunk sizes; the process never holds the expansion."""
    def one_string_for_all(t: pa.Table) -> pa.Table:  # built as a dictionary: the test itself stays small
        i = t.column_names.index("text")
        big = pa.DictionaryArray.from_arrays(pa.array(np.zeros(t.num_rows, np.int32)), pa.array(["a" * (64 << 20)]))
        return t.set_column(i, pa.field("text", big.type), big)

    bomb = _rewrite(trust_dataset, tmp_path / "bomb", one_string_for_all)
    assert (bomb / "index.parquet").stat().st_size < 200_000
    p = subprocess.run([sys.executable, "-c", BOMB, str(bomb)], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT)})
    out = p.stdout
    assert "refused:" in out and "column text claims" in out, (out, p.stderr[-2000:])
    rss = float(out.split("peak_mb")[1])
    assert rss < 400, rss  # the expansion is 8 x 64 MiB = 512 MiB; nothing near it was allocated


def test_long_strings_are_refused_from_the_dictionary_before_decoding(trust_dataset, tmp_path):
    """Under the footer's bound but over a value's: refused on the dictionary, naming column and length."""
    long = _rewrite(trust_dataset, tmp_path / "long", lambda t: _set(t, "speaker", ["s" * 5000] * t.num_rows))
    with pytest.raises(DatasetError, match=r"column speaker holds a 5000-byte value"):
        open_dataset(str(long)).read_index(["speaker"])
    # every row at the per-value bound is what pack may write (format/limits: no aggregate bound), so it reads
    many = _rewrite(trust_dataset, tmp_path / "many", lambda t: _set(t, "text", ["w" * 60_000] * t.num_rows))
    assert open_dataset(str(many)).read_index(["text"]).num_rows == 8
    over = _rewrite(trust_dataset, tmp_path / "over", lambda t: _set(t, "text", ["w" * 70_000] * t.num_rows))
    with pytest.raises(DatasetError, match=r"column text holds a 70000-byte value"):
        open_dataset(str(over)).read_index(["text"])


def test_index_with_more_rows_than_the_manifest_is_refused_from_the_footer(trust_dataset, tmp_path):
    more = _rewrite(trust_dataset, tmp_path / "more", lambda t: pa.concat_tables([t, t]))
    with pytest.raises(DatasetError, match=r"16 rows, the manifest's shards hold 8"):
        open_dataset(str(more)).read_index(["duration_s"])


def test_checks_cost_per_row_against_one_decode(trust_dataset):
    """The cost the new checks add per row at open, next to decoding one row (printed; asserted loosely: the
    figures are noisy on a shared machine). The full-size figure: benchmarks/load/bench_validate.py."""
    from shardtrain.format.audio import decode
    from shardtrain.format.indexread import MAX_STRING_BYTES

    assert MAX_STRING_BYTES["text"] >= 4096  # real transcripts fit
    ds = open_dataset(str(trust_dataset))
    cols = ["key", "shard", "offset", "size", "audio_offset", "audio_size", "json_offset", "json_size",
            "duration_s", "num_samples", "sample_rate_hz", "channels", "text"]
    t0 = time.perf_counter()
    for _ in range(20):
        ds.read_index(cols)
    read_s = (time.perf_counter() - t0) / 20
    row = ds.read_index(["audio_offset", "audio_size"]).to_pylist()[0]
    with open(trust_dataset / ds.shards[0].name, "rb") as f:
        f.seek(row["audio_offset"])
        audio = f.read(row["audio_size"])
    t0 = time.perf_counter()
    for _ in range(20):
        decode(audio)
    decode_s = (time.perf_counter() - t0) / 20
    print(f"read_index with checks: {read_s * 1e3:.2f} ms for {len(DURS)} rows; one decode {decode_s * 1e3:.2f} ms")
    assert read_s < 1.0
