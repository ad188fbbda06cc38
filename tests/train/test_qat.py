"""train/qat.py: fake quantization hand-checked (int8 weight levels, uint8 activations that keep 0 exact), gradients
straight through, and enable/disable that keep the state_dict (a QAT run exported to int8:
tests/infer/test_infer.py)."""
from __future__ import annotations

import torch
from torch import nn

from shardtrain.train.qat import QATLinear, disable_qat, enable_qat, fake_quant_activation, fake_quant_weight


def test_weight_levels_are_symmetric_int8():
    w = torch.randn(64, 32)
    q = fake_quant_weight(w)
    scale = w.abs().max() / 127
    levels = torch.round(q / scale)
    assert torch.allclose(levels * scale, q, atol=1e-6) and levels.abs().max() == 127
    assert (q - w).abs().max() <= scale / 2 + 1e-6


def test_activation_range_keeps_zero_and_has_256_levels():
    x = torch.linspace(0.5, 3.0, 1000)  # all positive: the range is extended down to 0
    q = fake_quant_activation(x)
    assert len(torch.unique(q)) <= 256 and (q - x).abs().max() <= 3.0 / 255 / 2 + 1e-6
    relu_out = torch.relu(torch.randn(4096))
    assert (fake_quant_activation(relu_out)[relu_out == 0] == 0).all()  # zeros stay exactly zero


def test_enable_disable_keep_parameters_and_gradients_flow():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4), nn.MultiheadAttention(4, 1))
    keys = list(model.state_dict())
    x = torch.randn(8, 16)
    ref = model[:3](x)
    assert enable_qat(model) == 2  # not attention's out_proj (NonDynamicallyQuantizableLinear)
    assert isinstance(model[0], QATLinear) and type(model[3].out_proj) is not QATLinear
    assert list(model.state_dict()) == keys
    out = model[:3](x)
    assert not torch.equal(out, ref) and torch.allclose(out, ref, atol=0.05)
    out.sum().backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.abs().sum() > 0
    assert disable_qat(model) == 2 and type(model[0]) is nn.Linear
    assert torch.equal(model[:3](x), ref)
