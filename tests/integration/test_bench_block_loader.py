"""benchmarks.load.bench_block_loader end to end at smoke size: the Loader's start-up with both planners on a
synthetic index (concurrent rank processes), and the block planner's variety table (no speed is asserted)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_bench_block_loader_runs_both_planners_and_reports_variety(tmp_path):
    script = ["-m", "benchmarks.load.bench_block_loader"]
    res = subprocess.run([sys.executable, *script, "--rows", "10000", "--no-audio", "--ranks-per-node", "2",
                          "--world-size", "16", "--work-dir", str(tmp_path / "w"), "--out-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    scale = {r["planner"]: r for r in json.loads((tmp_path / "block_loader.json").read_text())["scale"]}
    assert set(scale) == {"rows", "blocks"}
    assert scale["blocks"]["ranks"] == 2 and scale["blocks"]["node_mb_how"] == "measured"
    assert all(r["steps"] > 0 and r["first_chunk_s"] > 0 and r["map_disk_mb"] > 0 for r in scale.values())
    assert (tmp_path / "w" / "index-map").is_dir()
    res = subprocess.run([sys.executable, *script, "--variety", "8000", "--variety-world-size", "4",
                          "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = json.loads((tmp_path / "block_variety.json").read_text())["variety"]
    assert 0 < row["blocks"]["pair_repeat_rate"] < 1 and 0 < row["uniform in the same buckets"]["pair_repeat_rate"]
    assert "| blocks |" in res.stdout
