"""What one batch needs on the device, shared by the training step and validation.

    StepContext: what every step of a run shares (config, world, device, collectives, augmenters, budget table,
      memory meter, in-step fault seam): the Trainer's one home for them, replaced when the closed loop moves the table
    Batch (CPU, pinned) -> to_device (targets via the tokenizer; B=0 -> a silent dummy) -> Augmenters (one
    DeviceAugment per input rate) -> model under `autocast` -> evaluate: loss, greedy CTC decode, CER/WER sums
    -> Collectives.sum (one all-reduce) -> per-token loss and error rates over every rank's share of the set.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from shardtrain.train.augment import DeviceAugment
from shardtrain.load.batch import Batch, pcm_to_float
from shardtrain.train.schedule import augment_seed
from shardtrain.train.text import encode_batch
from shardtrain.world import World

if TYPE_CHECKING:
    from shardtrain.train.budget import Table
    from shardtrain.train.config import RunConfig, TrainConfig
    from shardtrain.train.memory import MemoryMeter


class Collectives:
    """The few collectives the loop needs; no-ops in a single process."""

    def __init__(self, world: World, device: torch.device) -> None:
        self.on = world.world_size > 1
        self.device = device

    def sum(self, values: list[float]) -> list[float]:
        """All-reduce a few scalars (a sync point: one small collective, and a device->host copy)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.on:
            dist.all_reduce(t)
        return t.tolist()

    def max(self, values: list[float]) -> list[float]:
        """All-reduce (max) a few scalars: what every rank must agree on, e.g. per-bucket peak memory."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.on:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """Whether any rank's `flag` is set (one all-reduce): what a checkpoint's save and load stages agree on, so
        a failure on one rank is a failure on all (train/checkpoint.py `agree`)."""
        return self.max([float(flag)])[0] > 0

    def barrier(self) -> None:
        if self.on:
            dist.barrier()


class Augmenters:
    """One DeviceAugment per input sample rate (built on first use, kept on the device)."""

    def __init__(self, cfg: RunConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self._by_rate: dict[int, DeviceAugment] = {}

    def __call__(self, waves, lengths, rate_hz: int, generator, train: bool):
        if rate_hz not in self._by_rate:
            self._by_rate[rate_hz] = DeviceAugment(self.cfg.augment, self.cfg.features, rate_hz).to(self.device)
        return self._by_rate[rate_hz](waves, lengths, generator, train=train)


def _no_fault(step: int) -> None:
    return None


@dataclass(frozen=True, slots=True)
class StepContext:
    """What the optimiser step (train/update.py) and validation (train/evaluate.py) take from the run besides its
    state and the batches, and the Trainer's only home for them: constant over a run, except `cfg` and `table`,
    which the closed loop moves between epochs (the Trainer then replaces it with dataclasses.replace; that costs
    nothing, the rest is shared)."""

    cfg: RunConfig
    world: World
    device: torch.device
    comm: Collectives
    augmenters: Augmenters
    table: Table | None = None
    """The budget table the epoch was planned with (closedloop.py): which bucket a micro-batch's peak counts for."""
    meter: MemoryMeter | None = None
    """Peak memory per micro-batch (train/memory.py), when the closed loop or a memory limit needs it."""
    fault: Callable[[int], None] = _no_fault
    """The in-step fault seam (shardtrain/faults.py), called with the step number before the forward of each
    unsplit first attempt."""

    def seed_of(self, batch: Batch) -> int:
        """The augmentation seed of `batch`: (seed, epoch, step, rank) alone, so a resumed run draws the same."""
        return augment_seed(self.cfg.train.seed, batch.epoch, batch.step, self.world.rank)


def to_device(batch, device: torch.device, tok) -> tuple[torch.Tensor, ...]:
    """Batch -> (waves, lengths, targets, target_lengths) on device; an empty batch becomes a silent dummy.

    Targets are encoded on the CPU, so their count (`targets.numel()` before the copy, or the length of the
    returned targets) never needs a device sync."""
    if len(batch) == 0:
        n = batch.sample_rate_hz // 2
        waves, lengths = torch.zeros(1, n), torch.tensor([n])
        targets, target_lengths = torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    else:
        waves, lengths = batch.waves, batch.lengths
        targets, target_lengths = encode_batch(tok, batch.texts)
    nb = device.type == "cuda"
    waves = pcm_to_float(waves.to(device, non_blocking=nb))  # int16 batches: half the host bytes
    return (waves, lengths.to(device, non_blocking=nb),
            targets.to(device, non_blocking=nb), target_lengths.to(device, non_blocking=nb))


def autocast(cfg: TrainConfig, device: torch.device):
    if cfg.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if cfg.precision == "bf16" else torch.float16)
