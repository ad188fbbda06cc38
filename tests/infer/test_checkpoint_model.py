"""infer/checkpoint_model.py on Lightning runs (issue 22 item 6): checkpoints named step=N.ckpt work with
transcribe, evaluate and export; export is quiet. (The exported model on onnxruntime alone: test_onnx_runtime.py.)

The run is real (conftest's lightning_run): the packer packs a tone corpus, a Lightning Trainer
(interop/lightning.build_trainer) trains the tiny Conformer two steps on it in a subprocess, and every command
runs as the CLI in a subprocess.
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
