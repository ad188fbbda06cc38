"""Baseline CTC model: shapes, padding invariance, activation checkpointing, the factory protocol. (Text utilities:
test_text.py.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from shardtrain.train.model import SIZES, CTCModel, ModelConfig, SpeechModel, build_model, num_parameters, subsampled_lengths

SMALL = ModelConfig(d_model=32, num_layers=2, num_heads=2, conv_kernel=5, dropout=0.0)


def _batch(lengths, n_mels=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(len(lengths), max(lengths), n_mels, generator=g)
    lengths = torch.tensor(lengths)
    targets = torch.randint(1, 10, (int(sum(3 for _ in lengths)),), generator=g)
    return feats, lengths, targets, torch.full((len(lengths),), 3)


def test_sizes_span_tiny_to_base():
    assert 1e6 < num_parameters(build_model(SIZES["tiny"], 32, 80)) < 5e6  # CPU-trainable
    assert 20e6 < num_parameters(build_model(SIZES["base"], 32, 80)) < 80e6  # "tens of millions"


@pytest.mark.parametrize("encoder", ["conformer", "transformer"])
def test_output_shapes_and_lengths(encoder):
    m = build_model(dataclasses.replace(SMALL, encoder=encoder), 10, 20).eval()
    feats, lengths, targets, tlen = _batch([100, 61, 37])
    loss, log_probs, out_lengths = m(feats, lengths, targets, tlen)
    assert out_lengths.tolist() == [24, 14, 8] == subsampled_lengths(lengths).tolist()
    assert log_probs.shape == (3, 24, 10) and log_probs.dtype == torch.float32
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(3, 24), atol=1e-5)
    assert loss.ndim == 0 and torch.isfinite(loss) and loss > 0


@pytest.mark.parametrize("encoder", ["conformer", "transformer"])
def test_padding_never_changes_valid_outputs(encoder):
    """An utterance gives the same outputs alone and padded inside a batch (needed for DDP/world-size parity)."""
    torch.manual_seed(0)
    m = build_model(dataclasses.replace(SMALL, encoder=encoder), 10, 20).eval()
    feats, lengths, targets, tlen = _batch([120, 50])
    _, batched, out_len = m(feats, lengths, targets, tlen)
    garbage = feats.clone()
    garbage[1, 50:] = 1e3  # padding content must not matter either
    _, batched2, _ = m(garbage, lengths, targets, tlen)
    _, alone, alone_len = m(feats[1:, :50], lengths[1:], targets[3:], tlen[1:])
    n = int(out_len[1])
    assert n == int(alone_len[0])
    assert torch.allclose(batched[1, :n], alone[0, :n], atol=1e-5)
    assert torch.allclose(batched2[1, :n], alone[0, :n], atol=1e-5)


def test_activation_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    plain = build_model(SMALL, 10, 20)
    ckpt = build_model(dataclasses.replace(SMALL, activation_checkpointing=True), 10, 20)
    ckpt.load_state_dict(plain.state_dict())
    feats, lengths, targets, tlen = _batch([90, 70])
    for m in (plain, ckpt):
        m(feats, lengths, targets, tlen)[0].backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name


def test_user_model_factory_must_follow_protocol():
    m = build_model(dataclasses.replace(SMALL, factory="shardtrain.train.model:CTCModel"), 10, 20)
    assert isinstance(m, CTCModel) and isinstance(m, SpeechModel)
    with pytest.raises(TypeError, match="model.factory"):
        build_model(dataclasses.replace(SMALL, factory="torch.nn:Identity"), 10, 20)
    with pytest.raises(ValueError, match="model.num_heads"):
        ModelConfig(d_model=30, num_heads=4)
