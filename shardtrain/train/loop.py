"""The training process: device, process group, signal handlers and the run folder's lease around a Trainer.

    train(cfg, world): device (+ CPU threads) -> signal handlers (preempt.py) -> process group (gloo on CPU, NCCL on
    CUDA; per restart attempt its own store prefix) -> rank 0 takes the run folder's lease -> Trainer(...).fit()
    (train/trainer.py: the step loop) -> everything undone in reverse, whatever happened

One process on CPU:
    shardtrain train --data shards/train --val-data shards/dev --pipeline tiny_cpu --max-steps 500 --out runs/tiny
Many GPUs (NCCL), restarting from the last checkpoint when a rank dies:
    torchrun --nproc_per_node=8 --max-restarts 3 -m shardtrain train --data s3://bucket/librispeech/train \\
        --val-data s3://bucket/librispeech/dev --pipeline librispeech_base --max-steps 100000 --out /ckpt/ls \\
        --set train.grad_accum_steps=2 --set train.precision=bf16

A cluster's run: SIGTERM/SIGUSR1/Ctrl-C stop every rank at the same step with a checkpoint (preempt.py; the CLI
exits 75); rank 0 holds the run folder's lease while training (runfiles.RunLease). Storage that stays down past
`stream.retry_budget_s`, refused credentials or a missing shard raise StreamError from the loader: the run stops,
to be resumed. Only this module is the entry: integrations import the schedule from train/schedule.py.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from shardtrain.storage.lock import LockHeld
from shardtrain.train import runfiles
from shardtrain.train.config import RunConfig, TrainConfig
from shardtrain.train.preempt import Preemption, parse_signals
from shardtrain.train.trainer import Interrupts, Trainer
from shardtrain.train.valsets import check_val_sets, val_sets
from shardtrain.world import World


def _resolve_device(cfg: TrainConfig, world: World) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    torch.cuda.set_device(world.local_rank)
    return torch.device("cuda", world.local_rank)


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
        return Trainer(cfg, world, device, resume=resume, storage_options=storage_options,
                       interrupts=Interrupts(pre, lease)).fit()
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
