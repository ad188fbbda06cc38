"""benchmarks.gpu_check: without a GPU it says so and measures nothing; its CPU dry run goes through every part
(the same functions the GPU run calls, tiny sizes) and writes the JSON and Markdown table."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PARTS = ["data", "cuda_tests", "augment", "amp_step", "tune", "oom", "onnx"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would measure it")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
    res = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--out-dir", str(tmp_path)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("\n") == 1 and "no CUDA device" in res.stdout
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_dry_run_goes_through_every_part_and_writes_the_table(tmp_path):
    res = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"table in {tmp_path / 'gpu_check.md'}" in res.stdout
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = doc["parts"]
    assert set(parts) == set(PARTS) and doc["dry_run"] is True
    assert all(p["status"] == "ok" for p in parts.values()), {n: p.get("error") for n, p in parts.items()}
    assert parts["data"]["samples"] == doc["sizes"]["utterances"]
    assert parts["cuda_tests"]["rc"] == 0 and parts["cuda_tests"].get("failed", 0) == 0
    assert parts["augment"]["speedup"] > 0 and parts["augment"]["cpu_per_utt_audio_s_per_s"] > 0
    assert 0 <= parts["amp_step"]["data_wait_pct"] < 100 and parts["amp_step"]["steps"] > 0
    tune = parts["tune"]
    assert tune["ratio"] > 0 and tune["runs"] == {"tuned": 1, "single": 1}
    assert sum(b["steps"] for b in tune["per_bucket"]) > 0
    assert all(b["of_target"] is None or 0 < b["of_target"] for b in tune["per_bucket"])
    assert parts["oom"]["survived"] and parts["oom"]["real_oom"] is False  # the CPU cannot run out for real
    md = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {p} | ok |" in md for p in PARTS) and "Peak device memory per bucket" in md
