"""infer/checkpoint_model.py on Lightning runs (issue 22 item 6): checkpoints named step=N.ckpt work with
transcribe, evaluate and export; export is quiet. (The exported model on onnxruntime alone: test_onnx_runtime.py.)

The run is real (conftest's lightning_run): the packer packs a tone corpus, a Lightning Trainer
(interop/lightning.build_trainer) trains the tiny Conformer two steps on it in a subprocess, and every command
runs as the CLI in a subprocess. Checkpoint choice (`which="best"`) is checked on fake run folders.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import shardtrain_cli


def _cli(*args: str) -> subprocess.CompletedProcess:
    return shardtrain_cli(*args, timeout=600)


@pytest.mark.slow
def test_lightning_checkpoints_are_named_by_step_and_transcribe_and_evaluate_read_them(lightning_run):
    names = sorted(p.name for p in (lightning_run / "run" / "checkpoints").glob("*.ckpt"))
    assert "step=2.ckpt" in names and not any(n.startswith("step-step") for n in names), names
    assert any(n.startswith("best-step=2-val_loss=") for n in names), names
    run, ds = str(lightning_run / "run"), str(lightning_run / "ds")
    p = _cli("transcribe", run, ds, "--device", "cpu", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in p.stdout.splitlines()]
    assert len(rows) == 4 and all(isinstance(r["text"], str) for r in rows)
    p = _cli("transcribe", str(lightning_run / "run" / "checkpoints" / "step=2.ckpt"), ds, "--device", "cpu",
             "--no-progress")  # one .ckpt file as well as the run directory
    assert p.returncode == 0 and len(p.stdout.splitlines()) == 4, p.stderr[-3000:]
    p = _cli("evaluate", run, "--data", ds, "--json", "--which", "best", "--device", "cpu", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    assert doc["step"] == 2 and doc["checkpoint"].endswith(".ckpt")


@pytest.mark.slow
def test_export_of_a_lightning_run_is_quiet(lightning_export):
    out, p = lightning_export
    assert p.returncode == 0 and out.is_file(), p.stderr[-3000:]
    assert "torchvision" not in p.stderr and "axis name" not in p.stderr, p.stderr[-3000:]
    assert "Warning" not in p.stderr, p.stderr[-3000:]


def _fake_run(root, val_losses: dict) -> None:
    """checkpoints/step_NNNNNN/{meta.json, model.pt} with the given val_loss per step (find_checkpoint reads no more)."""
    for step, v in val_losses.items():
        d = root / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"step": step, "val_loss": v}))  # NaN is written as `NaN`
        (d / "model.pt").write_bytes(b"")


def test_best_checkpoint_is_never_one_whose_val_loss_is_nan(tmp_path):
    from shardtrain.infer.checkpoint_model import CheckpointError, find_checkpoint

    _fake_run(tmp_path / "run", {50: float("nan"), 100: 0.5, 150: 0.3, 200: None})
    assert find_checkpoint(tmp_path / "run", "best").name == "step_000150"  # not the diverged step 50
    assert find_checkpoint(tmp_path / "run", "latest").name == "step_000200"
    _fake_run(tmp_path / "nan", {50: float("nan")})
    with pytest.raises(CheckpointError, match="non-NaN"):
        find_checkpoint(tmp_path / "nan", "best")
