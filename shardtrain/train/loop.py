"""Training loop: streamed batches -> device augmentation -> model under DDP -> step -> metrics + checkpoints.

    Loader (batch, state) x grad_accum_steps
      -> targets via the tokenizer; ONE all-reduce of the token count (the loss denominator across ranks)
      -> waves.to(device) -> DeviceAugment(generator seeded from (seed, epoch, step, rank)) -> feats
      -> model -> CTC loss summed over tokens -> backward of loss_sum * world_size / global_tokens (gradients
         averaged over ranks, so this is the exact per-token mean over every rank and micro-batch, whatever each
         rank's batch size); an out-of-memory error is redone in halves on every rank's agreement (update.py)
      -> unscale, clip, AdamW step, warm-up + cosine lr -> log / validate / checkpoint
      -> between epochs: per-bucket budgets moved by the measured peak memory (closedloop.py, `--batch-budget`)

One process on CPU:
    shardtrain train --data shards/train --val-data shards/dev --pipeline tiny_cpu --max-steps 500 --out runs/tiny
Many GPUs (NCCL), restarting from the last checkpoint when a rank dies:
    torchrun --nproc_per_node=8 --max-restarts 3 -m shardtrain train --data s3://bucket/librispeech/train \\
        --val-data s3://bucket/librispeech/dev --pipeline librispeech_base --max-steps 100000 --out /ckpt/ls \\
        --set train.grad_accum_steps=2 --set train.precision=bf16

Empty batches (every sample of a planned batch failed to decode) still take part in the step: the rank runs
the model on a half-second silent dummy and multiplies its loss by 0, so DDP's gradient all-reduce always sees
every rank. If every rank's batch is empty, or no rank has a single target token, all ranks skip the step
together: neither the step counter nor the LR schedule advances; after MAX_EMPTY_STEPS such batches in a row
all ranks stop with StreamError (the data is gone, not just thin). Storage that stays down past `stream.retry_budget_s`, refused
credentials or a missing shard raise StreamError from the loader: the run stops, to be resumed.
Resume is bit-exact on CPU: the loader state of the last consumed batch, the torch RNG state of every rank,
model, optimiser, scheduler and scaler are restored, and augmentation randomness depends only on
(seed, epoch, step, rank).
A cluster's run: SIGTERM/SIGUSR1/Ctrl-C stop every rank at the same step with a checkpoint (preempt.py; the CLI
exits 75); rank 0 holds the run folder's lease while training (runfiles.RunLease); a failed periodic checkpoint is
logged in one line and training goes on (MAX_CKPT_FAILURES), a failed final or preemption checkpoint stops it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from shardtrain import faults
from shardtrain.format.manifest import open_dataset
from shardtrain.format.safe import printable
from shardtrain.storage.lock import LockHeld

from shardtrain.train import checkpoint as ckpt
from shardtrain.train import elastic, runfiles
from shardtrain.train.preempt import Preemption, parse_signals
from shardtrain.train.keylog import KeyLog
from shardtrain.train.ledger import LedgerWriter, attempt_id
from shardtrain.train.step import Augmenters, Collectives
from shardtrain.train.budget import read_budget
from shardtrain.train.closedloop import ClosedLoop, table_of, with_table
from shardtrain.train.memory import MemoryMeter, total_bytes
from shardtrain.train.update import SplitLevels, broadcast_params, optimiser_step
from shardtrain.train.guards import StepGuard, check_finite_weights
from shardtrain.train.evaluate import evaluate, metrics_row
from shardtrain.train.metrics import MetricsLogger, redone_after
from shardtrain.train.model import build_model, num_parameters
from shardtrain.train.overrides import to_dict
from shardtrain.train.qat import enable_qat
from shardtrain.load.loader import build_loader
from shardtrain.load.reader import StreamError
from shardtrain.train.text import CharVocab, SentencePieceVocab, Tokenizer, tokenizer_from_json
from shardtrain.train.normalize import TextNormConfig
from shardtrain.train.valsets import check_val_sets, val_sets, warn_missing_chars
from shardtrain.world import World
from shardtrain.train.config import RunConfig, TrainConfig, data_sources

log = logging.getLogger(__name__)

MAX_EMPTY_STEPS = 20
"""Batches in a row with no sample or no target token on any rank (they never advance the step or the LR
schedule) before the run stops: the data is gone, not thin."""


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


def _resolve_device(cfg: TrainConfig, world: World) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    torch.cuda.set_device(world.local_rank)
    return torch.device("cuda", world.local_rank)


def _build_tokenizer(cfg: TrainConfig, world: World, storage_options: dict | None, norm: TextNormConfig):
    if cfg.tokenizer == "sentencepiece":
        return SentencePieceVocab(cfg.sentencepiece_model, norm)
    # rank 0 reads the text column once and broadcasts the character list (not every rank re-reading it)
    urls = (cfg.data_url, *cfg.mix_urls)
    chars = [sorted(set().union(*(CharVocab.from_index(u, storage_options, norm).chars for u in urls)))
             if world.is_main else None]
    if world.world_size > 1:
        dist.broadcast_object_list(chars, src=0)
    return CharVocab(chars[0] or [], norm)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)


def _init_process_group(backend: str, world: World, attempt: int) -> None:
    """env:// initialisation, with the store keys of restart `attempt` under their own prefix.

    torchrun restarts keep the agent's TCPStore, so the default group's keys written by the failed attempt are
    still there: gloo then connects to the dead ranks' ports ("connectFullMesh ... Connection refused"; seen in
    3 of 4 restarts here), NCCL would read a stale unique id. A per-attempt PrefixStore keeps attempts apart.
    """
    if attempt == 0:
        dist.init_process_group(backend, rank=world.rank, world_size=world.world_size)
        return
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts the server
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world.world_size,
                          is_master=not agent_store and world.rank == 0, timeout=timedelta(minutes=10))
    dist.init_process_group(backend, store=dist.PrefixStore(f"shardtrain/attempt{attempt}/", store),
                            rank=world.rank, world_size=world.world_size)


def train(cfg: RunConfig, world: World, *, resume: bool = False, storage_options: dict | None = None,
          attempt: int = 0) -> dict:
    """Train per `cfg` as rank `world.rank`; returns the last metrics. Initialises (and later destroys) the
    process group itself when world_size > 1 and none exists: gloo on CPU, NCCL on CUDA. `attempt` is
    torchrun's restart count (TORCHELASTIC_RESTART_COUNT, read by the entry point)."""
    tc = cfg.train
    if not tc.data_url or not tc.out_dir:
        raise ValueError("train.data_url (--data) and train.out_dir (--out) are required")
    check_val_sets(val_sets(tc), storage_options)  # a bad --val-data stops here, not at the first validation
    device = _resolve_device(tc, world)
    threads_before = torch.get_num_threads()
    if device.type == "cpu" and tc.cpu_threads > 0:
        torch.set_num_threads(tc.cpu_threads)
    own_pg = world.world_size > 1 and not dist.is_initialized()
    pre = Preemption(parse_signals(tc.preempt_signals)).install()  # before the process group: a signal meanwhile
    lease = None                                                   # is kept and acted on at the first step
    try:
        if own_pg:
            _init_process_group("nccl" if device.type == "cuda" else "gloo", world, attempt)
        lease = _take_lease(tc, world, storage_options)
        return _train(cfg, world, device, resume, storage_options, pre, lease)
    finally:
        pre.uninstall()
        if lease is not None:
            lease.release()
        torch.set_num_threads(threads_before)
        if own_pg and dist.is_initialized():
            dist.destroy_process_group()


