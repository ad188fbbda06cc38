"""What a training run carries from step to step, built fresh or restored from a checkpoint, and saved with one.

    RunState.build(cfg, tokenizer, device): model (+ QAT), AdamW, warm-up + cosine LambdaLR, GradScaler
      -> load(checkpoint state): optimiser, scheduler, scaler, step, best val loss, loader cursor, OOM split levels,
         the closed loop's state and this rank's RNG (a rank the checkpoint's smaller world lacked gets a fresh seed)
      -> checkpoint_parts(): rank_state() / main_state(closed loop), what every rank / rank 0 writes into the
         next checkpoint (checkpoint.CheckpointParts)

Kept apart from the trainer (train/trainer.py) so the trainer reads as the step loop alone; the state's fields are
what update.py's optimiser step uses (`tok`, `raw_model`, `model`, `optimizer`, `scheduler`, `scaler`, `step`,
`splits`); what stays fixed over the run is in its StepContext (train/step.py).
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from shardtrain.train import checkpoint as ckpt
from shardtrain.train import elastic
from shardtrain.train.budget import read_budget
from shardtrain.train.closedloop import ClosedLoop, table_of, with_table
from shardtrain.train.config import RunConfig, TrainConfig
from shardtrain.train.ledger import LedgerWriter
from shardtrain.train.memory import total_bytes
from shardtrain.train.model import build_model
from shardtrain.train.normalize import TextNormConfig
from shardtrain.train.overrides import to_dict
from shardtrain.train.qat import enable_qat
from shardtrain.train.schedule import lr_factor, make_optimizer
from shardtrain.train.text import CharVocab, SentencePieceVocab, Tokenizer
from shardtrain.train.update import SplitLevels
from shardtrain.world import World

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunState:
    """Everything a training run carries from step to step (and restores from a checkpoint)."""

    tok: Tokenizer
    raw_model: torch.nn.Module
    model: torch.nn.Module
    """raw_model, or raw_model under DDP (world size > 1 without budget.oom_split)."""
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
    """The closed loop's state from the checkpoint (train/closedloop.py), applied by `closed_loop`."""
    ckpt_failures: int = 0
    """Periodic checkpoints failed in a row (Trainer._checkpoint)."""

    @classmethod
    def build(cls, cfg: RunConfig, tok: Tokenizer, device: torch.device) -> "RunState":
        """A fresh model (seeded from train.seed: the same on every rank), optimiser, schedule and scaler."""
        tc = cfg.train
        torch.manual_seed(tc.seed)  # identical init on every rank (DDP also broadcasts rank 0's weights)
        raw_model = build_model(cfg.model, len(tok), cfg.features.n_mels)
        if tc.qat:  # fake-quant Linear layers (train/qat.py); parameters and state_dict keys are unchanged
            log.info("quantization-aware training: %d Linear layers fake-quantized", enable_qat(raw_model))
        raw_model = raw_model.to(device)
        optimizer = make_optimizer(raw_model, tc)
        return cls(tok=tok, raw_model=raw_model, model=raw_model, optimizer=optimizer,
                   scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, tc)),
                   scaler=torch.amp.GradScaler(device.type, enabled=tc.precision == "fp16"))

    def fit_model(self, state: dict, cfg: RunConfig, path: Path | str) -> None:
        """Load the checkpoint's weights, or one ValueError naming the config fields and tensor shapes that differ."""
        try:
            self.raw_model.load_state_dict(state["model"])
        except RuntimeError:
            why = ckpt.explain_mismatch(state["meta"].get("config", {}), json.loads(json.dumps(to_dict(cfg))),
                                        state["model"], self.raw_model.state_dict())
            raise ValueError(f"--resume: checkpoint {os.path.basename(str(path))} does not fit this model: {why}; "
                             "resume with the run's config (its config.json) or start a new --out") from None

    def load(self, state: dict, device: torch.device, seed: int) -> None:
        """Everything but the weights from a checkpoint's state; `seed` seeds a rank the checkpoint lacked."""
        main = state["main"]
        self.optimizer.load_state_dict(main["optimizer"])
        self.scheduler.load_state_dict(main["scheduler"])
        self.scaler.load_state_dict(main["scaler"])
        self.step = int(main["step"])
        self.best_val = float(main.get("best_val_loss", math.inf))
        self.loader_state = json.loads(state["rank"]["loader_state"])
        budget = json.loads(main.get("budget", "{}"))
        self.splits, self.oom_splits = SplitLevels.from_json(budget.get("splits")), int(budget.get("oom_splits", 0))
        self.budget_state = budget.get("closed_loop")
        if state["rank"]["rng_cpu"] is None:  # a rank the checkpoint's (smaller) world did not have
            torch.manual_seed(seed + 7919 * self.step)
            return
        torch.set_rng_state(state["rank"]["rng_cpu"])
        if device.type == "cuda" and state["rank"].get("rng_cuda") is not None:
            torch.cuda.set_rng_state(state["rank"]["rng_cuda"], device)

    def rank_state(self, device: torch.device) -> dict:
        """What every rank writes: its RNG and the loader state of the last consumed batch."""
        return {"rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                "loader_state": json.dumps(self.loader_state)}

    def checkpoint_parts(self, device: torch.device, closed: ClosedLoop, *, main: bool,
                         meta: dict) -> ckpt.CheckpointParts:
        """This rank's share of a checkpoint of the current step: its RNG and cursor; on rank 0 (`main`) also the
        weights (unwrapped from DDP), the main state and meta.json's fields. References, not copies: the save
        serialises them at once."""
        return ckpt.CheckpointParts(step=self.step, rank_state=self.rank_state(device),
                                    main_state=self.main_state(closed) if main else None,
                                    model_state=self.raw_model.state_dict() if main else None, meta=meta)

    def main_state(self, closed: ClosedLoop) -> dict:
        """What rank 0 writes besides the weights: optimiser, schedule, scaler, counters, tokenizer, budgets."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(), "step": self.step, "best_val_loss": self.best_val,
                "tokenizer": self.tok.to_json(),
                "budget": json.dumps({"splits": self.splits.to_json(), "oom_splits": self.oom_splits,
                                      "closed_loop": closed.state()})}


def build_tokenizer(cfg: TrainConfig, world: World, storage_options: dict | None, norm: TextNormConfig) -> Tokenizer:
    """The run's vocabulary: the SentencePiece model, or the characters of every training dataset's text."""
    if cfg.tokenizer == "sentencepiece":
        return SentencePieceVocab(cfg.sentencepiece_model, norm)
    # rank 0 reads the text column once and broadcasts the character list (not every rank re-reading it)
    urls = (cfg.data_url, *cfg.mix_urls)
    chars = [sorted(set().union(*(CharVocab.from_index(u, storage_options, norm).chars for u in urls)))
             if world.is_main else None]
    if world.world_size > 1:
        dist.broadcast_object_list(chars, src=0)
    return CharVocab(chars[0] or [], norm)


def closed_loop(cfg: RunConfig, run: RunState, device: torch.device) -> tuple[RunConfig, ClosedLoop]:
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
