"""infer/onnx_runtime.py: an exported model runs with onnxruntime and numpy alone (torch made unimportable in the
child process): the same greedy transcript as PyTorch, 8 kHz input resampled by numpy, a stereo file downmixed,
a batch with its own lengths. The model is conftest's lightning_run, exported by the CLI (lightning_export)."""
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


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


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


@pytest.mark.slow
def test_exported_model_transcribes_with_onnxruntime_and_numpy_alone(lightning_run, lightning_export):
    import torch

    from shardtrain.infer.checkpoint_model import load_trained

    out, p = lightning_export
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
