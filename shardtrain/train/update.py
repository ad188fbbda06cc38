"""One optimiser step over a step's micro-batches, and surviving an out-of-memory error inside it.

    micro-batches -> targets, ONE all-reduce of (tokens, samples) -> augment each micro-batch once (no_grad)
      -> per micro-batch, in `parts` pieces (1 unless this bucket ran out of memory earlier in the epoch):
         forward + backward of loss_sum x world_size / global_tokens, gradients accumulating locally
      -> all-reduce of the OOM flags (every rank, every round)      -- an OOM anywhere: that rank frees what it
         can, zeroes its gradients and redoes its micro-batches with the failed one in twice as many parts;
         ranks without an OOM keep their gradients and only take part in the next flag all-reduce
      -> gradient all-reduce once (averaged, as DDP does) -> unscale, clip, optimiser step, scheduler

Why the gradients are all-reduced after backward instead of by DDP's hooks during it: DDP starts bucket
all-reduces inside backward, so a rank that fails in its forward or backward cannot withdraw and its peers wait
in a collective it never joins (a hang until the NCCL/gloo timeout). Running backward unsynchronised and agreeing
on the flags first makes every rank take the same decision; the cost is that the gradient all-reduce no longer
overlaps backward (one bucketed all-reduce of the gradients per step, like DDP's, but after it). With
`budget.oom_split=false` the step is the DDP one (no_sync on all but the last micro-batch) and an OOM stops the run.

A split piece is trimmed to its own longest utterance; CTC losses are summed per utterance and the model masks
padding, so the pieces' losses and gradients add up to the unsplit step's (floating-point order aside). The
augmentation ran once on the whole micro-batch, so a split draws no other randomness. No sample is dropped: a
piece that is one utterance and still does not fit raises on every rank together.

What the step takes: the run's StepContext (train/step.py: config, world, device, collectives, augmenters, budget
table, memory meter, fault seam), the run state (model, optimiser, scaler, step, OOM split levels) and the
micro-batches; the helpers below pass the same three, plus what the step has computed so far.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from shardtrain.load.batch import Batch
from shardtrain.train.budget import bucket_of
from shardtrain.train.guards import alignable, is_finite, keep_utterances
from shardtrain.train.memory import free_after_oom, is_oom
from shardtrain.train.step import StepContext, autocast, to_device

log = logging.getLogger(__name__)

GRAD_BUCKET_BYTES = 25 << 20
"""Gradient bytes per all-reduce (DDP's default bucket size)."""


@dataclass(slots=True)
class SplitLevels:
    """Parts per bucket for the rest of an epoch, raised by an OOM (the plan itself never changes mid-epoch)."""

    epoch: int = -1
    parts: dict[int, int] = field(default_factory=dict)

    def get(self, epoch: int, bucket: int) -> int:
        if epoch != self.epoch:
            self.epoch, self.parts = epoch, {}
        return self.parts.get(bucket, 1)

    def raise_to(self, epoch: int, bucket: int, parts: int) -> None:
        self.get(epoch, bucket)
        self.parts[bucket] = max(self.parts.get(bucket, 1), parts)

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "parts": {str(k): v for k, v in self.parts.items()}}

    @classmethod
    def from_json(cls, d: dict | None) -> "SplitLevels":
        d = d or {}
        return cls(int(d.get("epoch", -1)), {int(k): int(v) for k, v in d.get("parts", {}).items()})


@dataclass(slots=True)
class StepResult:
    loss: float = 0.0
    global_tokens: float = 0.0
    peaks: list[tuple[int, float]] = field(default_factory=list)
    """(bucket, peak bytes) of each of this rank's micro-batches."""
    events: list[dict] = field(default_factory=list)
    """oom_split rows (without "step"), the same on every rank."""
    samples: int = 0
    """Utterances trained on, all ranks."""
    impossible: int = 0
    """Utterances dropped before the loss, all ranks: targets CTC cannot align (guards.py)."""
    dropped: list = field(default_factory=list)
    """Per micro-batch of this rank, a bool mask of its utterances dropped before the loss (CTC cannot align), or
    None when all of them reached it; the ledger records them as not trained."""
    nonfinite: bool = False
    """The optimiser step was skipped on every rank: a NaN/Inf loss or gradient somewhere."""
    overflow: bool = False
    """fp16 only: GradScaler found an overflowing gradient with a finite loss and skipped the step (backoff)."""


