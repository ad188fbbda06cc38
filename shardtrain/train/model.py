"""The baseline CTC recogniser and the protocol any user model follows to plug into the trainer.

    feats [B, F, n_mels] + feat_lengths [B]
      -> zero frames past each length (so padding never leaks into valid frames, whatever the batch)
      -> ConvSubsampling: two 3x3 stride-2 convs (4x fewer frames)            -> [B, F', d_model]
      -> + sinusoidal positions -> N x (Conformer | pre-norm Transformer | BiLSTM) blocks with a padding mask
      -> LayerNorm -> Linear(vocab) -> log_softmax                             -> log_probs [B, F', V]
      -> CTC loss, summed over the batch (the trainer divides by the global token count)

Design choices:
- The loss is returned *summed*, not averaged: with dynamic batches the trainer must divide by the number of
  target tokens across all ranks and accumulation steps, which only it knows.
- The Conformer convolution module uses LayerNorm, not BatchNorm: batch statistics would mix padding and other
  utterances into each output, so results would depend on how a batch was cut (and on world size).
- Positions are absolute sinusoids added once (not relative attention): simpler, and good enough for a
  baseline; a user who wants more plugs in their own model through `SpeechModel` / `ModelConfig.factory`.
- The BiLSTM encoder (the seed trainer's CNN + BiLSTM) runs each direction as its own one-way LSTM; the
  backward one reads every utterance reversed *within its length* (a gather), so padding never enters a valid
  frame's state and the result does not depend on the batch. Unlike pack_padded_sequence, this exports to ONNX
  with dynamic batch and time axes.
- Activation checkpointing (per block, non-reentrant) trades ~30% more compute for storing one activation per
  block instead of all intermediate ones.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardtrain.train.text import greedy_decode


ENCODERS = ("conformer", "transformer", "bilstm")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    encoder: str = "conformer"
    """Encoder block: "conformer", "transformer" (pre-norm) or "bilstm" (d_model/2 units per direction)."""
    d_model: int = 144
    """Width of the encoder."""
    num_layers: int = 4
    """Encoder blocks."""
    num_heads: int = 4
    """Attention heads; must divide d_model."""
    ff_mult: int = 4
    """Feed-forward hidden size = ff_mult x d_model."""
    conv_kernel: int = 15
    """Depthwise convolution kernel of the Conformer conv module (frames after subsampling, odd)."""
    dropout: float = 0.1
    """Dropout in attention, feed-forward and after subsampling; 0 makes training deterministic per batch."""
    activation_checkpointing: bool = False
    """Recompute each block in backward instead of storing its activations (less memory, ~30% more compute)."""
    factory: str = ""
    """"package.module:function" building a user model `f(cfg, vocab_size, n_mels) -> SpeechModel`; empty = baseline."""

    def __post_init__(self) -> None:
        if self.encoder not in ENCODERS:
            raise ValueError(f"model.encoder must be one of {ENCODERS}, got {self.encoder!r}")
        if self.encoder == "bilstm" and self.d_model % 2:
            raise ValueError(f"model.d_model must be even for model.encoder=bilstm, got {self.d_model}")
        if self.encoder != "bilstm" and self.d_model % self.num_heads:
            raise ValueError(f"model.num_heads ({self.num_heads}) must divide model.d_model ({self.d_model})")
        if self.conv_kernel % 2 == 0:
            raise ValueError("model.conv_kernel must be odd")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError("model.dropout must be in [0, 1)")
        if self.factory and ":" not in self.factory:
            raise ValueError("model.factory must look like 'package.module:function'")


SIZES: dict[str, ModelConfig] = {
    # ~2.2M parameters: trains on 2 CPU cores in minutes.
    "tiny": ModelConfig(encoder="conformer", d_model=144, num_layers=4, num_heads=4, conv_kernel=15),
    # ~41M parameters: a GPU baseline for LibriSpeech-sized corpora.
    "base": ModelConfig(encoder="conformer", d_model=384, num_layers=12, num_heads=6, conv_kernel=31),
}


@runtime_checkable
class SpeechModel(Protocol):
    """What the training loop needs from a model. Everything else (layers, loss) is the model's business.

    `forward` computes the loss inside the module so DistributedDataParallel sees one forward per step.
    """

    def forward(self, feats: torch.Tensor, feat_lengths: torch.Tensor, targets: torch.Tensor,
                target_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (loss summed over the batch [] float32, outputs [B, T', ...], output_lengths [B])."""
        ...

    def decode(self, outputs: torch.Tensor, output_lengths: torch.Tensor) -> list[list[int]]:
        """Token ids per utterance (no blanks), for CER/WER."""
        ...

    # Optional: `output_lengths(feat_lengths) -> [B]` output frames per utterance. With it, targets CTC cannot
    # align are dropped (and counted) before the loss (train/guards.py); without it they only add zero loss.


