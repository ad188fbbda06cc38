"""cli/tune.py (tune): help names --data/--out; a dataset that is not there is one line, exit 2 like every other
command (tune used to say 1), and no budget.json is written (the real tune run is tests/train/test_tune.py)."""
from __future__ import annotations

from conftest import cli_help, one_error_line, shardtrain_cli


def test_tune_help():
    text = cli_help("tune")
    assert "--data" in text and "--out" in text and "--memory-fraction" in text


def test_tune_on_a_missing_dataset_is_one_line_exit_2_and_no_file(tmp_path):
    out = tmp_path / "budget.json"
    p = shardtrain_cli("tune", "--data", str(tmp_path / "nothing"), "--out", str(out))
    assert p.returncode == 2, p.stderr[-2000:]
    assert "no dataset at" in one_error_line(p, "tune")
    assert not out.exists()


def test_tune_refuses_a_memory_fraction_outside_0_1(tmp_path):
    p = shardtrain_cli("tune", "--data", str(tmp_path), "--out", str(tmp_path / "b.json"), "--memory-fraction", "1.5")
    assert p.returncode == 2 and "--memory-fraction must be in (0, 1]" in p.stderr
