"""cli/infer.py (transcribe, evaluate, export): help names CHECKPOINT; a checkpoint path that is not there is one line
saying what a checkpoint is, exit 2, and nothing is written (the runs on real checkpoints are tests/infer/)."""
from __future__ import annotations

import pytest

from conftest import cli_help, one_error_line, shardtrain_cli


def test_help_names_checkpoint_and_inputs():
    assert "CHECKPOINT" in cli_help("transcribe") and "INPUT" in cli_help("transcribe")
    assert "--data" in cli_help("evaluate")
    assert "OUT.onnx" in cli_help("export") and "--quantize" in cli_help("export")


@pytest.mark.parametrize("command", ["transcribe", "evaluate", "export"])
def test_missing_checkpoint_is_one_line_exit_2(tmp_path, command):
    ck = tmp_path / "no-run"
    args = {"transcribe": [str(tmp_path / "a.wav")], "evaluate": ["--data", str(tmp_path / "ds")],
            "export": [str(tmp_path / "m.onnx")]}[command]
    p = shardtrain_cli(command, str(ck), *args)
    assert p.returncode == 2, p.stderr[-2000:]
    line = one_error_line(p, command)
    assert f"{ck}: no checkpoint here" in line and "step_NNNNNN" in line
    assert not (tmp_path / "m.onnx").exists()
