"""cli/tune.py (tune): help names --data/--out; a dataset that is not there is one line, exit 2 like every other
command (tune used to say 1), and no budget.json is written; a flag out of range is a usage error, exit 2 (the
real tune run is tests/train/test_tune.py)."""
from __future__ import annotations

from conftest import cli_help, one_error_line, shardtrain_cli_many


def test_tune_help():
    text = cli_help("tune")
    assert "--data" in text and "--out" in text and "--memory-fraction" in text


def test_tune_on_a_missing_dataset_or_a_bad_fraction_is_one_line_exit_2(tmp_path):
    out = tmp_path / "budget.json"
    missing, fraction = shardtrain_cli_many(["tune", "--data", str(tmp_path / "nothing"), "--out", str(out)],
                                            ["tune", "--data", str(tmp_path), "--out", str(out),
                                             "--memory-fraction", "1.5"])
    assert missing.returncode == 2, missing.stderr[-2000:]
    assert "no dataset at" in one_error_line(missing, "tune")
    # `raise SystemExit("...")` inside a command: cli.app.main makes it one line and exit 2 (Python's would be 1)
    assert fraction.returncode == 2 and fraction.stderr.strip().splitlines() == [
        "tune: --memory-fraction must be in (0, 1]"]
    assert not out.exists()