def _take_lease(tc: TrainConfig, world: World, storage_options: dict | None) -> runfiles.RunLease | None:
    """Rank 0 takes the run folder's lease (runfiles.RunLease); every rank raises LockHeld when it is held."""
    lease, refused = None, None
    if world.is_main:
        try:
            lease = runfiles.RunLease(tc.out_dir, tc.lease_ttl_s, storage_options)
        except LockHeld as e:
            refused = str(e)
    if world.world_size > 1:
        box = [refused]
        dist.broadcast_object_list(box, src=0)
        refused = box[0]
    if refused:
        raise LockHeld(refused)
    return lease


@dataclass(slots=True)
class _Run:
    """Everything a training run carries from step to step (and restores from a checkpoint)."""

    tok: Tokenizer
    raw_model: torch.nn.Module
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    step: int = 0
    best_val: float = math.inf
    loader_state: dict | None = None
    resized: elastic.Decision | None = None
    """Set when the checkpoint came from another world size (elastic.py)."""
    ledger: LedgerWriter | None = None
    """What this rank trained on since the last checkpoint (train/ledger.py); flushed with each checkpoint."""
    splits: SplitLevels = field(default_factory=SplitLevels)
    """Buckets split after an OOM in the current epoch (train/update.py)."""
    oom_splits: int = 0
    """Steps redone in parts after an out-of-memory error, over the whole run."""
    budget_state: dict | None = None
    """The closed loop's state from the checkpoint (train/closedloop.py), applied in _prepare."""
    guard: StepGuard | None = None
    """Skipped non-finite steps and impossible targets (train/guards.py); set when training starts."""
    ckpt_failures: int = 0
    """Periodic checkpoints failed in a row (_maybe_checkpoint)."""


