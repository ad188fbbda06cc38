"""Issue 22 item 6: a Lightning run's checkpoints (named step=N.ckpt) work with transcribe, evaluate and export;
export is quiet; the exported model runs with onnxruntime and numpy alone (torch made unimportable).

The run is real: the packer packs a tone corpus, a Lightning Trainer (interop/lightning.build_trainer) trains
the tiny Conformer two steps on it in a subprocess, and every command runs as the CLI in a subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

ROOT = Path(__file__).resolve().parents[2]

FIT = '''
import dataclasses, sys
import torch
from pipelines.tiny_cpu import config
from shardtrain.interop.lightning import CTCLightningModule, ShardDataModule, build_trainer
from shardtrain.load.plan import BucketConfig
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus
from shardtrain.train.model import ModelConfig
from shardtrain.train.text import CharVocab

root = sys.argv[1]
pack(PackConfig(input=str(make_corpus(root + "/corpus", [0.5, 0.7, 0.9, 1.1], seed=5)), output=root + "/ds",
                workers=1, progress=False))
torch.set_num_threads(1)
base = config()
cfg = dataclasses.replace(
    base, stream=dataclasses.replace(base.stream, bucket=BucketConfig(max_batch_seconds=2.0, num_buckets=1,
                                                                      chunk_mb=0.05), decode_threads=1, epochs=None),
    model=ModelConfig(d_model=32, num_layers=1, num_heads=2, conv_kernel=3),
    train=dataclasses.replace(base.train, max_steps=2, val_every_steps=2, ckpt_every_steps=2, val_max_batches=1,
                              warmup_steps=1, progress=False))
dm = ShardDataModule(root + "/ds", root + "/ds", stream=cfg.stream, seed=0)
module = CTCLightningModule(cfg, CharVocab.from_index(root + "/ds").to_json())
build_trainer(cfg, root + "/run", accelerator="cpu", devices=1, enable_model_summary=False).fit(module, datamodule=dm)
'''

NO_TORCH = '''
import json, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchaudio", "torchvision"):
            raise ImportError(f"{name} is not installed on this deployment box")

sys.meta_path.insert(0, NoTorch())
import numpy as np
import soundfile as sf
from shardtrain.infer.onnx_runtime import OnnxRecognizer

rec = OnnxRecognizer(sys.argv[1])
wave, rate = sf.read(sys.argv[2], dtype="float32")
texts = rec.transcribe(wave[None, :], np.array([len(wave)]), rate)
half = rec.transcribe(wave[::2].copy(), [len(wave[::2])], rate // 2)  # 8 kHz in: resampled by numpy
lp, lengths = rec.log_probs(np.stack([wave, wave]), np.array([len(wave), len(wave) // 2]), rate)
sf.write(sys.argv[3], np.stack([wave, wave], axis=1), rate, subtype="FLOAT")  # a stereo WAV, read as the README does
st, st_rate = sf.read(sys.argv[3], dtype="float32")
stereo = rec.transcribe(st[None, :], np.array([len(st)]), st_rate)
print(json.dumps({"texts": texts, "half": half, "stereo": stereo, "channels": st.shape[1], "shape": list(lp.shape), "lengths": lengths.tolist(),
                  "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
'''


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardtrain", *args], capture_output=True, text=True, timeout=600,
                          env=_env())


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pl_export")
    p = subprocess.run([sys.executable, "-c", FIT, str(root)], capture_output=True, text=True, timeout=600,
                       env=_env(), cwd=root)
    assert p.returncode == 0, p.stderr[-4000:]
    return root


@pytest.fixture(scope="module")
def exported(lightning_run) -> tuple[Path, subprocess.CompletedProcess]:
    out = lightning_run / "model.onnx"
    return out, _cli("export", str(lightning_run / "run"), str(out))


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
def test_export_of_a_lightning_run_is_quiet(exported):
    out, p = exported
    assert p.returncode == 0 and out.is_file(), p.stderr[-3000:]
    assert "torchvision" not in p.stderr and "axis name" not in p.stderr, p.stderr[-3000:]
    assert "Warning" not in p.stderr, p.stderr[-3000:]


@pytest.mark.slow
def test_exported_model_transcribes_with_onnxruntime_and_numpy_alone(lightning_run, exported):
    import torch

    from shardtrain.infer.checkpoint_model import load_trained

    out, p = exported
    assert p.returncode == 0, p.stderr[-3000:]
    flac = sorted((lightning_run / "corpus").glob("*.flac"))[2]
    r = subprocess.run([sys.executable, "-c", NO_TORCH, str(out), str(flac), str(out.parent / "stereo.wav")],
                       capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["torch"] == []  # nothing of torch was imported (it could not be)
    wave, rate = sf.read(flac, dtype="float32")
    tm = load_trained(lightning_run / "run", device="cpu")
    want = tm.transcribe(torch.from_numpy(wave)[None], torch.tensor([len(wave)]), rate)
    assert got["texts"] == want  # the same greedy transcript as PyTorch
    assert got["channels"] == 2 and got["stereo"] == want  # a stereo file is downmixed, not a broadcast error
    assert len(got["half"]) == 1 and isinstance(got["half"][0], str)
    assert got["shape"][0] == 2 and got["lengths"][1] < got["lengths"][0]
    assert np.isfinite(got["shape"]).all()
