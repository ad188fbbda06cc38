"""cli/infer.py (transcribe, evaluate, export): help names CHECKPOINT; a checkpoint path that is not there is one line
saying what a checkpoint is, exit 2, and nothing is written (the runs on real checkpoints are tests/infer/)."""
from __future__ import annotations

from conftest import cli_help, one_error_line, shardtrain_cli_many


def test_help_names_checkpoint_and_inputs():
    assert "CHECKPOINT" in cli_help("transcribe") and "INPUT" in cli_help("transcribe")
    assert "--data" in cli_help("evaluate")
    assert "OUT.onnx" in cli_help("export") and "--quantize" in cli_help("export")


def test_missing_checkpoint_is_one_line_exit_2(tmp_path):
    ck = tmp_path / "no-run"
    runs = shardtrain_cli_many(["transcribe", str(ck), str(tmp_path / "a.wav")],
                               ["evaluate", str(ck), "--data", str(tmp_path / "ds")],
                               ["export", str(ck), str(tmp_path / "m.onnx")])
    for command, p in zip(("transcribe", "evaluate", "export"), runs):
        assert p.returncode == 2, (command, p.stderr[-2000:])
        line = one_error_line(p, command)
        assert f"{ck}: no checkpoint here" in line and "step_NNNNNN" in line
    assert not (tmp_path / "m.onnx").exists()


def test_evaluate_refuses_the_same_input_twice(tmp_path):
    """Results are keyed by input: `--data X --data X` printed one row for two asked; a usage error now."""
    (p,) = shardtrain_cli_many(["evaluate", str(tmp_path / "run"), "--data", str(tmp_path / "ds"), "--data",
                                str(tmp_path / "ds")])
    assert p.returncode == 2 and "given more than once" in one_error_line(p, "evaluate")
