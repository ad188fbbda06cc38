"""Issue 21, crafted metadata that passes validation, and terminal-safe output (format/, cli/).

Datasets are packed by the real packer from real FLAC; the hostile ones are the packed dataset with its
index.parquet rewritten (manifest and shards untouched), as someone who controls a bucket would.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardtrain.format.manifest import DatasetError, open_dataset
from shardtrain.format.safe import printable
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus

ROOT = Path(__file__).resolve().parents[2]
DURS = [0.5, 0.6, 0.7, 0.8, 0.9, 0.65, 0.75, 0.85]  # all under 1 s: the old "+1 s" bound let every one through


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trust_format")
    out = root / "ds"
    pack(PackConfig(input=str(make_corpus(root / "corpus", DURS, seed=3)), output=str(out), workers=1,
                    max_samples_per_shard=4, progress=False))
    return out


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of the dataset whose index.parquet is `edit(table)` (written as pack writes it, dictionary on)."""
    shutil.copytree(src, dst)
    table = pq.read_table(dst / "index.parquet")
    pq.write_table(edit(table), dst / "index.parquet", compression="zstd", store_schema=False)
    return dst


def _set(table: pa.Table, name: str, values) -> pa.Table:
    i = table.column_names.index(name)
    return table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardtrain", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


# ---- num_samples tied to duration x rate ----------------------------------------------------------------------
def test_tiny_durations_over_real_audio_are_refused_everywhere(dataset, tmp_path):
    """durations / 100, num_samples as packed: 100x the audio a batch budget allows. open/read_index, the loader
    and `inspect --verify` all refuse it, naming the row and the fields."""
    bad = _rewrite(dataset, tmp_path / "bad", lambda t: _set(t, "duration_s", (t.column("duration_s").to_numpy()
                                                                               / 100).tolist()))
    want = r"num_samples must be duration_s x sample_rate_hz"
    with pytest.raises(DatasetError, match=want):
        open_dataset(str(bad)).read_index(["key", "duration_s"])  # asking for one of the three reads all three
    from shardtrain.load.config import StreamConfig
    from shardtrain.load.loader import build_loader
    from shardtrain.load.plan import BucketConfig
    from shardtrain.world import World

    cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=2.0, num_buckets=1), epochs=1, num_workers=0)
    with pytest.raises(DatasetError, match=want):
        loader = build_loader(str(bad), world=World(), seed=0, cfg=cfg)
        for batch in loader:  # today: every row in one "2 s" batch holding ~6 s of audio
            assert float(batch.lengths.sum()) / batch.sample_rate_hz <= 2.0 * 1.01 + 0.001 * len(batch)
    p = _run("inspect", str(bad), "--verify", "--no-progress")
    assert p.returncode == 2 and "num_samples must be duration_s" in p.stderr, (p.returncode, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1
    # durations rounded to 10 ms by some other tool are still the same audio: accepted
    ok = _rewrite(dataset, tmp_path / "ok", lambda t: _set(t, "duration_s",
                                                            np.round(t.column("duration_s").to_numpy(), 2).tolist()))
    assert open_dataset(str(ok)).read_index(["duration_s"]).num_rows == len(DURS)


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


def test_index_bomb_is_refused_from_its_footer_before_rows_are_read(dataset, tmp_path):
    """One 64 MiB transcript shared by every row: a few KB on disk (dictionary + zstd), 0.5 GB once read plainly.
    Refused from the footer's column-chunk sizes; the process never holds the expansion."""
    def one_string_for_all(t: pa.Table) -> pa.Table:  # built as a dictionary: the test itself stays small
        i = t.column_names.index("text")
        big = pa.DictionaryArray.from_arrays(pa.array(np.zeros(t.num_rows, np.int32)), pa.array(["a" * (64 << 20)]))
        return t.set_column(i, pa.field("text", big.type), big)

    bomb = _rewrite(dataset, tmp_path / "bomb", one_string_for_all)
    assert (bomb / "index.parquet").stat().st_size < 200_000
    p = subprocess.run([sys.executable, "-c", BOMB, str(bomb)], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT)})
    out = p.stdout
    assert "refused:" in out and "column text claims" in out, (out, p.stderr[-2000:])
    rss = float(out.split("peak_mb")[1])
    assert rss < 400, rss  # the expansion is 8 x 64 MiB = 512 MiB; nothing near it was allocated