def _restore(cfg: RunConfig, world: World, device: torch.device, resume: bool, storage_options: dict | None,
             ckpt_dir: Path | str, comm: Collectives) -> _Run:
    """Build model, optimiser, scheduler and scaler, from the newest intact checkpoint when resuming."""
    tc = cfg.train
    latest = ckpt.latest_checkpoint(ckpt_dir, storage_options)
    if latest is not None and not resume:
        raise ValueError(f"{os.path.dirname(str(ckpt_dir))} already holds checkpoints "
                         f"({os.path.basename(str(latest))}); pass --resume to continue it, or choose a new --out")
    latest, state = (ckpt.load_newest_intact(ckpt_dir, rank=world.rank, world_size=world.world_size,
                                             agree=lambda bad: comm.max([float(bad)])[0] > 0,
                                             storage_options=storage_options) if resume and latest else (None, None))
    if resume and state is None:
        log.info("--resume: no checkpoint in %s yet; starting from scratch", ckpt_dir)

    tok = tokenizer_from_json(state["main"]["tokenizer"]) if state else _build_tokenizer(tc, world, storage_options, cfg.text)
    if world.is_main:
        warn_missing_chars(val_sets(tc), tok, storage_options)  # once, at start: what validation targets will lack
    torch.manual_seed(tc.seed)  # identical init on every rank (DDP also broadcasts rank 0's weights)
    raw_model = build_model(cfg.model, len(tok), cfg.features.n_mels)
    if tc.qat:  # fake-quant Linear layers (train/qat.py); parameters and state_dict keys are unchanged
        log.info("quantization-aware training: %d Linear layers fake-quantized", enable_qat(raw_model))
    raw_model = raw_model.to(device)
    optimizer = make_optimizer(raw_model, tc)
    run = _Run(tok=tok, raw_model=raw_model, model=raw_model, optimizer=optimizer,
               scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, tc)),
               scaler=torch.amp.GradScaler(device.type, enabled=tc.precision == "fp16"))
    if state and latest is not None:
        _fit_model(run.raw_model, state, cfg, latest)
        _load_state(run, state, device, seed=tc.seed * 1000 + world.rank)
        run.resized = elastic.decide(state["meta"], cfg, world.world_size)
        stored, now = state["meta"]["config"], json.loads(json.dumps(to_dict(cfg)))
        changed = sorted(k for k in stored if stored[k] != now.get(k))
        if changed:
            log.warning("resuming %s with a changed config in sections %s", os.path.basename(str(latest)), changed)
        log.info("resumed from %s at step %d", latest, run.step)
    else:
        torch.manual_seed(tc.seed * 1000 + world.rank)  # dropout streams differ per rank
    if world.world_size > 1 and not cfg.budget.oom_split:
        run.model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)
    elif world.world_size > 1:  # update.py all-reduces the gradients itself, after every rank's backward
        broadcast_params(raw_model)
    return run


def _fit_model(model: torch.nn.Module, state: dict, cfg: RunConfig, path: Path) -> None:
    """Load the checkpoint's weights, or one ValueError naming the config fields and tensor shapes that differ."""
    try:
        model.load_state_dict(state["model"])
    except RuntimeError:
        why = ckpt.explain_mismatch(state["meta"].get("config", {}), json.loads(json.dumps(to_dict(cfg))),
                                    state["model"], model.state_dict())
        raise ValueError(f"--resume: checkpoint {os.path.basename(str(path))} does not fit this model: {why}; "
                         "resume with the run's config (its config.json) or start a new --out") from None


