"""load/batch.py: the Batch the loader yields and the int16 -> float32 conversion the trainer and `bench` share
(the loader producing them: tests/load/test_pcm_dtype.py, tests/load/test_stream.py)."""
from __future__ import annotations

import numpy as np
import torch

from shardtrain.load.batch import Batch, pcm_to_float


def test_pcm_to_float_is_exact_and_float_passes_through():
    pcm = torch.tensor([[-32768, -1, 0, 1, 32767]], dtype=torch.int16)
    out = pcm_to_float(pcm)
    assert out.dtype == torch.float32 and out.tolist() == [[-1.0, -1 / 32768, 0.0, 1 / 32768, 32767 / 32768]]
    f = torch.rand(2, 3)
    assert pcm_to_float(f) is f


def test_batch_moves_tensors_and_keeps_host_fields():
    b = Batch(waves=torch.zeros(2, 4, dtype=torch.int16), lengths=torch.tensor([4, 2]), keys=["a", "b"],
              texts=["x", "y"], durations_s=torch.tensor([0.25, 0.125]), sample_rate_hz=16, epoch=1, step=3,
              rows=np.array([7, 9]), sources=np.array([0, 1], np.int16))
    assert len(b) == 2 and b.planned == -1
    moved = b.to("cpu")
    assert moved is not b and moved.keys is b.keys and moved.rows is b.rows
    assert torch.equal(moved.lengths, b.lengths) and (moved.epoch, moved.step) == (1, 3)
    empty = Batch(waves=torch.zeros(0, 0), lengths=torch.zeros(0, dtype=torch.int64), keys=[], texts=[],
                  durations_s=torch.zeros(0), sample_rate_hz=16000, epoch=0, step=0, planned=2)
    assert len(empty) == 0 and empty.rows.shape == (0,) and empty.planned == 2
