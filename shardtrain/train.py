"""Training loop: streamed batches -> device augmentation -> model under DDP -> step -> metrics + checkpoints.

    Loader (batch, state) x grad_accum_steps
      -> targets via the tokenizer; ONE all-reduce of the token count (the loss denominator across ranks)
      -> waves.to(device) -> DeviceAugment(generator seeded from (seed, epoch, step, rank)) -> feats
      -> model (DDP; no_sync on all but the last micro-batch) -> CTC loss summed over tokens
      -> backward of loss_sum * world_size / global_tokens   (DDP averages gradients, so this is the
         exact per-token mean over every rank and micro-batch, whatever each rank's batch size)
      -> unscale, clip, AdamW step, warm-up + cosine lr -> log / validate / checkpoint

One process on CPU:
    shardtrain train --data shards/train --val-data shards/dev --pipeline tiny_cpu --max-steps 500 --out runs/tiny
Many GPUs (NCCL), restarting from the last checkpoint when a rank dies:
    torchrun --nproc_per_node=8 --max-restarts 3 -m shardtrain train --data s3://bucket/librispeech/train \\
        --val-data s3://bucket/librispeech/dev --pipeline librispeech_base --max-steps 100000 --out /ckpt/ls \\
        --set train.grad_accum_steps=2 --set train.precision=bf16

Empty batches (every sample of a planned batch failed to decode) still take part in the step: the rank runs
the model on a half-second silent dummy and multiplies its loss by 0, so DDP's gradient all-reduce always sees
every rank. If no rank has a single target token in a step, all ranks skip the optimiser step together.
Resume is bit-exact on CPU: the loader state of the last consumed batch, the torch RNG state of every rank,
model, optimiser, scheduler and scaler are restored, and augmentation randomness depends only on
(seed, epoch, step, rank).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from shardtrain import checkpoint as ckpt
from shardtrain.augment import AugmentConfig
from shardtrain.evaluate import Augmenters, Collectives, autocast, evaluate, to_device
from shardtrain.features import FeatureConfig
from shardtrain.metrics import MetricsLogger
from shardtrain.model import ModelConfig, build_model, num_parameters
from shardtrain.overrides import to_dict
from shardtrain.stream import StreamConfig, build_loader
from shardtrain.text import CharVocab, SentencePieceVocab, tokenizer_from_json
from shardtrain.world import World

log = logging.getLogger(__name__)
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    data_url: str = ""
    """Training dataset URL (path, file://, s3://); `--data`."""
    val_data_url: str = ""
    """Validation dataset URL; empty disables validation; `--val-data`."""
    out_dir: str = ""
    """Run directory: config.json, metrics.jsonl, tensorboard/, checkpoints/; `--out`."""
    max_steps: int = 1000
    """Optimiser steps to train for; `--max-steps`."""
    seed: int = 0
    """Seeds model init, loader plan, dropout and augmentation."""
    device: str = "auto"
    """"auto" (cuda:LOCAL_RANK when available, else cpu), "cpu" or "cuda"."""
    lr: float = 1e-3
    """Peak learning rate (after warm-up)."""
    min_lr_ratio: float = 0.05
    """Cosine decay ends at lr x min_lr_ratio at max_steps."""
    warmup_steps: int = 100
    """Linear warm-up from 0 to lr."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay on matrices (not on biases and norms)."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas."""
    grad_clip_norm: float = 5.0
    """Clip the global gradient norm to this; 0 disables."""
    grad_accum_steps: int = 1
    """Micro-batches per optimiser step (each is one loader batch per rank)."""
    precision: str = "fp32"
    """"fp32", "bf16" (autocast) or "fp16" (autocast + grad scaler)."""
    augment: bool = True
    """Apply the augmentation chain in training (features are always computed); False = features only."""
    tokenizer: str = "char"
    """"char" (vocabulary built from the training index) or "sentencepiece" (needs the package)."""
    sentencepiece_model: str = ""
    """Path of a trained SentencePiece model when tokenizer="sentencepiece"."""
    log_every_steps: int = 10
    """Training metrics line every N steps (one small all-reduce)."""
    val_every_steps: int = 200
    """Validate every N steps and at the end; 0 = only at the end."""
    val_max_batches: int | None = None
    """Cap validation batches per rank; None = the whole validation set."""
    val_examples: int = 3
    """Example transcripts (reference / hypothesis) logged at each validation."""
    ckpt_every_steps: int = 200
    """Checkpoint every N steps and at the end; 0 = only at the end."""
    keep_last: int = 3
    """Checkpoints kept besides the best by validation loss."""
    tensorboard: bool = True
    """Also write TensorBoard events under out_dir/tensorboard."""
    progress: bool = True
    """tqdm progress bar on rank 0 (only when stderr is a terminal)."""
    cpu_threads: int = 0
    """torch intra-op threads when training on the CPU; 0 keeps torch's default. On a busy machine (or beside the
    loader's decode threads) 1 can be several times faster for small models: OpenMP threads spin-wait on each
    other when a core is taken (measured: 8.5 s vs 54 s for 30 tiny steps on 2 loaded cores)."""
    fail_at_step: int | None = None
    """Test hook: the last rank raises once after this step (a marker file in out_dir makes it once only)."""

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError("train.max_steps (--max-steps) must be >= 1")
        if self.grad_accum_steps < 1:
            raise ValueError("train.grad_accum_steps must be >= 1")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.tokenizer not in ("char", "sentencepiece"):
            raise ValueError("train.tokenizer must be 'char' or 'sentencepiece'")
        if self.tokenizer == "sentencepiece" and not self.sentencepiece_model:
            raise ValueError("train.tokenizer=sentencepiece needs train.sentencepiece_model=PATH")
        if self.lr <= 0 or self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("train.lr must be > 0, train.warmup_steps >= 0, train.min_lr_ratio in [0, 1]")
        if self.cpu_threads < 0:
            raise ValueError("train.cpu_threads must be >= 0 (0 = torch default)")
        if self.log_every_steps < 1 or self.keep_last < 0:
            raise ValueError("train.log_every_steps must be >= 1 and train.keep_last >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything a run needs; presets in pipelines/<name>.py return one, `--set a.b=v` edits any leaf."""

    stream: StreamConfig = field(default_factory=StreamConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    features: FeatureConfig = field(default_factory=FeatureConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


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


def _build_tokenizer(cfg: TrainConfig, world: World, storage_options: dict | None):
    if cfg.tokenizer == "sentencepiece":
        return SentencePieceVocab(cfg.sentencepiece_model)
    # rank 0 reads the text column once and broadcasts the character list (not every rank re-reading it)
    chars = [CharVocab.from_index(cfg.data_url, storage_options).chars if world.is_main else None]
    if world.world_size > 1:
        dist.broadcast_object_list(chars, src=0)
    return CharVocab(chars[0])


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
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
    device = _resolve_device(tc, world)
    threads_before = torch.get_num_threads()
    if device.type == "cpu" and tc.cpu_threads > 0:
        torch.set_num_threads(tc.cpu_threads)
    own_pg = world.world_size > 1 and not dist.is_initialized()
    if own_pg:
        _init_process_group("nccl" if device.type == "cuda" else "gloo", world, attempt)
    try:
        return _train(cfg, world, device, resume, storage_options)
    finally:
        torch.set_num_threads(threads_before)
        if own_pg and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: RunConfig, world: World, device: torch.device, resume: bool, storage_options: dict | None) -> dict:
    tc = cfg.train
    out = Path(tc.out_dir)
    ckpt_dir = out / "checkpoints"
    comm = Collectives(world, device)
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
    comm.barrier()

    latest = ckpt.latest_checkpoint(ckpt_dir)
    if latest is not None and not resume:
        raise ValueError(f"{out} already holds checkpoints ({latest.name}); pass --resume to continue it, "
                         "or choose a new --out")
    state = ckpt.load_checkpoint(latest, rank=world.rank, world_size=world.world_size) if resume and latest else None
    if resume and state is None:
        log.info("--resume: no checkpoint in %s yet; starting from scratch", ckpt_dir)

    tok = tokenizer_from_json(state["main"]["tokenizer"]) if state else _build_tokenizer(tc, world, storage_options)
    torch.manual_seed(tc.seed)  # identical init on every rank (DDP also broadcasts rank 0's weights)
    raw_model = build_model(cfg.model, len(tok), cfg.features.n_mels).to(device)
    optimizer = _optimizer(raw_model, tc)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, tc))
    scaler = torch.amp.GradScaler(device.type, enabled=tc.precision == "fp16")
    step, loader_state, best_val = 0, None, math.inf
    if state:
        raw_model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["main"]["optimizer"])
        scheduler.load_state_dict(state["main"]["scheduler"])
        scaler.load_state_dict(state["main"]["scaler"])
        step = int(state["main"]["step"])
        best_val = float(state["main"].get("best_val_loss", math.inf))
        loader_state = json.loads(state["rank"]["loader_state"])
        torch.set_rng_state(state["rank"]["rng_cpu"])
        if device.type == "cuda" and state["rank"].get("rng_cuda") is not None:
            torch.cuda.set_rng_state(state["rank"]["rng_cuda"], device)
        stored, now = state["meta"]["config"], json.loads(json.dumps(to_dict(cfg)))
        changed = sorted(k for k in stored if stored[k] != now.get(k))
        if changed:
            log.warning("resuming %s with a changed config in sections %s", latest.name, changed)
        log.info("resumed from %s at step %d", latest, step)
    else:
        torch.manual_seed(tc.seed * 1000 + world.rank)  # dropout streams differ per rank
    model: torch.nn.Module = raw_model
    if world.world_size > 1:
        model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)

    if world.is_main:
        tmp = out / "config.json.tmp"
        tmp.write_text(json.dumps(to_dict(cfg), indent=1, sort_keys=True))
        os.replace(tmp, out / "config.json")
        (out / "vocab.json").write_text(json.dumps(tok.to_json()))
        log.info("model: %.2fM parameters, vocabulary %d, device %s, world size %d",
                 num_parameters(raw_model) / 1e6, len(tok), device, world.world_size)
    metrics = MetricsLogger(out, active=world.is_main, tensorboard=tc.tensorboard, start_step=step)
    loader = build_loader(tc.data_url, world=world, seed=tc.seed, cfg=cfg.stream, state=loader_state,
                          storage_options=storage_options)
    batches = iter(loader)
    augmenters = Augmenters(cfg, device)
    bar = tqdm(total=tc.max_steps, initial=step, disable=not (world.is_main and tc.progress and sys.stderr.isatty()),
               dynamic_ncols=True)

    last: dict = {}
    acc = {"loss": 0.0, "tokens": 0.0, "audio_s": 0.0, "wait_s": 0.0, "pause_s": 0.0}
    t_interval = time.perf_counter()
    model.train()
    try:
        while step < tc.max_steps:
            # ---- fetch the micro-batches of this step (time spent here is data wait)
            t0 = time.perf_counter()
            # fork_rng: DataLoader draws a base seed from the global CPU RNG when an iterator starts; keep the
            # global RNG for dropout only, so a resumed run (new iterator) continues the same dropout stream
            with torch.random.fork_rng(devices=[]):
                micro = [next(batches) for _ in range(tc.grad_accum_steps)]
            acc["wait_s"] += time.perf_counter() - t0
            encoded = [to_device(b, device, tok) for b, _ in micro]
            local_tokens = float(sum(e[2].numel() for e in encoded))  # shape only: no device sync
            (global_tokens,) = comm.sum([local_tokens])  # the loss denominator: every token of every rank

            if global_tokens > 0:
                loss_acc = torch.zeros((), device=device)
                for i, ((batch, _), (waves, lengths, targets, target_lengths)) in enumerate(zip(micro, encoded)):
                    gen = torch.Generator().manual_seed(augment_seed(tc.seed, batch.epoch, batch.step, world.rank))
                    with torch.no_grad():
                        feats, feat_lengths = augmenters(waves, lengths, batch.sample_rate_hz, gen, train=tc.augment)
                    last_micro = i == tc.grad_accum_steps - 1
                    sync = contextlib.nullcontext() if last_micro or not isinstance(model, DDP) else model.no_sync()
                    with sync:
                        with autocast(tc, device):
                            loss_sum, _, _ = model(feats, feat_lengths, targets, target_lengths)
                        if len(batch) == 0:
                            loss_sum = loss_sum * 0.0  # dummy forward: joins the all-reduce, adds nothing
                            log.warning("rank %d: empty batch (epoch %d, batch %d): every sample failed to "
                                        "decode; joining step %d with a silent dummy", world.rank, batch.epoch,
                                        batch.step, step + 1)
                        scaler.scale(loss_sum * (world.world_size / global_tokens)).backward()
                    loss_acc += loss_sum.detach().float()
                if tc.grad_clip_norm > 0:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(raw_model.parameters(), tc.grad_clip_norm)
                scaler.step(optimizer)
                scaler.update()
                acc["loss"] += float(loss_acc)  # device->host sync once per step
            else:
                log.warning("step %d: no target tokens on any rank; optimiser step skipped", step + 1)
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step += 1
            bar.update(1)
            acc["tokens"] += global_tokens
            acc["audio_s"] += sum(float(b.durations_s.sum()) for b, _ in micro)
            loader_state = micro[-1][1]

            if step % tc.log_every_steps == 0 or step == tc.max_steps:
                loss_g, audio_g, skipped = comm.sum([acc["loss"], acc["audio_s"], float(loader.stats()["skipped"])])
                elapsed = time.perf_counter() - t_interval - acc["pause_s"]  # validation/checkpoint excluded
                row = {"step": step, "loss": loss_g / max(acc["tokens"], 1.0), "lr": scheduler.get_last_lr()[0],
                       "audio_s_per_s": audio_g / max(elapsed, 1e-9),
                       "data_wait_pct": 100.0 * acc["wait_s"] / max(elapsed, 1e-9), "skipped": int(skipped),
                       "epoch": micro[-1][0].epoch}
                if device.type == "cuda":
                    row["gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                metrics.log(row)
                bar.set_postfix(loss=f"{row['loss']:.3f}")
                last.update(row)
                acc = dict.fromkeys(acc, 0.0)
                t_interval = time.perf_counter()

            val_loss = None
            end = step == tc.max_steps
            t_pause = time.perf_counter()
            if tc.val_data_url and (end or (tc.val_every_steps and step % tc.val_every_steps == 0)):
                with torch.random.fork_rng(devices=[]):  # validation must not shift the training RNG streams
                    res = evaluate(raw_model, cfg, world, tok, augmenters, device, comm, storage_options)
                val_loss = res["val_loss"]
                row = {"step": step, **{k: res[k] for k in ("val_loss", "cer", "wer")}}
                metrics.log(row)
                last.update(row, val_examples=res["examples"])
                for ref, hyp in res["examples"]:
                    log.info("step %d  ref: %s\n%s hyp: %s", step, ref, " " * 14, hyp)
                    metrics.text("val/example", f"REF: {ref}  \nHYP: {hyp}", step)
                log.info("step %d: val_loss %.4f  CER %.2f%%  WER %.2f%%", step, val_loss, 100 * res["cer"],
                         100 * res["wer"])
                best_val = min(best_val, val_loss)

            if end or (tc.ckpt_every_steps and step % tc.ckpt_every_steps == 0):
                rank_state = {"rng_cpu": torch.get_rng_state(),
                              "rng_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                              "loader_state": json.dumps(loader_state)}
                main_state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                              "scaler": scaler.state_dict(), "step": step, "best_val_loss": best_val,
                              "tokenizer": tok.to_json()} if world.is_main else None
                path = ckpt.save_checkpoint(
                    ckpt_dir, step=step, rank=world.rank, world_size=world.world_size, barrier=comm.barrier,
                    rank_state=rank_state, main_state=main_state,
                    model_state=raw_model.state_dict() if world.is_main else None,
                    meta={"val_loss": val_loss, "config": to_dict(cfg), "time_unix": time.time()},
                    keep_last=tc.keep_last)
                last["checkpoint"] = str(path)
            acc["pause_s"] += time.perf_counter() - t_pause

            # after any checkpoint of this step, so a test can crash right after a save
            if tc.fail_at_step is not None and step == tc.fail_at_step and world.rank == world.world_size - 1:
                marker = out / f".fail_at_step_{step}.done"
                if not marker.exists():
                    marker.write_text("injected failure happened\n")
                    raise RuntimeError(f"injected failure at step {step} on rank {world.rank} (train.fail_at_step)")
    finally:
        batches.close()  # stops the loader's prefetch threads/workers
        bar.close()
        metrics.close()
    return {**last, "step": step, "out_dir": str(out)}
