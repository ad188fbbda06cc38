"""Resuming on another world size: what happens to the global batch, the learning rate and the data.

A checkpoint written by W processes can be resumed by any W' (torchrun --nnodes=1:4 after losing a node):

- Data: every rank's loader state is the same cursor (epoch, step, chain). The loader re-plans the rest of the
  epoch for W' ranks, excluding the rows consumed under W (load/loader.py, `chain`), so the epoch still delivers
  every sample exactly once; the next epoch is planned for W' from the start.
- Model, optimiser, scheduler and scaler: rank 0's copies, as on any resume (DDP keeps them identical).
- RNG: ranks that existed before restore their own streams; new ranks start from (seed, rank, step).
- Global batch = W x grad_accum_steps x the per-rank budget (stream.bucket.max_batch_seconds, unchanged). The
  policy `train.elastic_batch` decides how the step responds when W changes:
    "accumulate" (default): grad_accum_steps becomes round(W x accum / W') (at least 1), so the global batch stays
      as close as it can to the checkpoint's; the learning rate is scaled by the ratio that remains (linear
      scaling rule: new global / old global). 2 -> 1 process doubles accumulation at the same lr; 2 -> 3
      keeps accumulation 1 and scales lr by 3/2.
    "scale_lr": grad_accum_steps as configured; lr scaled linearly with the global batch.
    "none": grad_accum_steps and lr as configured (the global batch simply changes).
  The scaling multiplies the scheduler's base learning rates, so warm-up and cosine decay continue from the
  same step with the new peak; max_steps still counts optimiser steps (a smaller global batch sees less audio
  by max_steps). The decision is logged and written to metrics.jsonl as an "elastic" row.
Cost: nothing per step; a resume on W' plans the interrupted epoch once per earlier world size in its chain.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from shardtrain.train.config import RunConfig

log = logging.getLogger(__name__)

POLICIES = ("accumulate", "scale_lr", "none")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    old_world_size: int
    old_accum: int
    world_size: int
    accum: int
    lr_scale: float
    """Multiplier applied to the learning rate at this resume (1.0 when nothing changed)."""

    def row(self, step: int) -> dict:
        return {"step": step, "event": "elastic", "old_world_size": self.old_world_size,
                "old_grad_accum_steps": self.old_accum, "world_size": self.world_size,
                "grad_accum_steps": self.accum, "lr_scale": self.lr_scale}


def decide(meta: dict, cfg: RunConfig, world_size: int) -> Decision | None:
    """How to resume a checkpoint with `meta` (its world size and accumulation) on `world_size` processes;
    None when the world size is unchanged (the configuration is used as given)."""
    old_ws = int(meta["world_size"])
    old_accum = int(meta.get("grad_accum_steps", meta.get("config", {}).get("train", {}).get("grad_accum_steps", 1)))
    policy, accum = cfg.train.elastic_batch, cfg.train.grad_accum_steps
    if old_ws == world_size:
        # a run that an earlier resize gave another accumulation keeps it through later same-size restarts
        if meta.get("elastic_accum") and policy == "accumulate" and old_accum != accum:
            return Decision(old_world_size=old_ws, old_accum=old_accum, world_size=world_size, accum=old_accum,
                            lr_scale=1.0)
        return None
    if policy == "accumulate":
        accum = max(1, round(old_ws * old_accum / world_size))
    scale = 1.0 if policy == "none" else (world_size * accum) / (old_ws * old_accum)
    return Decision(old_world_size=old_ws, old_accum=old_accum, world_size=world_size, accum=accum, lr_scale=scale)


def apply(cfg: RunConfig, decision: Decision, optimizer: torch.optim.Optimizer,
          scheduler: torch.optim.lr_scheduler.LRScheduler) -> RunConfig:
    """Scale the restored optimiser/scheduler learning rates and return the config with the new accumulation."""
    if decision.lr_scale != 1.0:
        for group in optimizer.param_groups:
            group["lr"] *= decision.lr_scale
            if "initial_lr" in group:
                group["initial_lr"] *= decision.lr_scale
        scheduler.base_lrs = [b * decision.lr_scale for b in scheduler.base_lrs]
    log.warning("elastic resume: world size %d -> %d; grad_accum_steps %d -> %d (policy %s), learning rate x%.4g; "
                "global batch %d -> %d x the per-rank budget", decision.old_world_size, decision.world_size,
                decision.old_accum, decision.accum, cfg.train.elastic_batch, decision.lr_scale,
                decision.old_world_size * decision.old_accum, decision.world_size * decision.accum)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=decision.accum))