def test_long_strings_are_refused_from_the_dictionary_before_decoding(dataset, tmp_path):
    """Under the footer's bound but over a value's: refused on the dictionary, naming column and length."""
    long = _rewrite(dataset, tmp_path / "long", lambda t: _set(t, "speaker", ["s" * 5000] * t.num_rows))
    with pytest.raises(DatasetError, match=r"column speaker holds a 5000-byte value"):
        open_dataset(str(long)).read_index(["speaker"])
    # every row at the per-value bound is what pack may write (format/limits: no aggregate bound), so it reads
    many = _rewrite(dataset, tmp_path / "many", lambda t: _set(t, "text", ["w" * 60_000] * t.num_rows))
    assert open_dataset(str(many)).read_index(["text"]).num_rows == 8
    over = _rewrite(dataset, tmp_path / "over", lambda t: _set(t, "text", ["w" * 70_000] * t.num_rows))
    with pytest.raises(DatasetError, match=r"column text holds a 70000-byte value"):
        open_dataset(str(over)).read_index(["text"])


def test_index_with_more_rows_than_the_manifest_is_refused_from_the_footer(dataset, tmp_path):
    more = _rewrite(dataset, tmp_path / "more", lambda t: pa.concat_tables([t, t]))
    with pytest.raises(DatasetError, match=r"16 rows, the manifest's shards hold 8"):
        open_dataset(str(more)).read_index(["duration_s"])


# ---- whole-string names ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("name", "shard-000000.tar\n"), ("sha256", "0" * 64 + "\n"), ("index", "index.parquet\n"),
])
def test_names_with_a_trailing_newline_are_refused(dataset, tmp_path, field, value):
    d = tmp_path / "nl"
    shutil.copytree(dataset, d)
    m = json.loads((d / "manifest.json").read_text())
    if field == "index":
        m["index"] = value
    else:
        m["shards"][0][field] = value
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DatasetError, match="must"):
        open_dataset(str(d))


def test_tar_writer_refuses_a_key_with_a_trailing_newline():
    import io

    from shardtrain.format.tar import KEY_RE, ShardWriter

    assert KEY_RE.match("utt-1") and not KEY_RE.match("utt-1\n")  # `.match` callers are whole-string too
    with pytest.raises(ValueError, match="shard key"):
        ShardWriter(io.BytesIO()).add("utt-1\n", "flac", b"x", b"{}")


# ---- terminal-safe output -------------------------------------------------------------------------------------
def test_printable_escapes_control_characters_and_keeps_text():
    assert printable("héllo wörld 日本語 it's") == "héllo wörld 日本語 it's"
    assert printable("a\x1b[2Jb\x07") == "a\\x1b[2Jb\\x07"
    assert printable("x\ny\tz\r") == "x\\ny\\tz\\r"
    assert printable("abc\u202edef\x9b") == "abc\\u202edef\\x9b"  # bidi override, C1 CSI
    assert printable("a" * 50, 10) == "aaaaaaa..."


def test_inspect_and_errors_print_escaped_names(dataset, tmp_path):
    hostile = tmp_path / "ds\x1b]0;owned\x07\x1b[2J"
    shutil.copytree(dataset, hostile)
    p = _run("inspect", str(hostile))
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\\x1b]0;owned\\x07" in p.stdout
    (hostile / "manifest.json").unlink()
    p = _run("inspect", str(hostile))
    assert p.returncode == 2 and "\x1b" not in p.stderr and "\\x1b[2J" in p.stderr, p.stderr


def test_checks_cost_per_row_against_one_decode(dataset):
    """The cost the new checks add per row at open, next to decoding one row (printed; asserted loosely: the
    figures are noisy on a shared machine). The full-size figure: benchmarks/load/bench_validate.py."""
    from shardtrain.format.audio import decode
    from shardtrain.format.indexread import MAX_STRING_BYTES

    assert MAX_STRING_BYTES["text"] >= 4096  # real transcripts fit
    ds = open_dataset(str(dataset))
    cols = ["key", "shard", "offset", "size", "audio_offset", "audio_size", "json_offset", "json_size",
            "duration_s", "num_samples", "sample_rate_hz", "channels", "text"]
    t0 = time.perf_counter()
    for _ in range(20):
        ds.read_index(cols)
    read_s = (time.perf_counter() - t0) / 20
    row = ds.read_index(["audio_offset", "audio_size"]).to_pylist()[0]
    with open(dataset / ds.shards[0].name, "rb") as f:
        f.seek(row["audio_offset"])
        audio = f.read(row["audio_size"])
    t0 = time.perf_counter()
    for _ in range(20):
        decode(audio)
    decode_s = (time.perf_counter() - t0) / 20
    print(f"read_index with checks: {read_s * 1e3:.2f} ms for {len(DURS)} rows; one decode {decode_s * 1e3:.2f} ms")
    assert read_s < 1.0
