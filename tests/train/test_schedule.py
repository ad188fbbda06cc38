"""train/schedule.py: the pure functions the trainer, tune and the Lightning adapter share (learning-rate factor,
per-batch augmentation seed, AdamW with weight decay on matrices only)."""
from __future__ import annotations

import pytest
import torch

from pipelines import load_pipeline
from shardtrain.train.schedule import augment_seed, lr_factor, make_optimizer


def test_lr_schedule_warms_up_then_decays_to_floor():
    cfg = load_pipeline("tiny_cpu").train
    assert lr_factor(0, cfg) == pytest.approx(1 / cfg.warmup_steps)
    assert lr_factor(cfg.warmup_steps, cfg) == pytest.approx(1.0)
    assert lr_factor(cfg.max_steps, cfg) == pytest.approx(cfg.min_lr_ratio)
    after = [lr_factor(s, cfg) for s in range(cfg.warmup_steps, cfg.max_steps + 1)]
    assert all(a >= b for a, b in zip(after, after[1:]))  # cosine: never rises after the warm-up
    assert lr_factor(cfg.max_steps * 3, cfg) == pytest.approx(cfg.min_lr_ratio)  # past the end: the floor


def test_augment_seed_is_stable_and_distinct_per_rank_and_batch():
    seeds = {augment_seed(7, e, s, r) for e in range(3) for s in range(20) for r in range(4)}
    assert len(seeds) == 3 * 20 * 4
    assert augment_seed(7, 1, 5, 2) == augment_seed(7, 1, 5, 2)  # a resumed run draws the same
    assert augment_seed(7, 1, 5, 2) != augment_seed(8, 1, 5, 2)
    assert all(0 <= s < 2**63 for s in seeds)  # a valid torch.Generator seed


def test_optimizer_decays_matrices_only():
    cfg = load_pipeline("tiny_cpu").train
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    model[2].bias.requires_grad_(False)  # frozen parameters stay out
    opt = make_optimizer(model, cfg)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == cfg.weight_decay and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert {id(p) for p in no_decay["params"]} == {id(model[0].bias), id(model[1].weight), id(model[1].bias)}
    assert opt.defaults["lr"] == cfg.lr