@dataclass(slots=True)
class _Item:
    batch: Batch
    feats: torch.Tensor
    feat_lengths: torch.Tensor
    targets: torch.Tensor
    target_lengths: torch.Tensor
    bucket: int
    empty: bool = False
    """Nothing of this micro-batch trains (no sample, or none CTC can align): a dummy forward joins the step."""


def _prepare(ctx: StepContext, run, micro: list) -> tuple[list[_Item], list]:
    """Each micro-batch on the device, augmented (no_grad), without the utterances CTC cannot align: the items
    and per micro-batch the mask of the utterances dropped (None: none). One device->host copy of a bool per
    utterance when the model reports its output lengths (the forward needs the augmentation done anyway)."""
    items: list[_Item] = []
    dropped: list = []
    for batch, _ in micro:
        waves, lengths, targets, target_lengths = to_device(batch, ctx.device, run.tok)
        gen = torch.Generator().manual_seed(ctx.seed_of(batch))
        with torch.no_grad():
            feats, feat_lengths = ctx.augmenters(waves, lengths, batch.sample_rate_hz, gen,
                                                 train=ctx.cfg.train.augment)
        longest = float(batch.durations_s.max()) if len(batch) else 0.0
        it = _Item(batch, feats, feat_lengths, targets, target_lengths, bucket_of(ctx.table, longest),
                   len(batch) == 0)
        ok = None if it.empty else alignable(run.raw_model, feat_lengths, targets, target_lengths)
        dropped.append(None)
        if ok is not None and not bool(ok.all()):
            keep = ok.cpu()
            bad = [k for k, good in zip(batch.keys, keep.tolist()) if not good]
            dropped[-1] = ~keep.numpy()
            log.warning("rank %d: %d utterance(s) with targets longer than their output frames allow, not trained "
                        "(epoch %d, batch %d): %s", ctx.world.rank, len(bad), batch.epoch, batch.step,
                        ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""))
            if bool(keep.any()):
                it.feats, it.feat_lengths, it.targets, it.target_lengths = keep_utterances(
                    ok, feats, feat_lengths, targets, target_lengths)
            else:  # the first utterance joins the step as a dummy, its loss times 0
                it.empty = True
                it.feats, it.feat_lengths = feats[:1], feat_lengths[:1]
                it.targets, it.target_lengths = targets[:0], target_lengths[:1] * 0
        items.append(it)
    return items, dropped


def optimiser_step(ctx: StepContext, run, micro: list) -> StepResult:
    """One optimiser step over `grad_accum_steps` (batch, loader state) micro-batches (module docstring); an OOM
    split raises `run.splits` for the rest of the epoch."""
    world, comm = ctx.world, ctx.comm
    items, dropped = _prepare(ctx, run, micro)
    local_tokens = float(sum(0 if it.empty else it.targets.numel() for it in items))  # shape only: no sync
    local_samples = float(sum(0 if it.empty else len(it.feat_lengths) for it in items))
    n_dropped = float(sum(int(m.sum()) for m in dropped if m is not None))
    global_tokens, global_samples, impossible = comm.sum([local_tokens, local_samples, n_dropped])
    res = StepResult(global_tokens=global_tokens, samples=int(global_samples), impossible=int(impossible),
                     dropped=dropped)
    if global_samples == 0:  # no rank has a sample to train on: no forward, no step (the caller counts these)
        b = micro[-1][0]
        log.warning("no rank has a sample to train on (epoch %d, batch %d): step %d not taken", b.epoch, b.step,
                    run.step + 1)
        res.global_tokens = 0.0
        return res
    if global_tokens > 0:
        for it in items:
            if len(it.batch) == 0 and it.batch.planned != 0:
                log.warning("rank %d: empty batch (epoch %d, batch %d): every sample failed to decode; joining "
                            "step %d with a silent dummy", world.rank, it.batch.epoch, it.batch.step, run.step + 1)
            elif len(it.batch) == 0:  # the loader logged and counted it (counters["empty_by_plan"])
                log.debug("rank %d: batch %d of epoch %d is empty by plan; joining step %d with a silent dummy",
                          world.rank, it.batch.step, it.batch.epoch, run.step + 1)
        scale = world.world_size / global_tokens
        if ctx.cfg.budget.oom_split:
            loss = _accumulate_safe(ctx, run, items, scale, res)
            if world.world_size > 1:
                all_reduce_grads(run.raw_model, world.world_size)
        else:
            loss = _accumulate_ddp(ctx, run, items, scale, res)
        _apply_update(ctx, run, loss, res)
    else:  # the step counter and the LR schedule do not move for a step that saw no data (see trainer.Trainer._account)
        log.warning("step %d: no target tokens on any rank; optimiser step skipped", run.step + 1)
    run.optimizer.zero_grad(set_to_none=True)
    return res


