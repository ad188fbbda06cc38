"""Operator-facing failures of the CLI: one line with the URL and the fix, a non-zero exit, no traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus

ROOT = Path(__file__).resolve().parents[2]


def test_bench_missing_shard_is_one_line_and_exit_1(tmp_path):
    make_corpus(tmp_path / "corpus", [1.0 + 0.1 * i for i in range(12)], seed=0)
    ds = tmp_path / "ds"
    pack(PackConfig(input=str(tmp_path / "corpus"), output=str(ds), max_samples_per_shard=4, workers=1,
                    progress=False))
    os.remove(ds / "shard-000001.tar")
    res = subprocess.run([sys.executable, "-m", "shardtrain", "bench", str(ds), "--max-batch-seconds", "3",
                          "--no-progress"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 1
    errors = [x for x in res.stderr.splitlines() if x.startswith("bench: error:")]
    assert len(errors) == 1 and "shard-000001.tar: shard missing" in errors[0] and "Traceback" not in res.stderr
    assert res.stdout == ""  # no results table for a run that lost data


def test_train_bounds_the_malloc_heap_unless_the_user_chose():
    """`shardtrain train` fixes glibc's mmap threshold (bounded RSS over long runs; benchmarks/train/bench_train_rss.py);
    a MALLOC_MMAP_THRESHOLD_ in the environment is the user's choice and is left alone."""
    from shardtrain.cli import _bound_malloc_heap

    assert _bound_malloc_heap({"MALLOC_MMAP_THRESHOLD_": "65536"}) is False
    assert _bound_malloc_heap({}) is sys.platform.startswith("linux")