def _load_state(run: _Run, state: dict, device: torch.device, seed: int) -> None:
    run.optimizer.load_state_dict(state["main"]["optimizer"])
    run.scheduler.load_state_dict(state["main"]["scheduler"])
    run.scaler.load_state_dict(state["main"]["scaler"])
    run.step = int(state["main"]["step"])
    run.best_val = float(state["main"].get("best_val_loss", math.inf))
    run.loader_state = json.loads(state["rank"]["loader_state"])
    budget = json.loads(state["main"].get("budget", "{}"))
    run.splits, run.oom_splits = SplitLevels.from_json(budget.get("splits")), int(budget.get("oom_splits", 0))
    run.budget_state = budget.get("closed_loop")
    if state["rank"]["rng_cpu"] is None:  # a rank the checkpoint's (smaller) world did not have
        torch.manual_seed(seed + 7919 * run.step)
        return
    torch.set_rng_state(state["rank"]["rng_cpu"])
    if device.type == "cuda" and state["rank"].get("rng_cuda") is not None:
        torch.cuda.set_rng_state(state["rank"]["rng_cuda"], device)


def _write_run_files(cfg: RunConfig, run: _Run, out: Path, world: World, device: torch.device) -> None:
    """config.json (the resolved config) and vocab.json, on rank 0."""
    if not world.is_main:
        return
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(to_dict(cfg), indent=1, sort_keys=True))
    os.replace(tmp, out / "config.json")
    (out / "vocab.json").write_text(json.dumps(run.tok.to_json()))
    log.info("model: %.2fM parameters, vocabulary %d, device %s, world size %d",
             num_parameters(run.raw_model) / 1e6, len(run.tok), device, world.world_size)


def _prepare(cfg: RunConfig, world: World, device: torch.device, resume: bool, storage_options: dict | None,
             comm: Collectives) -> tuple[RunConfig, _Run, Path, Path | str, ClosedLoop]:
    """Run folder (fetched from the object store for an s3:// --out), model/optimiser state, the elastic
    decision on a changed world size (it may change the config), config.json + vocab.json."""
    out, ckpt_dir = runfiles.run_dirs(cfg.train.out_dir)
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if ckpt.is_remote(cfg.train.out_dir):
            runfiles.fetch_run_files(cfg.train.out_dir, out, storage_options)
    comm.barrier()
    run = _restore(cfg, world, device, resume, storage_options, ckpt_dir, comm)
    if run.resized is not None:
        cfg = elastic.apply(cfg, run.resized, run.optimizer, run.scheduler)
    cfg, closed = _closed_loop(cfg, run, device)
    _write_run_files(cfg, run, out, world, device)
    return cfg, run, out, ckpt_dir, closed


def _closed_loop(cfg: RunConfig, run: _Run, device: torch.device) -> tuple[RunConfig, ClosedLoop]:
    """The budget table the run plans with (--batch-budget, or the checkpoint's, which the closed loop may have
    moved) and the memory limit the loop holds it under (train/budget.py)."""
    bc = cfg.budget
    doc = read_budget(bc.file) if bc.file else {}
    if doc:
        cfg = with_table(cfg, doc["budget_table"])
    limit: float | None = bc.memory_limit_mb * 2**20 or None
    if limit is None and doc.get("device", "").split(":")[0] == device.type:
        limit = float(doc["memory_target_bytes"])
    if limit is None and device.type == "cuda":
        limit = 0.9 * total_bytes(device)
    closed = ClosedLoop(table_of(cfg), bc, limit, tuned=doc.get("budget_table"))
    closed.load(run.budget_state)
    if closed.table and closed.table != table_of(cfg):
        log.info("budget table from the checkpoint: %s", [list(r) for r in closed.table])
        cfg = with_table(cfg, closed.table)
    if closed.active and limit is not None:
        log.info("closed loop on: per-bucket budgets move between epochs to keep peaks under %.0f MB", limit / 2**20)
    return cfg, closed


