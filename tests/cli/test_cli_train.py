"""cli/train.py (train, augment-demo): help names --data/--out; a dataset that is not there is one line, exit 2,
before any run folder or example is written."""
from __future__ import annotations

from conftest import cli_help, one_error_line, shardtrain_cli_many


def test_train_and_augment_demo_help():
    text = cli_help("train")
    assert "--data" in text and "--out" in text and "--set" in text
    text = cli_help("augment-demo")
    assert "--data" in text and "--tone" in text and "--out" in text


def test_a_missing_dataset_is_one_line_exit_2_and_nothing_written(tmp_path):
    run, demo = tmp_path / "run", tmp_path / "demo"
    train, augment = shardtrain_cli_many(["train", "--data", str(tmp_path / "nothing"), "--out", str(run)],
                                         ["augment-demo", "--data", str(tmp_path / "nothing"), "--out", str(demo)])
    for command, p in (("train", train), ("augment-demo", augment)):
        assert p.returncode == 2, (command, p.stderr[-2000:])
        assert "no dataset at" in one_error_line(p, command)
    assert not (run / "checkpoints").exists() and not list(tmp_path.glob("demo/*.wav"))
