"""cli/bench.py (bench): its help names the loader's knobs; a dataset that is not there is one line, exit 2, and no
results table (the runtime failure of a real dataset is tests/cli/test_cli_errors.py)."""
from __future__ import annotations

from conftest import cli_help, one_error_line, shardtrain_cli


def test_bench_help_names_dataset_and_budget():
    text = cli_help("bench")
    assert "DATASET" in text and "--max-batch-seconds" in text and "--json" in text


def test_bench_of_a_missing_dataset_is_one_line_exit_2(tmp_path):
    p = shardtrain_cli("bench", str(tmp_path / "nothing"), "--no-progress")
    assert p.returncode == 2
    assert "no dataset at" in one_error_line(p, "bench") and p.stdout == ""
