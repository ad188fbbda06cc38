"""cli/plan.py (plan): help names DATASET and --world-size; a dataset that is not there is one line, exit 2 (the
plan of real datasets is tests/load/test_preflight.py)."""
from __future__ import annotations

from conftest import cli_help, one_error_line, shardtrain_cli


def test_plan_help():
    text = cli_help("plan")
    assert "DATASET" in text and "--world-size" in text


def test_plan_of_a_missing_dataset_is_one_line_exit_2(tmp_path):
    p = shardtrain_cli("plan", str(tmp_path / "nothing"), "--world-size", "2")
    assert p.returncode == 2
    assert "no dataset at" in one_error_line(p, "plan") and p.stdout == ""


def test_plan_without_world_size_is_a_usage_error(tmp_path):
    p = shardtrain_cli("plan", str(tmp_path))
    assert p.returncode == 2 and "--world-size" in p.stderr.splitlines()[-1]