def _apply_update(ctx: StepContext, run, loss: torch.Tensor, res: StepResult) -> None:
    """Unscale, clip and step, unless the loss or the gradients are not finite on some rank: then every rank skips
    the optimiser step. The gradients are the same on every rank after their all-reduce, the loss is this rank's:
    one all-reduce of two flags agrees on it (the per-step loss read syncs the device anyway). The scheduler
    moves either way: the step was taken, its update was not. fp16: GradScaler's own skip of an overflowing
    gradient with a finite loss is loss-scale backoff, counted as `overflow`, never as a non-finite step."""
    run.scaler.unscale_(run.optimizer)  # a no-op without fp16
    grads = [p.grad for p in run.raw_model.parameters() if p.grad is not None]
    if ctx.cfg.train.grad_clip_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), ctx.cfg.train.grad_clip_norm)
    else:
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    res.loss = float(loss)  # device->host sync once per step
    bad_loss, bad_grad = ctx.comm.max([float(not is_finite(res.loss)), float(not is_finite(norm))])
    scaling = run.scaler.is_enabled()
    res.nonfinite = bool(bad_loss) or (bool(bad_grad) and not scaling)
    res.overflow = bool(bad_grad) and scaling and not bad_loss
    if res.nonfinite:
        run.optimizer.zero_grad(set_to_none=True)
    else:
        run.scaler.step(run.optimizer)  # skips by itself on an fp16 overflow
    if scaling:
        run.scaler.update()
    run.scheduler.step()