def _train(cfg: RunConfig, world: World, device: torch.device, resume: bool, storage_options: dict | None,
           pre: Preemption, lease: runfiles.RunLease | None) -> dict:
    comm = Collectives(world, device)
    cfg, run, out, ckpt_dir, closed = _prepare(cfg, world, device, resume, storage_options, comm)
    tc = cfg.train
    redone = redone_after(out / "metrics.jsonl", run.step) if world.is_main else None  # before the truncation
    metrics = MetricsLogger(out, active=world.is_main, tensorboard=tc.tensorboard, start_step=run.step)
    if run.resized is not None:
        metrics.log(run.resized.row(run.step))
    keylog = KeyLog(out, world.rank, run.step) if tc.log_keys else None
    # an endless stream, asked for explicitly (a default StreamConfig runs one epoch): max_steps ends training
    loader = build_loader(data_sources(tc), world=world, seed=tc.seed, cfg=replace(cfg.stream, epochs=None),
                          state=run.loader_state, storage_options=storage_options)
    run.ledger = _start_ledger(tc, run, out, world, comm, storage_options, redone) if tc.ledger else None
    batches = iter(loader)
    augmenters = Augmenters(cfg, device)
    bar = tqdm(total=tc.max_steps, initial=run.step, dynamic_ncols=True,
               disable=not (world.is_main and tc.progress and sys.stderr.isatty()))
    last: dict = {}
    tokenless = 0
    meter = _Interval()
    # peak memory per step: for the closed loop, or reported (mem_peak_mb) when a memory limit is set
    mem = MemoryMeter(device, run.raw_model, run.optimizer) if closed.active or cfg.budget.memory_limit_mb else None
    run.model.train()
    run.guard = StepGuard(max_nonfinite_steps=tc.max_nonfinite_steps, max_impossible_share=tc.max_impossible_share)
    try:
        while run.step < tc.max_steps:
            t0 = time.perf_counter()
            micro: list = []
            while len(micro) < tc.grad_accum_steps:
                # fork_rng: DataLoader draws a base seed from the global CPU RNG when an iterator starts; keep the
                # global RNG for dropout only, so a resumed run (new iterator) continues the same dropout stream
                with torch.random.fork_rng(devices=[]):
                    item = next(batches)
                if not micro and closed.due(item):
                    new_cfg = _epoch_boundary(cfg, run, closed, comm, device, item[0].epoch, metrics)
                    if new_cfg is not None:  # this epoch's first batch was planned with the old table: re-plan
                        cfg = new_cfg
                        batches.close()
                        state = {**(run.loader_state or item[1]), "epoch": item[0].epoch, "step": 0, "chain": []}
                        loader = build_loader(data_sources(tc), world=world, seed=tc.seed,
                                              cfg=replace(cfg.stream, epochs=None), state=state,
                                              storage_options=storage_options)
                        batches = iter(loader)
                        continue
                micro.append(item)
            meter.wait_s += time.perf_counter() - t0  # time spent fetching is data wait
            if keylog is not None:
                keylog.write(run.step + 1, micro)
            if run.ledger is not None:
                run.ledger.add(run.step + 1, micro)
            oom_point = lambda: faults.point(f"train.step.rank{world.rank}", run.step + 1, actions=("oom",),  # noqa: E731
                                             once_marker=out / f".fault_oom_step_{run.step + 1}.done")
            res = optimiser_step(cfg, run, micro, world, device, comm, augmenters,
                                 lambda b: augment_seed(tc.seed, b.epoch, b.step, world.rank),
                                 table=closed.table, splits=run.splits, meter=mem, fault=oom_point)
            loss, global_tokens = res.loss, res.global_tokens
            run.guard.after_step(run.step + 1, nonfinite=res.nonfinite, overflow=res.overflow,
                                 impossible=res.impossible, samples=res.samples)
            for bucket, peak in res.peaks:
                meter.mem_peak = max(meter.mem_peak, peak)
                closed.record(bucket, peak)
            for ev in res.events:
                run.oom_splits += 1
                closed.record_oom(micro, ev)
                metrics.log({"step": run.step + 1, **ev, "oom_splits": run.oom_splits})
                log.warning("step %d: out of memory on rank(s) %s; redone in %d parts per micro-batch %s, %d samples, "
                            "none lost (%d so far)", run.step + 1, ev["ranks"], ev["parts"], ev["micro_batches"],
                            ev["samples"], run.oom_splits)
            if global_tokens <= 0:  # no target token on any rank: no step, no schedule, nothing to log or save
                run.loader_state = micro[-1][1]
                tokenless += 1
                if tokenless >= MAX_EMPTY_STEPS:
                    raise StreamError(f"{tokenless} batches in a row with no sample or no target token on any rank "
                                      f"before step {run.step + 1}: every sample failed to decode, or the "
                                      f"transcripts are empty; check {tc.data_url} (`shardtrain inspect --verify`)")
                continue
            tokenless = 0
            run.step += 1
            bar.update(1)
            # a skipped non-finite step still counts (scheduler and data moved on); its loss stays out of the mean
            meter.add(0.0 if res.nonfinite else loss, 0.0 if res.nonfinite else global_tokens,
                      sum(float(b.durations_s.sum()) for b, _ in micro))
            run.loader_state = micro[-1][1]
            if run.step % tc.log_every_steps == 0 or run.step == tc.max_steps:
                last.update(_log_interval(run, meter, loader, comm, micro[-1][0].epoch, device, metrics, bar,
                                          world, tc.max_steps))
            t_pause = time.perf_counter()
            if run.step < tc.max_steps and _must_stop(pre, lease, comm):  # every rank, at this same step
                return _preempted(cfg, run, world, device, comm, ckpt_dir, last, closed, storage_options, pre,
                                  metrics, step_s=t_pause - t0)
            val_loss = _maybe_validate(cfg, run, world, device, comm, augmenters, metrics, last, storage_options)
            _maybe_checkpoint(cfg, run, world, device, comm, ckpt_dir, val_loss, last, closed, storage_options,
                              metrics=metrics)
            meter.pause_s += time.perf_counter() - t_pause
            # the fault seam: after any checkpoint of this step, so a test can crash right after a save
            faults.point(f"train.step.rank{world.rank}", run.step, once_marker=out / f".fault_step_{run.step}.done")
    finally:
        batches.close()  # stops the loader's prefetch threads/workers
        if keylog is not None:
            keylog.close()
        bar.close()
        metrics.close()
    return {**last, "step": run.step, "out_dir": tc.out_dir, "oom_splits": run.oom_splits, **run.guard.counters()}