def subsampled_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Frames after two unpadded 3x3 stride-2 convolutions: L -> (L-1)//2 -> ((L-1)//2 - 1)//2."""
    return (((lengths - 1) // 2) - 1) // 2


def padding_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """True where a frame is padding: [B, max_len]."""
    return torch.arange(max_len, device=lengths.device)[None, :] >= lengths[:, None]


class ConvSubsampling(nn.Module):
    def __init__(self, n_mels: int, d_model: int, channels: int = 64) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, channels, 3, stride=2), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride=2), nn.ReLU(),
        )
        self.out = nn.Linear(channels * (((n_mels - 1) // 2 - 1) // 2), d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, F, n_mels] -> [B, F', d_model]
        x = self.conv(x.unsqueeze(1))  # [B, C, F', M']
        b, c, t, m = x.shape
        return self.out(x.transpose(1, 2).reshape(b, t, c * m))


def sinusoids(length: int, d: int, device: torch.device) -> torch.Tensor:
    pos = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, d, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(length, d, device=device)
    pe[:, 0::2] = torch.sin(pos * inv)
    pe[:, 1::2] = torch.cos(pos * inv)
    return pe


class FeedForward(nn.Module):
    def __init__(self, d: int, mult: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d * mult), nn.SiLU(), nn.Dropout(dropout),
                                 nn.Linear(d * mult, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvModule(nn.Module):
    """Conformer convolution module with LayerNorm in place of BatchNorm (see module docstring)."""

    def __init__(self, d: int, kernel: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.pointwise_in = nn.Linear(d, 2 * d)
        self.depthwise = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d)
        self.mid_norm = nn.LayerNorm(d)
        self.pointwise_out = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        y = F.glu(self.pointwise_in(self.norm(x)), dim=-1)
        y = y.masked_fill(pad[..., None], 0.0)  # padding must not reach valid frames through the kernel
        y = self.depthwise(y.transpose(1, 2)).transpose(1, 2)
        y = self.pointwise_out(F.silu(self.mid_norm(y)))
        return self.drop(y)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        y, _ = self.attn(y, y, y, key_padding_mask=pad, need_weights=False)
        return self.drop(y)


class ConformerBlock(nn.Module):
    """FFN/2 -> MHSA -> Conv -> FFN/2 -> LayerNorm (Gulati et al. 2020), all residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.ff1 = FeedForward(d, cfg.ff_mult, cfg.dropout)
        self.attn = Attention(d, cfg.num_heads, cfg.dropout)
        self.conv = ConvModule(d, cfg.conv_kernel, cfg.dropout)
        self.ff2 = FeedForward(d, cfg.ff_mult, cfg.dropout)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.ff1(x)
        x = x + self.attn(x, pad)
        x = x + self.conv(x, pad)
        x = x + 0.5 * self.ff2(x)
        return self.norm(x)


class TransformerBlock(nn.Module):
    """Pre-norm Transformer encoder block: MHSA -> FFN, both residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg.d_model, cfg.num_heads, cfg.dropout)
        self.ff = FeedForward(cfg.d_model, cfg.ff_mult, cfg.dropout)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, pad)
        return x + self.ff(x)


def reverse_padded(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Reverse each row's first `lengths[b]` frames of [B, T, D]; padding frames stay where they are."""
    t = torch.arange(x.shape[1], device=x.device)[None, :]
    n = lengths[:, None]
    idx = torch.where(t < n, n - 1 - t, t)
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[2]))


class BiLSTMBlock(nn.Module):
    """Pre-norm residual bidirectional LSTM: x + Dropout([LSTM_fwd(y); rev(LSTM_bwd(rev(y)))]), y = LayerNorm(x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        half = cfg.d_model // 2
        self.norm = nn.LayerNorm(cfg.d_model)
        self.fwd = nn.LSTM(cfg.d_model, half, batch_first=True)
        self.bwd = nn.LSTM(cfg.d_model, half, batch_first=True)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        lengths = (~pad).sum(1)
        y = self.norm(x)
        f, _ = self.fwd(y)
        b, _ = self.bwd(reverse_padded(y, lengths))
        return x + self.drop(torch.cat([f, reverse_padded(b, lengths)], dim=-1))


BLOCKS: dict[str, type[nn.Module]] = {"conformer": ConformerBlock, "transformer": TransformerBlock,
                                      "bilstm": BiLSTMBlock}


class CTCModel(nn.Module):
    """Conv subsampling + encoder + linear CTC head. Implements `SpeechModel`."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, n_mels: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.subsample = ConvSubsampling(n_mels, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        block = BLOCKS[cfg.encoder]
        self.blocks = nn.ModuleList(block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab_size)

    def encode(self, feats: torch.Tensor, feat_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (log_probs [B, F', V] float32, out_lengths [B])."""
        feats = feats.masked_fill(padding_mask(feat_lengths, feats.shape[1])[..., None], 0.0)
        x = self.subsample(feats)
        out_lengths = subsampled_lengths(feat_lengths).clamp(min=0)
        pad = padding_mask(out_lengths, x.shape[1])
        x = self.drop(x + sinusoids(x.shape[1], x.shape[2], x.device).to(x.dtype))
        for blk in self.blocks:
            if self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(blk, x, pad, use_reentrant=False)
            else:
                x = blk(x, pad)
            x = x.masked_fill(pad[..., None], 0.0)
        logits = self.head(self.norm(x))
        return F.log_softmax(logits.float(), dim=-1), out_lengths

    def output_lengths(self, feat_lengths: torch.Tensor) -> torch.Tensor:
        """Output frames per utterance for these feature lengths (what CTC can align a target in; guards.py)."""
        return subsampled_lengths(feat_lengths).clamp(min=0)

    def forward(self, feats: torch.Tensor, feat_lengths: torch.Tensor, targets: torch.Tensor,
                target_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        log_probs, out_lengths = self.encode(feats, feat_lengths)
        # ctc_loss wants [T, B, V]; zero_infinity drops utterances too short for their transcript instead of
        # turning the whole step into inf/NaN (they contribute 0 loss and 0 gradient).
        loss = F.ctc_loss(log_probs.transpose(0, 1), targets, out_lengths, target_lengths, blank=0,
                          reduction="sum", zero_infinity=True)
        return loss, log_probs, out_lengths

    def decode(self, outputs: torch.Tensor, output_lengths: torch.Tensor) -> list[list[int]]:
        return greedy_decode(outputs, output_lengths)


def build_model(cfg: ModelConfig, vocab_size: int, n_mels: int) -> nn.Module:
    """The baseline, or the user's model named by `cfg.factory` (checked against `SpeechModel`)."""
    if not cfg.factory:
        return CTCModel(cfg, vocab_size, n_mels)
    mod_name, fn_name = cfg.factory.split(":", 1)
    model = getattr(importlib.import_module(mod_name), fn_name)(cfg, vocab_size, n_mels)
    if not isinstance(model, nn.Module) or not isinstance(model, SpeechModel):
        raise TypeError(f"model.factory {cfg.factory!r} must return an nn.Module with forward() and decode()")
    return model


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__: Sequence[str] = ("ModelConfig", "SIZES", "SpeechModel", "CTCModel", "build_model", "num_parameters")
