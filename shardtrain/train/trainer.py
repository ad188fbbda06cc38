"""The trainer: one object holding a rank's run, and `fit()`, the step loop that reads as a page.

    Trainer(cfg, world, device, ...): run folder, RunState (fresh or from the newest intact checkpoint; an elastic
        resize may change the config), the closed loop's budget table, metrics, key log, loader, ledger
    fit(): until max_steps
      -> _micro_batches: Loader (batch, state) x grad_accum_steps; at an epoch boundary the closed loop may move
         the budget table: the loader restarts on the new plan from the boundary (Loader.restart)
      -> _step: key log + ledger, then update.optimiser_step (targets, ONE all-reduce of the token count,
         augment with a generator seeded from (seed, epoch, step, rank), forward/backward, OOM split, clip, AdamW)
      -> _account: guard counters, per-bucket peaks, OOM events; a step with no target token anywhere is no step
      -> _log (one all-reduce per interval) -> Interrupts.agreed (one all-reduce: a signal, a lost lease)
      -> _validate (then Interrupts.agreed again: a signal during validation) -> _checkpoint -> the fault seam
         `train.step.rank<r>`

Empty batches (every sample of a planned batch failed to decode) still take part in the step: the rank runs
the model on a half-second silent dummy and multiplies its loss by 0, so the gradient all-reduce always sees
every rank. If every rank's batch is empty, or no rank has a single target token, all ranks skip the step
together: neither the step counter nor the LR schedule advances; after MAX_EMPTY_STEPS such batches in a row
all ranks stop with StreamError (the data is gone, not just thin). Resume is bit-exact on CPU: the loader state
of the last consumed batch, the torch RNG state of every rank, model, optimiser, scheduler and scaler are
restored, and augmentation randomness depends only on (seed, epoch, step, rank). A signalled rank stops every
rank at the same step with a checkpoint; a failed periodic checkpoint is logged in one line and training goes
on (MAX_CKPT_FAILURES), a failed final or preemption checkpoint stops it. The process around it (device,
process group, signals, the run folder's lease) is train/loop.py's.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Generator

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from shardtrain import faults
from shardtrain.format.safe import printable
from shardtrain.load.batch import Batch
from shardtrain.load.loader import Loader, build_loader
from shardtrain.load.reader import StreamError
from shardtrain.storage.lock import LockHeld
from shardtrain.train import checkpoint as ckpt
from shardtrain.train import elastic, runfiles
from shardtrain.train.closedloop import with_table
from shardtrain.train.config import RunConfig, data_sources
from shardtrain.train.evaluate import evaluate, metrics_row
from shardtrain.train.guards import StepGuard, check_finite_weights
from shardtrain.train.keylog import KeyLog
from shardtrain.train.ledger import LedgerWriter, attempt_id
from shardtrain.train.memory import MemoryMeter
from shardtrain.train.metrics import MetricsLogger, redone_after
from shardtrain.train.model import num_parameters
from shardtrain.train.overrides import to_dict
from shardtrain.train.preempt import Preemption
from shardtrain.train.runstate import RunState, build_tokenizer, closed_loop
from shardtrain.train.step import Augmenters, Collectives, StepContext
from shardtrain.train.text import tokenizer_from_json
from shardtrain.train.update import StepResult, broadcast_params, optimiser_step
from shardtrain.train.valsets import val_sets, warn_missing_chars
from shardtrain.world import World

log = logging.getLogger(__name__)

MAX_EMPTY_STEPS = 20
"""Batches in a row with no sample or no target token on any rank (they never advance the step or the LR
schedule) before the run stops: the data is gone, not thin."""
MAX_CKPT_FAILURES = 3
"""Periodic checkpoints that may fail in a row (each logged in one line, the previous one stays the latest)
before the run stops; a failed final or preemption checkpoint stops it at once."""


@dataclass(frozen=True, slots=True)
class Interrupts:
    """What may stop a run between two steps, both owned by the process around the trainer (loop.train installs and
    releases them): the signal handlers (preempt.py) and rank 0's lease on the run folder (None on the other ranks,
    or without one). Checking them costs one all-reduce of two scalars per step."""

    pre: Preemption
    lease: runfiles.RunLease | None = None

    def agreed(self, comm: Collectives) -> bool:
        """The step boundary's one all-reduce: was any rank signalled (True: every rank stops at this step)? A
        lease rank 0 lost raises LockHeld on every rank: another process may be writing the run folder."""
        pre, lease = self.pre, self.lease
        sig, lost = comm.max([float(pre.signum or 0), 1.0 if lease is not None and lease.lost else 0.0])
        if lost:
            raise LockHeld(lease.lost if lease is not None and lease.lost else "rank 0 lost the run folder's lease")
        if sig and pre.t_signal is None:
            pre.t_signal = time.time()  # this rank saw no signal: its delay counts from the agreement
        return sig > 0


class Trainer:
    """One rank's training run. Building it restores (or starts) the run and opens its outputs; `fit()` trains
    and closes them. The process group, the signal handlers and the lease belong to the caller (loop.train)."""

    # opened by _open_outputs; the loader restarts (and `batches` is renewed) when the closed loop re-plans
    metrics: MetricsLogger
    keylog: KeyLog | None
    loader: Loader
    batches: Generator[tuple[Batch, dict], None, None]

    def __init__(self, cfg: RunConfig, world: World, device: torch.device, *, resume: bool,
                 storage_options: dict | None, interrupts: Interrupts) -> None:
        self.storage_options, self.interrupts = storage_options, interrupts
        comm = Collectives(world, device)
        self.out, self.ckpt_dir = runfiles.run_dirs(cfg.train.out_dir)
        self._fetch_run_folder(cfg, world, comm)
        self.run = self._restore(cfg, resume, world, device, comm)
        if self.run.resized is not None:
            cfg = elastic.apply(cfg, self.run.resized, self.run.optimizer, self.run.scheduler)
        cfg, self.closed = closed_loop(cfg, self.run, device)
        # peak memory per step: for the closed loop, or reported (mem_peak_mb) when a memory limit is set
        mem = MemoryMeter(device, self.run.raw_model, self.run.optimizer) \
            if self.closed.active or cfg.budget.memory_limit_mb else None
        self.ctx = StepContext(cfg, world, device, comm, Augmenters(cfg, device), table=self.closed.table,
                               meter=mem, fault=self._oom_point)
        """The one home of the run's config, world, device, collectives, augmenters and memory meter: every step
        takes it (train/step.py); replaced (dataclasses.replace) when the closed loop moves the budget table."""
        self._write_run_files()
        self._open_outputs()
        tc = cfg.train
        self.bar = tqdm(total=tc.max_steps, initial=self.run.step, dynamic_ncols=True,
                        disable=not (world.is_main and tc.progress and sys.stderr.isatty()))
        self.last: dict = {}
        """The latest metrics row, validation result and checkpoint path: what fit() returns."""
        self.tokenless = 0
        self.meter = Interval()
        self.guard = StepGuard(max_nonfinite_steps=tc.max_nonfinite_steps,
                               max_impossible_share=tc.max_impossible_share)
        """Skipped non-finite steps and impossible targets (train/guards.py), counted over this attempt."""

    # -- the loop
    def fit(self) -> dict:
        """Train to max_steps (or to a preemption); returns the last metrics with the run's counters."""
        run, tc = self.run, self.ctx.cfg.train
        run.model.train()
        try:
            while run.step < tc.max_steps:
                t0 = time.perf_counter()
                micro = self._micro_batches()
                self.meter.wait_s += time.perf_counter() - t0  # time spent fetching is data wait
                res = self._step(micro)
                if not self._account(micro, res):
                    continue
                self._log(micro[-1][0].epoch)
                t_pause = time.perf_counter()
                if run.step < tc.max_steps and self.interrupts.agreed(self.ctx.comm):  # every rank, this step
                    return self._preempted(step_s=t_pause - t0)
                val_loss = self._validate()
                # a signal during validation (minutes on a large dev set) is acted on now, not after another step
                if val_loss is not None and run.step < tc.max_steps and self.interrupts.agreed(self.ctx.comm):
                    return self._preempted(step_s=t_pause - t0, val_loss=val_loss)
                self._checkpoint(val_loss)
                self.meter.pause_s += time.perf_counter() - t_pause
                # the fault seam: after any checkpoint of this step, so a test can crash right after a save
                faults.point(f"train.step.rank{self.ctx.world.rank}", run.step,
                             once_marker=self.out / f".fault_step_{run.step}.done")
        finally:
            self.close()
        return {**self.last, "step": run.step, "out_dir": tc.out_dir, "oom_splits": run.oom_splits,
                **self.guard.counters()}

    def _micro_batches(self) -> list:
        """The next grad_accum_steps (batch, loader state) pairs; the closed loop decides at an epoch's start."""
        micro: list = []
        while len(micro) < self.ctx.cfg.train.grad_accum_steps:
            # fork_rng: DataLoader draws a base seed from the global CPU RNG when an iterator starts; keep the
            # global RNG for dropout only, so a resumed run (new iterator) continues the same dropout stream
            with torch.random.fork_rng(devices=[]):
                item = next(self.batches)
            if not micro and self.closed.due(item) and self._replanned(item):
                continue  # this epoch's first batch was planned with the old table: read the new plan's
            micro.append(item)
        return micro

    def _replanned(self, item: tuple) -> bool:
        """Between epochs: the closed loop's decision over all ranks; when the table moved, the loader restarts
        at the epoch's start with it."""
        run, ctx = self.run, self.ctx
        table, row = self.closed.boundary(ctx.comm, run.raw_model, run.optimizer, ctx.device, item[0].epoch,
                                          run.step + 1)
        self.metrics.log(row)
        if table is None:
            return False
        self.ctx = replace(ctx, cfg=with_table(ctx.cfg, table), table=self.closed.table)
        self.batches.close()
        state = {**(run.loader_state or item[1]), "epoch": item[0].epoch, "step": 0, "chain": []}
        self.loader.restart(self._stream_cfg(), state)
        self.batches = iter(self.loader)
        return True

    def _step(self, micro: list) -> StepResult:
        """One optimiser step over the micro-batches, recorded: the key log before it (what the step was given),
        the ledger after it (what reached the weights)."""
        run, nxt = self.run, self.run.step + 1
        if self.keylog is not None:
            self.keylog.write(nxt, micro)
        res = optimiser_step(self.ctx, run, micro)
        if run.ledger is not None:
            run.ledger.add(nxt, micro, dropped=_not_trained(res, micro))
        return res

    def _oom_point(self, step: int) -> None:
        """The in-step fault seam `train.step.rank<r>` (action "oom"), once per step and run folder."""
        faults.point(f"train.step.rank{self.ctx.world.rank}", step, actions=("oom",),
                     once_marker=self.out / f".fault_oom_step_{step}.done")

    def _account(self, micro: list, res: StepResult) -> bool:
        """Count the step's outcome; False for a step no rank had a target token for (not taken: no step, no
        schedule, nothing to log or save; StreamError after MAX_EMPTY_STEPS in a row)."""
        run = self.run
        self.guard.after_step(run.step + 1, nonfinite=res.nonfinite, overflow=res.overflow,
                             impossible=res.impossible, samples=res.samples)
        self._record_memory(micro, res)
        run.loader_state = micro[-1][1]
        if res.global_tokens <= 0:
            self.tokenless += 1
            if self.tokenless >= MAX_EMPTY_STEPS:
                raise StreamError(f"{self.tokenless} batches in a row with no sample or no target token on any rank "
                                  f"before step {run.step + 1}: every sample failed to decode, or the transcripts "
                                  f"are empty; check {self.ctx.cfg.train.data_url} (`shardtrain inspect --verify`)")
            return False
        self.tokenless = 0
        run.step += 1
        self.bar.update(1)
        # a skipped non-finite step still counts (scheduler and data moved on); its loss stays out of the mean
        self.meter.add(0.0 if res.nonfinite else res.loss, 0.0 if res.nonfinite else res.global_tokens,
                       sum(float(b.durations_s.sum()) for b, _ in micro))
        return True

    def _record_memory(self, micro: list, res: StepResult) -> None:
        """Per-bucket peaks into the closed loop and the interval; one metrics row per OOM split."""
        run = self.run
        for bucket, peak in res.peaks:
            self.meter.mem_peak = max(self.meter.mem_peak, peak)
            self.closed.record(bucket, peak)
        for ev in res.events:
            run.oom_splits += 1
            self.closed.record_oom(micro, ev)
            self.metrics.log({"step": run.step + 1, **ev, "oom_splits": run.oom_splits})
            log.warning("step %d: out of memory on rank(s) %s; redone in %d parts per micro-batch %s, %d samples, "
                        "none lost (%d so far)", run.step + 1, ev["ranks"], ev["parts"], ev["micro_batches"],
                        ev["samples"], run.oom_splits)

    def _log(self, epoch: int) -> None:
        """Every log_every_steps and at the end: one metrics row (one all-reduce); without a terminal (torchrun,
        SLURM, a pipe) also one progress line."""
        run, ctx, tc = self.run, self.ctx, self.ctx.cfg.train
        if not (run.step % tc.log_every_steps == 0 or run.step == tc.max_steps):
            return
        lr = float(run.scheduler.get_last_lr()[0])
        row = self.meter.row(run.step, lr, ctx.comm, float(self.loader.stats()["skipped"]), epoch, ctx.device)
        row.update(self._dataset_seconds())
        row.update(self.guard.counters())
        self.metrics.log(row)
        self.bar.set_postfix(loss=f"{row['loss']:.3f}")
        if self.bar.disable and ctx.world.is_main:
            log.info("step %d/%d  loss %.3f  %.0f audio-s/s  data wait %.0f%%  lr %.2e  skipped %d", run.step,
                     tc.max_steps, row["loss"], row["audio_s_per_s"], row["data_wait_pct"], row["lr"],
                     row["skipped"])
        self.last.update(row)

    def _dataset_seconds(self) -> dict:
        """A mixture's audio seconds per dataset so far, summed over ranks (one small all-reduce): `audio_s/d<i>`."""
        secs = self.loader.stats().get("dataset_seconds")
        if not secs:
            return {}
        return {f"audio_s/d{i}": s for i, s in enumerate(self.ctx.comm.sum(list(secs)))}

    def _preempted(self, step_s: float, val_loss: float | None = None) -> dict:
        """Checkpoint this step on every rank (a failure raises: there is no later chance), log the delay next to
        the step's duration (`step_s`: the bound is one step, or the step's validation, plus the write)."""
        run, t0 = self.run, time.time()
        self._checkpoint(val_loss, force=True)
        done = time.time()
        row = {"step": run.step, "event": "preempted", "signal": self.interrupts.pre.name(),
               "preempt_s": round(done - (self.interrupts.pre.t_signal or t0), 3), "checkpoint_s": round(done - t0, 3),
               "step_s": round(step_s, 3)}
        self.metrics.log(row)
        log.warning("step %d: %s received; checkpoint %s committed %.2f s after the signal (write %.2f s); "
                    "exiting to be resumed with --resume", run.step, row["signal"], self.last.get("checkpoint"),
                    row["preempt_s"], row["checkpoint_s"])
        return {**self.last, **row, "preempted": True, "out_dir": self.ctx.cfg.train.out_dir,
                "oom_splits": run.oom_splits}

    def _validate(self) -> float | None:
        """Validate every `val_every_steps` and at the end; returns the pooled val_loss when it ran (evaluate.py)."""
        run, tc = self.run, self.ctx.cfg.train
        end = run.step == tc.max_steps
        if not tc.val_data_url or not (end or (tc.val_every_steps and run.step % tc.val_every_steps == 0)):
            return None
        sets = val_sets(tc)
        log.info("step %d: validating on %s", run.step, ", ".join(f"{s.name} ({s.url})" for s in sets))
        with torch.random.fork_rng(devices=[]):  # validation must not shift the training RNG streams
            res = evaluate(self.ctx, run.raw_model, run.tok, self.storage_options)
        row = metrics_row(res, run.step)
        self.metrics.log(row)
        self.last.update(row, val_examples=res["examples"])
        self._log_validation(res, len(sets))
        if res["unalignable"]:
            log.warning("step %d: %d validation utterance(s) have transcripts CTC cannot align in the model's output "
                        "frames: left out of val_loss (CER/WER count them)", run.step, res["unalignable"])
        if res["val_loss"] == res["val_loss"]:  # NaN (nothing alignable) is no best
            run.best_val = min(run.best_val, res["val_loss"])
        return res["val_loss"]

    def _log_validation(self, res: dict, n_sets: int) -> None:
        """Examples (log + TensorBoard text) and one line of rates per set, and the pooled line for several."""
        step = self.run.step
        for name, s in res["sets"].items():
            for ref, hyp in s["examples"]:
                head = f"step {step}  {name} "
                log.info("%sref: %s\n%shyp: %s", head, printable(ref), " " * len(head), printable(hyp))
                self.metrics.text(f"val/{name}/example", f"REF: {ref}  \nHYP: {hyp}", step)
            log.info("step %d: %s  val_loss %.4f  CER %.2f%%  WER %.2f%%  (%d utterances, %.0f s)", step, name,
                     s["loss"], 100 * s["cer"], 100 * s["wer"], s["utts"], s["audio_s"])
        if n_sets > 1:
            log.info("step %d: all %d sets (pooled)  val_loss %.4f  CER %.2f%%  WER %.2f%%", step, n_sets,
                     res["val_loss"], 100 * res["cer"], 100 * res["wer"])

    def _checkpoint(self, val_loss: float | None, *, force: bool = False) -> None:
        """Save every `ckpt_every_steps`, at the end and when `force`d (all ranks take part: each writes its own
        RNG + loader state). A failed periodic save is logged and training goes on (MAX_CKPT_FAILURES)."""
        run, tc = self.run, self.ctx.cfg.train
        end = run.step == tc.max_steps
        if not (force or end or (tc.ckpt_every_steps and run.step % tc.ckpt_every_steps == 0)):
            return
        try:
            self._save(val_loss)
            run.ckpt_failures = 0
        except ckpt.CheckpointWriteError as e:
            run.ckpt_failures += 1
            if force or end or run.ckpt_failures >= MAX_CKPT_FAILURES:
                raise
            log.warning("%s; training goes on (%d of %d failures in a row allowed)", e, run.ckpt_failures,
                        MAX_CKPT_FAILURES - 1)
            self.metrics.log({"step": run.step, "event": "checkpoint_failed", "reason": str(e)})

    def _save(self, val_loss: float | None) -> None:
        run, ctx, tc = self.run, self.ctx, self.ctx.cfg.train
        check_finite_weights(run.raw_model, run.step)  # every rank holds the same weights: all refuse together
        if run.ledger is not None:  # before the checkpoint commits: a file without its checkpoint is cut on resume
            run.ledger.flush(run.step)
        meta = {"val_loss": val_loss, "config": to_dict(ctx.cfg), "time_unix": time.time(),
                "grad_accum_steps": tc.grad_accum_steps, "elastic_accum": run.resized is not None,
                "tokenizer": run.tok.to_json()}  # the step's own: RUN/vocab.json may be a later run's
        parts = run.checkpoint_parts(ctx.device, self.closed, main=ctx.world.is_main, meta=meta)
        path = ckpt.save_checkpoint(self.ckpt_dir, parts, world=ctx.world, keep_last=tc.keep_last,
                                    storage_options=self.storage_options, agree=ctx.comm.any)
        self.last["checkpoint"] = str(path)
        if ctx.world.is_main and ckpt.is_remote(tc.out_dir):
            runfiles.push_run_files(self.out, tc.out_dir, self.storage_options)

    def close(self) -> None:
        """Stop the loader's prefetch threads/workers; close the key log, the progress bar and the metrics."""
        self.batches.close()
        if self.keylog is not None:
            self.keylog.close()
        self.bar.close()
        self.metrics.close()

    # -- start-up
    def _fetch_run_folder(self, cfg: RunConfig, world: World, comm: Collectives) -> None:
        """The run folder on rank 0 (fetched from the object store for an s3:// --out), then every rank goes on."""
        if world.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            if ckpt.is_remote(cfg.train.out_dir):
                runfiles.fetch_run_files(cfg.train.out_dir, self.out, self.storage_options)
        comm.barrier()

    def _restore(self, cfg: RunConfig, resume: bool, world: World, device: torch.device,
                 comm: Collectives) -> RunState:
        """Model, optimiser, scheduler and scaler, from the newest intact checkpoint when resuming (before the
        step context exists: the config may still change, so world, device and collectives come as arguments)."""
        tc = cfg.train
        latest = ckpt.latest_checkpoint(self.ckpt_dir, self.storage_options)
        if latest is not None and not resume:
            raise ValueError(f"{os.path.dirname(str(self.ckpt_dir))} already holds checkpoints "
                             f"({os.path.basename(str(latest))}); pass --resume to continue it, or choose a new --out")
        latest, state = (ckpt.load_newest_intact(
            self.ckpt_dir, rank=world.rank, world_size=world.world_size,
            agree=comm.any,
            storage_options=self.storage_options) if resume and latest else (None, None))
        if resume and state is None:
            log.info("--resume: no checkpoint in %s yet; starting from scratch", self.ckpt_dir)
        tok = tokenizer_from_json(state["main"]["tokenizer"]) if state else \
            build_tokenizer(tc, world, self.storage_options, cfg.text)
        if world.is_main:
            warn_missing_chars(val_sets(tc), tok, self.storage_options)  # once, at start: what validation lacks
        run = RunState.build(cfg, tok, device)
        if state and latest is not None:
            run.fit_model(state, cfg, latest)
            run.load(state, device, seed=tc.seed * 1000 + world.rank)
            run.resized = elastic.decide(state["meta"], cfg, world.world_size)
            stored, now = state["meta"]["config"], json.loads(json.dumps(to_dict(cfg)))
            changed = sorted(k for k in stored if stored[k] != now.get(k))
            if changed:
                log.warning("resuming %s with a changed config in sections %s", os.path.basename(str(latest)),
                            changed)
            log.info("resumed from %s at step %d", latest, run.step)
        else:
            torch.manual_seed(tc.seed * 1000 + world.rank)  # dropout streams differ per rank
        if world.world_size > 1 and not cfg.budget.oom_split:
            run.model = DDP(run.raw_model, device_ids=[device.index] if device.type == "cuda" else None)
        elif world.world_size > 1:  # update.py all-reduces the gradients itself, after every rank's backward
            broadcast_params(run.raw_model)
        return run

    def _write_run_files(self) -> None:
        """config.json (the resolved config) and vocab.json, on rank 0."""
        ctx = self.ctx
        if not ctx.world.is_main:
            return
        tmp = self.out / "config.json.tmp"
        tmp.write_text(json.dumps(to_dict(ctx.cfg), indent=1, sort_keys=True))
        os.replace(tmp, self.out / "config.json")
        (self.out / "vocab.json").write_text(json.dumps(self.run.tok.to_json()))
        log.info("model: %.2fM parameters, vocabulary %d, device %s, world size %d",
                 num_parameters(self.run.raw_model) / 1e6, len(self.run.tok), ctx.device,
                 ctx.world.world_size)

    def _open_outputs(self) -> None:
        """Metrics (cut back to the resumed step), key log, the endless loader from the run's cursor, ledger."""
        run, tc, world = self.run, self.ctx.cfg.train, self.ctx.world
        redone = redone_after(self.out / "metrics.jsonl", run.step) if world.is_main else None  # before the cut
        self.metrics = MetricsLogger(self.out, active=world.is_main, tensorboard=tc.tensorboard, start_step=run.step)
        if run.resized is not None:
            self.metrics.log(run.resized.row(run.step))
        self.keylog = KeyLog(self.out, world.rank, run.step, world.world_size) if tc.log_keys else None
        self.loader = build_loader(data_sources(tc), world=world, seed=tc.seed, cfg=self._stream_cfg(),
                                   state=run.loader_state, storage_options=self.storage_options)
        run.ledger = self._start_ledger(redone) if tc.ledger else None
        self.batches = iter(self.loader)

    def _stream_cfg(self):
        """An endless stream, asked for explicitly (a default StreamConfig runs one epoch): max_steps ends training."""
        return replace(self.ctx.cfg.stream, epochs=None)

    def _start_ledger(self, redone: dict | None) -> LedgerWriter:
        """This rank's ledger for the attempt starting at run.step; the attempt is named by rank 0's clock."""
        run, tc, world = self.run, self.ctx.cfg.train, self.ctx.world
        t_ms = int(self.ctx.comm.sum([time.time() * 1000.0 if world.is_main else 0.0])[0])
        sources = data_sources(tc)
        pairs = [(sources, 1.0)] if isinstance(sources, str) else sources
        # content ids (shard sha256s) let `shardtrain ledger` refuse a dataset re-packed since (same rows, other audio);
        # the loader's, in the sources' order: each manifest is opened once per run
        datasets = [{"url": u, "weight": w, "content": c} if world.is_main else {"url": u, "weight": w}
                    for (u, w), c in zip(pairs, self.loader.content_ids, strict=True)]
        ledger = LedgerWriter(self.out, rank=world.rank, attempt=attempt_id(run.step, t_ms),
                              remote=tc.out_dir if ckpt.is_remote(tc.out_dir) else None,
                              storage_options=self.storage_options)
        if world.is_main:
            ledger.start(start_step=run.step, world_size=world.world_size, datasets=datasets, redone=redone)
        return ledger


