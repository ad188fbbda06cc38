"""Issue 21, crafted metadata that passes validation, and terminal-safe output (format/, cli/).

Datasets are packed by the real packer from real FLAC; the hostile ones are the packed dataset (conftest's
trust_dataset) with its index.parquet rewritten (manifest and shards untouched), as someone who controls a bucket
would. The index's own bounds (footer, dictionary strings): test_indexread.py.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TRUST_DURS as DURS, rewrite_index as _rewrite, set_column as _set
from shardtrain.format.manifest import DatasetError, open_dataset
from shardtrain.format.safe import printable

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardtrain", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


# ---- num_samples tied to duration x rate ----------------------------------------------------------------------
def test_tiny_durations_over_real_audio_are_refused_everywhere(trust_dataset, tmp_path):
    """durations / 100, num_samples as packed: 100x the audio a batch budget allows. open/read_index, the loader
    and `inspect --verify` all refuse it, naming the row and the fields."""
    bad = _rewrite(trust_dataset, tmp_path / "bad", lambda t: _set(t, "duration_s", (t.column("duration_s").to_numpy()
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
    ok = _rewrite(trust_dataset, tmp_path / "ok", lambda t: _set(t, "duration_s",
                                                            np.round(t.column("duration_s").to_numpy(), 2).tolist()))
    assert open_dataset(str(ok)).read_index(["duration_s"]).num_rows == len(DURS)


# ---- whole-string names ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("name", "shard-000000.tar\n"), ("sha256", "0" * 64 + "\n"), ("index", "index.parquet\n"),
])
def test_names_with_a_trailing_newline_are_refused(trust_dataset, tmp_path, field, value):
    d = tmp_path / "nl"
    shutil.copytree(trust_dataset, d)
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


def test_inspect_and_errors_print_escaped_names(trust_dataset, tmp_path):
    hostile = tmp_path / "ds\x1b]0;owned\x07\x1b[2J"
    shutil.copytree(trust_dataset, hostile)
    p = _run("inspect", str(hostile))
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\\x1b]0;owned\\x07" in p.stdout
    (hostile / "manifest.json").unlink()
    p = _run("inspect", str(hostile))
    assert p.returncode == 2 and "\x1b" not in p.stderr and "\\x1b[2J" in p.stderr, p.stderr
