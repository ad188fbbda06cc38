"""cli/pack.py (synth, pack, inspect): each command's help names its inputs, and a path that is not there is one
line naming the path and what the command expected, exit status 2 (invalid input), nothing written."""
from __future__ import annotations

from conftest import cli_help, one_error_line, shardtrain_cli


def test_help_of_synth_pack_inspect_names_their_arguments():
    assert "OUT" in cli_help("synth") and "--n" in cli_help("synth")
    text = cli_help("pack")
    assert "INPUT" in text and "OUTPUT" in text and "--max-samples-per-shard" in text
    assert "DATASET" in cli_help("inspect") and "--verify" in cli_help("inspect")


def test_pack_of_a_missing_input_is_one_line_and_writes_nothing(tmp_path):
    missing, out = tmp_path / "no-such-corpus", tmp_path / "out"
    p = shardtrain_cli("pack", str(missing), str(out), "--no-progress")
    assert p.returncode == 2, p.stderr[-2000:]
    line = one_error_line(p, "pack")
    assert str(missing) in line and "does not exist" in line and "manifest" in line
    assert not out.exists() or not any(out.iterdir())


def test_inspect_of_a_missing_dataset_points_at_pack(tmp_path):
    p = shardtrain_cli("inspect", str(tmp_path / "nothing"))
    assert p.returncode == 2
    line = one_error_line(p, "inspect")
    assert "no dataset at" in line and "shardtrain pack" in line and p.stdout == ""