@dataclass(slots=True)
class Interval:
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

    def row(self, step: int, lr: float, comm: Collectives, skipped: float, epoch: int, device: torch.device) -> dict:
        """The metrics line (one all-reduce over ranks), then start a new interval."""
        loss_g, audio_g, skipped_g = comm.sum([self.loss, self.audio_s, skipped])
        elapsed = max(time.perf_counter() - self.t0 - self.pause_s, 1e-9)
        row = {"step": step, "loss": loss_g / max(self.tokens, 1.0), "lr": lr, "audio_s": round(audio_g, 3),
               "audio_s_per_s": audio_g / elapsed, "data_wait_pct": 100.0 * self.wait_s / elapsed,
               "skipped": int(skipped_g), "epoch": epoch}
        if device.type == "cuda":
            row["gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if self.mem_peak:
            row["mem_peak_mb"] = comm.max([self.mem_peak])[0] / 2**20
        self.loss = self.tokens = self.audio_s = self.wait_s = self.pause_s = self.mem_peak = 0.0
        self.t0 = time.perf_counter()
        return row


def _not_trained(res: StepResult, micro: list) -> list:
    """Per micro-batch, the mask of utterances that did not reach the weights (for the ledger): all of them when
    the update was skipped (non-finite, fp16 overflow) or the step not taken (no sample or target token on any
    rank), else the ones dropped before the loss (CTC cannot align them), None for none."""
    if res.nonfinite or res.overflow or res.samples == 0 or res.global_tokens <= 0:
        return [np.ones(len(batch), bool) for batch, _ in micro]
    return res.dropped or [None] * len(micro)
