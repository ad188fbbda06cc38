"""train/elastic.py: what a resume on another world size does to accumulation and learning rate, per policy,
hand-checked (the end-to-end resume is tests/integration/test_train_elastic.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipelines import load_pipeline
from shardtrain.train.elastic import apply, decide


def cfg(policy: str = "accumulate", accum: int = 1):
    c = load_pipeline("tiny_cpu")
    return dataclasses.replace(c, train=dataclasses.replace(c.train, elastic_batch=policy, grad_accum_steps=accum))


@pytest.mark.parametrize("policy,old,new,accum,scale", [
    ("accumulate", 2, 1, 2, 1.0),      # 2 -> 1 process: twice the accumulation, same global batch and lr
    ("accumulate", 2, 3, 1, 1.5),      # 2 -> 3: accumulation stays 1, lr scaled by the global batch ratio
    ("scale_lr", 4, 2, 1, 0.5),
    ("none", 4, 2, 1, 1.0),
])
def test_decisions_hand_checked(policy, old, new, accum, scale):
    d = decide({"world_size": old, "grad_accum_steps": 1}, cfg(policy), new)
    assert (d.accum, d.lr_scale) == (accum, pytest.approx(scale))
    assert d.row(7) == {"step": 7, "event": "elastic", "old_world_size": old, "old_grad_accum_steps": 1,
                        "world_size": new, "grad_accum_steps": accum, "lr_scale": pytest.approx(scale)}


def test_same_world_size_keeps_the_config_unless_an_earlier_resize_changed_accumulation():
    assert decide({"world_size": 2, "grad_accum_steps": 1}, cfg(), 2) is None
    d = decide({"world_size": 2, "grad_accum_steps": 3, "elastic_accum": True}, cfg(), 2)
    assert (d.accum, d.lr_scale) == (3, 1.0)


def test_apply_scales_optimiser_and_scheduler_and_sets_accumulation():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    d = decide({"world_size": 2, "grad_accum_steps": 1}, cfg("scale_lr"), 4)
    out = apply(cfg("scale_lr"), d, opt, sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3) and sched.base_lrs == [pytest.approx(2e-3)]
    assert out.train.grad_accum_steps == d.accum
