"""train/update.py on its own, on a tiny real model in one process: optimiser steps on one batch lower its loss,
a non-finite loss skips the update on the weights (the schedule still moves), nothing to train on is no step,
SplitLevels survive a JSON round trip and reset with the epoch."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pipelines import load_pipeline
from shardtrain.load.batch import Batch
from shardtrain.train.overrides import apply_overrides
from shardtrain.train.runstate import RunState
from shardtrain.train.schedule import augment_seed
from shardtrain.train.step import Augmenters, Collectives, StepContext
from shardtrain.train.text import CharVocab
from shardtrain.train.update import SplitLevels, StepResult, optimiser_step
from shardtrain.world import World

CPU = torch.device("cpu")
SMALL = ["model.d_model=64", "model.num_layers=1", "model.dropout=0", "train.augment=false", "train.lr=3e-3",
         "train.warmup_steps=1", "train.max_steps=100", "train.cpu_threads=1"]


def batch(texts: list[str], seconds: float = 1.0, rate: int = 16000, nan: bool = False) -> Batch:
    n = int(seconds * rate)
    waves = torch.randn(len(texts), n, generator=torch.Generator().manual_seed(0)) * 0.1
    if nan:
        waves[0, 100] = float("nan")
    return Batch(waves=waves, lengths=torch.full((len(texts),), n), keys=[f"k{i}" for i in range(len(texts))],
                 texts=texts, durations_s=torch.full((len(texts),), seconds, dtype=torch.float64),
                 sample_rate_hz=rate, epoch=0, step=0)


def setup(*extra: str):
    cfg = apply_overrides(load_pipeline("tiny_cpu"), SMALL + list(extra))
    run = RunState.build(cfg, CharVocab(list(" abc")), CPU)
    return cfg, run, StepContext(cfg, World(), CPU, Collectives(World(), CPU), Augmenters(cfg, CPU))


def step(cfg, run, ctx, micro) -> StepResult:
    res = optimiser_step(ctx, run, [(b, {}) for b in micro])
    run.step += 1
    return res


def test_the_step_context_seeds_by_batch_and_rank_and_calls_the_fault_seam_per_micro_batch():
    cfg, run, ctx = setup()
    b = batch(["abc a", "cab"])
    assert ctx.seed_of(b) == augment_seed(cfg.train.seed, 0, 0, 0)
    ranked = dataclasses.replace(ctx, world=World(rank=1, world_size=2, local_rank=1))
    assert ranked.seed_of(b) == augment_seed(cfg.train.seed, 0, 0, 1) != ctx.seed_of(b)
    calls: list[int] = []
    ctx = dataclasses.replace(ctx, fault=calls.append)
    run.step = 6
    res = step(cfg, run, ctx, [b, batch(["b c a"])])
    assert calls == [7, 7] and res.samples == 3 and res.events == []  # once per unsplit micro-batch, the next step
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.cfg = cfg  # type: ignore[misc]


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_steps_on_one_batch_lower_its_loss_and_move_the_schedule():
    cfg, run, ctx = setup()
    b = batch(["abc a", "cab", "b c a"])
    results = [step(cfg, run, ctx, [b]) for _ in range(12)]
    losses = [r.loss / r.global_tokens for r in results]
    assert results[0].global_tokens == 13 and results[0].samples == 3 and not any(r.nonfinite for r in results)
    assert losses[-1] < 0.8 * losses[0], losses
    assert run.scheduler.last_epoch == 12  # one scheduler step per optimiser step


def test_a_non_finite_loss_skips_the_update_but_not_the_schedule():
    cfg, run, ctx = setup()
    before, lr_steps = weights(run.raw_model), run.scheduler.last_epoch
    res = step(cfg, run, ctx, [batch(["abc", "cab"], nan=True)])
    assert res.nonfinite and not res.overflow
    assert all(torch.equal(a, b) for a, b in zip(before, weights(run.raw_model)))  # weights untouched
    assert all(p.grad is None for p in run.raw_model.parameters())
    assert run.scheduler.last_epoch == lr_steps + 1
    res = step(cfg, run, ctx, [batch(["abc", "cab"])])  # the next finite step trains again
    assert not res.nonfinite and not all(torch.equal(a, b) for a, b in zip(before, weights(run.raw_model)))


def test_no_sample_anywhere_is_no_step():
    cfg, run, ctx = setup()
    before, lr_steps = weights(run.raw_model), run.scheduler.last_epoch
    res = step(cfg, run, ctx, [batch([])])
    assert res.global_tokens == 0 and res.samples == 0 and res.loss == 0.0
    assert run.scheduler.last_epoch == lr_steps  # the caller does not count it; nothing moved
    assert all(torch.equal(a, b) for a, b in zip(before, weights(run.raw_model)))


def test_split_levels_round_trip_through_json_and_reset_with_the_epoch():
    s = SplitLevels()
    assert s.get(3, 1) == 1
    s.raise_to(3, 1, 4)
    s.raise_to(3, 1, 2)  # never lowered within the epoch
    s.raise_to(3, 0, 2)
    back = SplitLevels.from_json(json.loads(json.dumps(s.to_json())))
    assert back == s and back.get(3, 1) == 4 and back.get(3, 0) == 2 and back.get(3, 2) == 1
    assert back.get(4, 1) == 1 and back.parts == {}  # a new epoch plans afresh
    assert SplitLevels.from_json(None) == SplitLevels() and dataclasses.asdict(SplitLevels())["epoch"] == -1
