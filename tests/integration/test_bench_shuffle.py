"""Issue 11's benchmarks run end to end at smoke size: the shuffle-quality table (with lhotse) and the block
planner's scale simulator, each checking what it reports (no speed is asserted)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_bench_shuffle_reports_every_sampler(tmp_path):
    out = tmp_path / "shuffle.json"
    cmd = [sys.executable, "-m", "benchmarks.load.bench_shuffle", "--synthetic", "3000", "--epochs", "2",
           "--lhotse-buckets", "30", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["sampler"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) >= {"shardtrain (default)", "uniform shuffle in shardtrain's buckets",
                         "shardtrain run_mb=0 (contiguous chunks)", "lhotse DynamicBucketingSampler (30 buckets)"}
    assert all(0 <= r["pair_repeat_rate"] <= 1 and 0 < r["padding_efficiency"] <= 1 for r in rows.values())
    assert rows["shardtrain (default)"]["pair_repeat_rate"] < rows["shardtrain run_mb=0 (contiguous chunks)"]["pair_repeat_rate"]
    assert "| shardtrain (default) |" in res.stdout


def test_plan_scale_simulator_checks_its_invariants(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.load.bench_plan_scale", "--simulate", "--rows", "2000", "200000",
           "--world-sizes", "1", "8", "64", "--out-dir", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    sim = json.loads((tmp_path / "plan_scale_simulate.json").read_text())["simulate"]
    cells = [r[k] for r in sim for k in r if k.startswith("ws")]
    assert len(cells) >= 4
    assert all(c["exactly_once"] and c["equal_steps"] and c["over_budget_batches"] == 0 for c in cells)