def _pieces(it: _Item, parts: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """The item in `parts` pieces of consecutive utterances, each trimmed to its own longest (one sync each)."""
    if parts <= 1:
        yield it.feats, it.feat_lengths, it.targets, it.target_lengths
        return
    ends = torch.cat([torch.zeros(1, dtype=torch.int64), it.target_lengths.cpu().cumsum(0)]).tolist()
    for idx in torch.arange(len(it.feat_lengths)).tensor_split(parts):
        if len(idx) == 0:
            continue
        a, b = int(idx[0]), int(idx[-1]) + 1
        width = int(it.feat_lengths[a:b].max())
        yield (it.feats[a:b, :width], it.feat_lengths[a:b], it.targets[ends[a]:ends[b]], it.target_lengths[a:b])


def _forward_backward(ctx: StepContext, run, model: torch.nn.Module, piece: tuple[torch.Tensor, ...], empty: bool,
                      scale: float) -> torch.Tensor:
    """Forward and backward of one piece (`model`: run.model under DDP, else run.raw_model); its detached loss."""
    with ctx.meter.measure() if ctx.meter is not None else contextlib.nullcontext():
        with autocast(ctx.cfg.train, ctx.device):
            loss_sum, _, _ = model(*piece)
        if empty:
            loss_sum = loss_sum * 0.0  # dummy forward: joins the step, adds nothing
        run.scaler.scale(loss_sum * scale).backward()
    return loss_sum.detach().float()


def _accumulate_ddp(ctx: StepContext, run, items: list[_Item], scale: float, res: StepResult) -> torch.Tensor:
    """The plain DDP accumulation: gradient all-reduce overlapped with the last micro-batch's backward."""
    meter = ctx.meter
    loss_acc = torch.zeros((), device=ctx.device)
    for i, it in enumerate(items):
        last = i == len(items) - 1
        sync = contextlib.nullcontext() if last or not isinstance(run.model, DDP) else run.model.no_sync()
        with sync:
            loss_acc += _forward_backward(ctx, run, run.model, next(_pieces(it, 1)), it.empty, scale)
        if meter is not None:
            res.peaks.append((it.bucket, meter.take()))
    return loss_acc


def _accumulate_safe(ctx: StepContext, run, items: list[_Item], scale: float, res: StepResult) -> torch.Tensor:
    """Forward + backward of every micro-batch without gradient sync, redone in more parts after an OOM on any
    rank until no rank fails (module docstring). Returns this rank's summed loss."""
    world, device, meter, splits = ctx.world, ctx.device, ctx.meter, run.splits
    n, ws = len(items), world.world_size
    parts = [1 if it.empty else splits.get(it.batch.epoch, it.bucket) for it in items]
    todo, first, rounds = True, True, 0
    loss_acc = torch.zeros((), device=device)
    while True:
        flags = [0.0] * (ws * n + 1)  # samples of each (rank, micro-batch) that failed; last: unsplittable ones
        if todo:
            loss_acc, peaks, failed = torch.zeros((), device=device), [], -1
            try:
                for failed, it in enumerate(items):
                    for piece in _pieces(it, parts[failed]):
                        if first and parts[failed] == 1:
                            ctx.fault(run.step + 1)
                        loss_acc += _forward_backward(ctx, run, run.raw_model, piece, it.empty, scale)
                    if meter is not None:
                        peaks.append((it.bucket, meter.take()))
                todo = False
                res.peaks = peaks
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not is_oom(e):
                    raise
                log.warning("rank %d: out of memory in step %d, micro-batch %d (%d utterances in %d part(s)): %s",
                            world.rank, run.step + 1, failed, len(items[failed].batch), parts[failed],
                            str(e).splitlines()[0][:200])
                flags[world.rank * n + failed] = float(len(items[failed].feat_lengths))
                flags[-1] = float(parts[failed] >= len(items[failed].feat_lengths))
            if todo:  # this rank failed: drop the attempt's tensors and gradients, then redo it all
                loss_acc = torch.zeros((), device=device)
                run.optimizer.zero_grad(set_to_none=True)
                free_after_oom(device)
        first = False
        got = ctx.comm.sum(flags)  # every rank, every round: no rank runs ahead, DDP-free so nothing hangs
        if not any(got):
            return loss_acc
        if got[-1] > 0:
            raise torch.OutOfMemoryError(f"step {run.step + 1}: one utterance alone does not fit in memory on some "
                                         "rank; lower stream.bucket.max_batch_seconds (or the budget table) or the "
                                         "longest utterance")
        rounds += 1
        failed_at = [(r, i) for r in range(ws) for i in range(n) if got[r * n + i] > 0]
        for i in sorted({i for _, i in failed_at}):
            parts[i] = min(2 * parts[i], max(1, len(items[i].feat_lengths)))
            splits.raise_to(items[i].batch.epoch, items[i].bucket, parts[i])
        res.events.append({"event": "oom_split", "ranks": sorted({r for r, _ in failed_at}),
                           "micro_batches": sorted({i for _, i in failed_at}), "round": rounds,
                           "samples": int(sum(got[r * n + i] for r, i in failed_at)),
                           "parts": max(parts[i] for _, i in failed_at)})


def all_reduce_grads(model: torch.nn.Module, world_size: int) -> None:
    """Average the gradients over ranks as DDP does (divide, then sum), in buckets of GRAD_BUCKET_BYTES."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # unused this step on this rank: contributes zeros, as DDP's find_unused would
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []
    size = 0
    for i, p in enumerate(params):
        assert p.grad is not None
        bucket.append(p.grad)
        size += p.grad.numel() * p.grad.element_size()
        nxt = params[i + 1] if i + 1 < len(params) else None
        if nxt is None or size >= GRAD_BUCKET_BYTES or nxt.dtype != p.dtype:
            flat = torch.cat([g.reshape(-1) for g in bucket]).div_(world_size)
            dist.all_reduce(flat)
            for g, v in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(v.view_as(g))
            bucket, size = [], 0


def broadcast_params(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (what wrapping in DDP would do at construction)."""
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)
