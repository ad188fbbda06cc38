"""Quantization-aware training for the int8 model that `shardtrain export --quantize int8` produces.

    nn.Linear (x [.., in]) -> QATLinear: F.linear(fq_uint8(x), fq_int8(W), b)
      fq_int8(W):   symmetric per-tensor int8, scale = max|W| / 127          (ONNX Runtime's dynamic-quant weights)
      fq_uint8(x):  asymmetric per-tensor uint8 from this tensor's min/max   (ONNX Runtime computes activation
                    ranges at run time, per tensor, with 0 always representable)
      gradients:    straight-through inside the range (torch.fake_quantize_per_tensor_affine, the op
                    torch.ao.quantization's FakeQuantize modules call)

Why stateless fake quantization, not torch.ao's prepare_qat with observers: the int8 target is *dynamic*
quantization, whose activation ranges are measured per call, so there is nothing to calibrate or learn; and
without observer buffers the state_dict keeps exactly the float model's keys, so a QAT checkpoint loads into
the float model (for export) and resumes like any other. Cost: a min/max reduction and a fake-quant per Linear
input and weight; measured 1.37x the float model's forward + backward time (tiny_cpu model, 8 x 5 s batch, one
CPU thread, busy machine).

What is covered: every nn.Linear the model calls as a module (feed-forward, convolution-module pointwise,
subsampling output, CTC head). Not covered: the projections inside
nn.MultiheadAttention (it reads its weights directly, not through Linear.forward) and LSTM weights; ONNX
Runtime's dynamic quantization does quantize those MatMuls, which is part of why the int8 model's CER can
still move a little (benchmarks/infer/bench_infer.py measures it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def fake_quant_weight(w: torch.Tensor) -> torch.Tensor:
    """Symmetric per-tensor int8 fake quantization (levels -127..127, zero point 0)."""
    scale = (w.detach().abs().amax().float() / 127.0).clamp_min(1e-8)
    return torch.fake_quantize_per_tensor_affine(w, scale, torch.zeros((), dtype=torch.int32, device=w.device),
                                                 -127, 127)


def fake_quant_activation(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric per-tensor uint8 fake quantization over the tensor's own range (always including 0)."""
    lo = x.detach().amin().float().clamp(max=0.0)
    hi = x.detach().amax().float().clamp(min=0.0)
    scale = ((hi - lo) / 255.0).clamp_min(1e-8)
    zero = torch.round(-lo / scale).clamp(0, 255).to(torch.int32)
    return torch.fake_quantize_per_tensor_affine(x, scale, zero, 0, 255)


class QATLinear(nn.Linear):
    """nn.Linear whose input and weight are fake-quantized in every forward (training and eval)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(fake_quant_activation(x), fake_quant_weight(self.weight), self.bias)


def enable_qat(model: nn.Module) -> int:
    """Turn every plain nn.Linear in `model` into a QATLinear in place (same parameters, same state_dict keys);
    returns how many. Call before moving to the device and building the optimiser (the parameters are kept)."""
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear:  # not NonDynamicallyQuantizableLinear (attention's out_proj) nor subclasses
            mod.__class__ = QATLinear
            n += 1
    return n


def disable_qat(model: nn.Module) -> int:
    """Back to plain nn.Linear (e.g. to export the float graph that ONNX Runtime then quantizes)."""
    n = 0
    for mod in model.modules():
        if type(mod) is QATLinear:
            mod.__class__ = nn.Linear  # type: ignore[assignment]
            n += 1
    return n