def _epoch_boundary(cfg: RunConfig, run: _Run, closed: ClosedLoop, comm: Collectives, device: torch.device,
                    epoch: int, metrics: MetricsLogger) -> RunConfig | None:
    """Between epochs: the closed loop's decision over all ranks; the config with the new table if one moved."""
    table, row = closed.boundary(comm, run.raw_model, run.optimizer, device, epoch, run.step + 1)
    metrics.log(row)
    return None if table is None else with_table(cfg, table)


def _log_interval(run: _Run, meter: _Interval, loader, comm: Collectives, epoch: int, device: torch.device,
                  metrics: MetricsLogger, bar: tqdm, world: World, max_steps: int) -> dict:
    """One metrics row (one all-reduce); without a terminal (torchrun, SLURM, a pipe) also one progress line."""
    row = meter.row(run, comm, float(loader.stats()["skipped"]), epoch, device)
    row.update(_dataset_seconds(loader, comm))
    row.update(run.guard.counters() if run.guard is not None else {})
    metrics.log(row)
    bar.set_postfix(loss=f"{row['loss']:.3f}")
    if bar.disable and world.is_main:
        log.info("step %d/%d  loss %.3f  %.0f audio-s/s  data wait %.0f%%  lr %.2e  skipped %d", run.step,
                 max_steps, row["loss"], row["audio_s_per_s"], row["data_wait_pct"], row["lr"], row["skipped"])
    return row


def _dataset_seconds(loader, comm: Collectives) -> dict:
    """A mixture's audio seconds per dataset so far, summed over ranks (one small all-reduce): `audio_s/d<i>`."""
    secs = loader.stats().get("dataset_seconds")
    if not secs:
        return {}
    return {f"audio_s/d{i}": s for i, s in enumerate(comm.sum(list(secs)))}


