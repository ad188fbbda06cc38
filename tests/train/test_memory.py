"""train/memory.py: the CPU memory model (parameters, gradients, optimiser state, activations saved for backward)
measured on a real model and hand-checked, and what counts as out of memory."""
from __future__ import annotations

import torch

from shardtrain.train.memory import MemoryMeter, is_oom, state_bytes, total_bytes


def test_state_bytes_counts_params_grads_and_optimiser_state():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 5))
    n = sum(p.numel() for p in model.parameters())  # 220 + 105
    assert state_bytes(model, None) == 2 * 4 * n  # parameters + their gradients, float32
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 10)).sum().backward()
    opt.step()  # AdamW's exp_avg and exp_avg_sq appear (the step counters are 0-d and not counted)
    assert state_bytes(model, opt) == 4 * 4 * n
    model[1].weight.requires_grad_(False)
    assert state_bytes(model, None) == 2 * 4 * n - 4 * 100


def test_meter_peak_grows_with_the_batch_and_take_resets():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    meter = MemoryMeter(torch.device("cpu"), model, None)
    peaks = []
    for b in (4, 16):
        with meter.measure():
            model(torch.randn(b, 64)).sum().backward()
        peaks.append(meter.take())
    fixed = state_bytes(model, None)
    # saved for backward: the input [b, 64] and the activations [b, 256] (distinct storages, each counted once),
    # all proportional to the batch: 4x the rows, 4x the bytes
    act = [p - fixed for p in peaks]
    assert act[0] > 0 and abs(act[1] / act[0] - 4.0) < 0.01, (peaks, fixed)
    assert meter.take() == 0.0  # reset by the previous take


def test_is_oom_and_total_bytes():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ... out of memory"))
    assert not is_oom(RuntimeError("shape mismatch")) and not is_oom(MemoryError())
    assert 2**26 < total_bytes(torch.device("cpu")) < 2**50
