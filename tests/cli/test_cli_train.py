"""cli/train.py (train, augment-demo): help names --data/--out; a dataset that is not there is one line, exit 2,
before any run folder is written."""
from __future__ import annotations

from conftest import cli_help, one_error_line, shardtrain_cli


def test_train_and_augment_demo_help():
    text = cli_help("train")
    assert "--data" in text and "--out" in text and "--set" in text
    text = cli_help("augment-demo")
    assert "--data" in text and "--tone" in text and "--out" in text


def test_train_on_a_missing_dataset_is_one_line_exit_2_and_no_run(tmp_path):
    run = tmp_path / "run"
    p = shardtrain_cli("train", "--data", str(tmp_path / "nothing"), "--out", str(run))
    assert p.returncode == 2, p.stderr[-2000:]
    assert "no dataset at" in one_error_line(p, "train")
    assert not (run / "checkpoints").exists()


def test_augment_demo_on_a_missing_dataset_is_one_line_exit_2(tmp_path):
    p = shardtrain_cli("augment-demo", "--data", str(tmp_path / "nothing"), "--out", str(tmp_path / "demo"))
    assert p.returncode == 2
    assert "no dataset at" in one_error_line(p, "augment-demo")
    assert not list(tmp_path.glob("demo/*.wav"))