@dataclass(slots=True)
class _Interval:
    """Sums over the steps since the last metrics line; validation and checkpoint time (pause_s) excluded."""

    loss: float = 0.0
    tokens: float = 0.0
    audio_s: float = 0.0
    wait_s: float = 0.0
    pause_s: float = 0.0
    mem_peak: float = 0.0
    """Largest peak of a step in the interval (bytes; train/memory.py), when measured."""
    t0: float = field(default_factory=time.perf_counter)

    def add(self, loss: float, tokens: float, audio_s: float) -> None:
        self.loss += loss
        self.tokens += tokens
        self.audio_s += audio_s

    def row(self, run: _Run, comm: Collectives, skipped: float, epoch: int, device: torch.device) -> dict:
        """The metrics line (one all-reduce over ranks), then start a new interval."""
        loss_g, audio_g, skipped_g = comm.sum([self.loss, self.audio_s, skipped])
        elapsed = max(time.perf_counter() - self.t0 - self.pause_s, 1e-9)
        row = {"step": run.step, "loss": loss_g / max(self.tokens, 1.0), "lr": run.scheduler.get_last_lr()[0],
               "audio_s": round(audio_g, 3), "audio_s_per_s": audio_g / elapsed, "data_wait_pct": 100.0 * self.wait_s / elapsed,
               "skipped": int(skipped_g), "epoch": epoch}
        if device.type == "cuda":
            row["gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if self.mem_peak:
            row["mem_peak_mb"] = comm.max([self.mem_peak])[0] / 2**20
        self.loss = self.tokens = self.audio_s = self.wait_s = self.pause_s = self.mem_peak = 0.0
        self.t0 = time.perf_counter()
        return row


def _maybe_validate(cfg: RunConfig, run: _Run, world: World, device: torch.device, comm: Collectives,
                    augmenters: Augmenters, metrics: MetricsLogger, last: dict,
                    storage_options: dict | None) -> float | None:
    """Validate every `val_every_steps` and at the end; returns the pooled val_loss when it ran (evaluate.py)."""
    tc = cfg.train
    end = run.step == tc.max_steps
    if not tc.val_data_url or not (end or (tc.val_every_steps and run.step % tc.val_every_steps == 0)):
        return None
    sets = val_sets(tc)
    log.info("step %d: validating on %s", run.step, ", ".join(f"{s.name} ({s.url})" for s in sets))
    with torch.random.fork_rng(devices=[]):  # validation must not shift the training RNG streams
        res = evaluate(run.raw_model, cfg, world, run.tok, augmenters, device, comm, storage_options)
    val_loss = res["val_loss"]
    row = metrics_row(res, run.step)
    metrics.log(row)
    last.update(row, val_examples=res["examples"])
    for name, s in res["sets"].items():
        for ref, hyp in s["examples"]:
            head = f"step {run.step}  {name} "
            log.info("%sref: %s\n%shyp: %s", head, printable(ref), " " * len(head), printable(hyp))
            metrics.text(f"val/{name}/example", f"REF: {ref}  \nHYP: {hyp}", run.step)
        log.info("step %d: %s  val_loss %.4f  CER %.2f%%  WER %.2f%%  (%d utterances, %.0f s)", run.step, name,
                 s["loss"], 100 * s["cer"], 100 * s["wer"], s["utts"], s["audio_s"])
    if len(sets) > 1:
        log.info("step %d: all %d sets (pooled)  val_loss %.4f  CER %.2f%%  WER %.2f%%", run.step, len(sets),
                 val_loss, 100 * res["cer"], 100 * res["wer"])
    run.best_val = min(run.best_val, val_loss)
    return val_loss


def _must_stop(pre: Preemption, lease: runfiles.RunLease | None, comm: Collectives) -> bool:
    """The step boundary's one all-reduce: was any rank signalled, or did rank 0 lose the run's lease?"""
    sig, lost = comm.max([float(pre.signum or 0), 1.0 if lease is not None and lease.lost else 0.0])
    if lost:
        raise LockHeld(lease.lost if lease is not None and lease.lost else "rank 0 lost the run folder's lease")
    if sig and pre.t_signal is None:
        pre.t_signal = time.time()  # this rank saw no signal: its delay counts from the agreement
    return sig > 0


def _preempted(cfg: RunConfig, run: _Run, world: World, device: torch.device, comm: Collectives,
               ckpt_dir: Path | str, last: dict, closed: ClosedLoop, storage_options: dict | None,
               pre: Preemption, metrics: MetricsLogger, step_s: float) -> dict:
    """Checkpoint this step on every rank (a failure raises: there is no later chance), log the delay next to
    the step's duration (`step_s`: the bound is one step plus the write)."""
    t0 = time.time()
    _maybe_checkpoint(cfg, run, world, device, comm, ckpt_dir, None, last, closed, storage_options, force=True)
    done = time.time()
    row = {"step": run.step, "event": "preempted", "signal": pre.name(),
           "preempt_s": round(done - (pre.t_signal or t0), 3), "checkpoint_s": round(done - t0, 3),
           "step_s": round(step_s, 3)}
    metrics.log(row)
    log.warning("step %d: %s received; checkpoint %s committed %.2f s after the signal (write %.2f s); "
                "exiting to be resumed with --resume", run.step, row["signal"], last.get("checkpoint"),
                row["preempt_s"], row["checkpoint_s"])
    return {**last, **row, "preempted": True, "out_dir": cfg.train.out_dir, "oom_splits": run.oom_splits}


MAX_CKPT_FAILURES = 3
"""Periodic checkpoints that may fail in a row (each logged in one line, the previous one stays the latest)
before the run stops; a failed final or preemption checkpoint stops it at once."""


def _maybe_checkpoint(cfg: RunConfig, run: _Run, world: World, device: torch.device, comm: Collectives,
                      ckpt_dir: Path | str, val_loss: float | None, last: dict, closed: ClosedLoop,
                      storage_options: dict | None = None, *, force: bool = False,
                      metrics: MetricsLogger | None = None) -> None:
    """Save every `ckpt_every_steps`, at the end and when `force`d (all ranks take part: each writes its own RNG +
    loader state). A failed periodic save is logged and training goes on (MAX_CKPT_FAILURES)."""
    tc = cfg.train
    end = run.step == tc.max_steps
    if not (force or end or (tc.ckpt_every_steps and run.step % tc.ckpt_every_steps == 0)):
        return
    try:
        _save(cfg, run, world, device, comm, ckpt_dir, val_loss, last, closed, storage_options)
        run.ckpt_failures = 0
    except ckpt.CheckpointWriteError as e:
        run.ckpt_failures += 1
        if force or end or run.ckpt_failures >= MAX_CKPT_FAILURES:
            raise
        log.warning("%s; training goes on (%d of %d failures in a row allowed)", e, run.ckpt_failures,
                    MAX_CKPT_FAILURES - 1)
        if metrics is not None:
            metrics.log({"step": run.step, "event": "checkpoint_failed", "reason": str(e)})


def _save(cfg: RunConfig, run: _Run, world: World, device: torch.device, comm: Collectives,
          ckpt_dir: Path | str, val_loss: float | None, last: dict, closed: ClosedLoop,
          storage_options: dict | None) -> None:
    tc = cfg.train
    rank_state = {"rng_cpu": torch.get_rng_state(),
                  "rng_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                  "loader_state": json.dumps(run.loader_state)}
    main_state = {"optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
                  "scaler": run.scaler.state_dict(), "step": run.step, "best_val_loss": run.best_val,
                  "tokenizer": run.tok.to_json(),
                  "budget": json.dumps({"splits": run.splits.to_json(), "oom_splits": run.oom_splits,
                                        "closed_loop": closed.state()})} if world.is_main else None
    check_finite_weights(run.raw_model, run.step)  # every rank holds the same weights: all refuse together
    if run.ledger is not None:  # before the checkpoint commits: a file without its checkpoint is cut on resume
        run.ledger.flush(run.step)
    path = ckpt.save_checkpoint(
        ckpt_dir, step=run.step, rank=world.rank, world_size=world.world_size, barrier=comm.barrier,
        rank_state=rank_state, main_state=main_state,
        model_state=run.raw_model.state_dict() if world.is_main else None,
        meta={"val_loss": val_loss, "config": to_dict(cfg), "time_unix": time.time(),
              "grad_accum_steps": tc.grad_accum_steps, "elastic_accum": run.resized is not None},
        keep_last=tc.keep_last, storage_options=storage_options, agree=lambda bad: comm.max([float(bad)])[0] > 0)
    last["checkpoint"] = str(path)
    if world.is_main and ckpt.is_remote(tc.out_dir):
        runfiles.push_run_files(runfiles.run_dirs(tc.out_dir)[0], tc.out_dir, storage_options)


def _start_ledger(tc, run: _Run, out: Path, world: World, comm: Collectives,
                  storage_options: dict | None, redone: dict | None) -> LedgerWriter:
    """This rank's ledger for the attempt starting at run.step; the attempt is named by rank 0's clock."""
    t_ms = int(comm.sum([time.time() * 1000.0 if world.is_main else 0.0])[0])
    sources = data_sources(tc)
    pairs = [(sources, 1.0)] if isinstance(sources, str) else sources
    # content ids (shard sha256s) let `shardtrain ledger` refuse a dataset re-packed since (same rows, other audio)
    datasets = [{"url": u, "weight": w, "content": open_dataset(u, storage_options).content_id} if world.is_main
                else {"url": u, "weight": w} for u, w in pairs]
    ledger = LedgerWriter(out, rank=world.rank, attempt=attempt_id(run.step, t_ms),
                          remote=tc.out_dir if ckpt.is_remote(tc.out_dir) else None, storage_options=storage_options)
    if world.is_main:
        ledger.start(start_step=run.step, world_size=world.world_size, datasets=datasets, redone=redone)
    return ledger
