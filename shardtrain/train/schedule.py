"""What depends only on the step: the learning-rate schedule, the augmentation seed, and the AdamW they drive.

Pure functions, shared by the trainer (train/trainer.py), `shardtrain tune` (tune.py) and the Lightning module
(interop/lightning.py), so an integration reuses the schedule without importing the training loop.
"""
from __future__ import annotations

import hashlib
import math

import torch

from shardtrain.train.config import TrainConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr after `step` optimiser steps: linear warm-up, then cosine down to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def augment_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """Augmentation seed of one micro-batch: stable across runs and resumes, distinct per rank and batch."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (biases and norm scales are not decayed, as in nanoGPT)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
