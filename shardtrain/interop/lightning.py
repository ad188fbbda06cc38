"""PyTorch Lightning: a LightningDataModule over shardtrain datasets, and the CTC baseline as a LightningModule.

    Trainer(global_rank, world_size) -> ShardDataModule.train_dataloader()
      -> build_loader(world=World(rank, world_size), state=cursor from the checkpoint) -> BatchStream
      -> DataLoader(batch_size=None, num_workers=0)  (the loader decodes in its own threads)
      -> Lightning's prefetch -> on_before_batch_transfer (the batch now being trained: its cursor becomes the
         datamodule's state) -> Batch.to(device) -> CTCLightningModule.training_step

Resume: Lightning saves `ShardDataModule.state_dict()` in every checkpoint and restores it before it asks for
the train dataloader, so `trainer.fit(dm_module, datamodule=dm, ckpt_path=...)` continues mid-epoch with the
same next batches. The state is that of the batch Lightning is training on, not of the one it prefetched (the
fit loop fetches one batch ahead), and it is the same on every rank, so rank 0's checkpoint resumes all ranks.

CTCLightningModule reseeds torch's global RNG at every training batch from (seed, epoch, step, rank), so dropout
and augmentation depend only on which batch is trained, and a resumed run computes the same losses as an
uninterrupted one on CPU (Lightning's checkpoints do not hold RNG states). The loss is the per-token CTC mean of
each rank's batch (Lightning/DDP then averages gradients over ranks); shardtrain's own loop weights ranks by their
token counts instead.

Use it from Lightning (CPU or GPU, any number of devices):

    dm = ShardDataModule("shards/train", "shards/dev", stream=cfg.stream, seed=0)
    module = CTCLightningModule(cfg, CharVocab.from_index("shards/train", normalizer=cfg.text).to_json())
    trainer = build_trainer(cfg, "runs/pl", accelerator="auto", devices=2, strategy="ddp")
    trainer.fit(module, datamodule=dm)                       # add ckpt_path="runs/pl/checkpoints/last.ckpt"
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities.types import OptimizerLRSchedulerConfig

from shardtrain.interop.torchdata import BatchStream
from shardtrain.load.batch import Batch
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import Loader, build_loader
from shardtrain.train.config import RunConfig
from shardtrain.train.evaluate import validation_stream
from shardtrain.train.guards import alignable_tokens
from shardtrain.train.schedule import augment_seed, lr_factor
from shardtrain.train.model import build_model
from shardtrain.train.step import Augmenters, to_device
from shardtrain.train.text import tokenizer_from_json
from shardtrain.world import World

log = logging.getLogger(__name__)

PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
"""train.precision -> Lightning's precision (autocast and, for fp16, a GradScaler: what the trainer does)."""


class _TrackedStream(BatchStream):
    """BatchStream that remembers the loader state after each yielded batch, keyed by (epoch, step)."""

    def __init__(self, loader: Loader, pending: OrderedDict) -> None:
        super().__init__(loader)
        self.pending = pending

    def __iter__(self) -> Iterator[Batch]:
        for batch in super().__iter__():
            self.pending[(batch.epoch, batch.step)] = self.loader.state_dict()
            yield batch


class ShardDataModule(pl.LightningDataModule):
    """Train (and optionally validation) batches from shardtrain datasets, split by the Trainer's rank/world size.

    Training batches stream forever (stream.epochs is set to None, as the trainer does): drive the Trainer with
    `max_steps` and an integer `val_check_interval`. Validation reads the whole validation set once per check
    (`val_max_batches` caps it).
    """

    def __init__(self, train_url: str, val_url: str | None = None, *, stream: StreamConfig | None = None,
                 seed: int = 0, storage_options: dict | None = None) -> None:
        super().__init__()
        self.train_url, self.val_url, self.seed = train_url, val_url, seed
        self.stream = stream or StreamConfig()
        self.storage_options = storage_options
        self._state: dict | None = None
        """Loader state after the batch being trained (None before the first)."""
        self._pending: OrderedDict[tuple[int, int], dict] = OrderedDict()

    def _world(self) -> World:
        t = self.trainer
        if t is None:
            return World()
        return World(rank=t.global_rank, world_size=t.world_size, local_rank=t.local_rank)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        loader = build_loader(self.train_url, world=self._world(), seed=self.seed,
                              cfg=dataclasses.replace(self.stream, epochs=None),
                              state=self._state, storage_options=self.storage_options)
        self._pending.clear()
        return torch.utils.data.DataLoader(_TrackedStream(loader, self._pending), batch_size=None)

    def val_dataloader(self) -> torch.utils.data.DataLoader | list:
        if not self.val_url:
            return []
        # every utterance, as the trainer's validation: without the training filters, budgets that hold the longest
        loader = build_loader(self.val_url, world=self._world(), seed=self.seed,
                              cfg=validation_stream(self.stream, self.val_url, self.storage_options),
                              storage_options=self.storage_options)
        return torch.utils.data.DataLoader(BatchStream(loader), batch_size=None)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Called for the batch about to be trained (not the one prefetched): its cursor becomes the state."""
        t = self.trainer
        if isinstance(batch, Batch) and t is not None and t.training:
            key = (batch.epoch, batch.step)
            while self._pending and key in self._pending:
                k, state = self._pending.popitem(last=False)
                if k == key:
                    self._state = state
                    break
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self._state} if self._state is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = state_dict.get("loader")


class CTCLightningModule(pl.LightningModule):
    """shardtrain's CTC model, features and device augmentation (RunConfig's model/features/augment/train)."""

    def __init__(self, cfg: RunConfig, tokenizer: dict) -> None:
        super().__init__()
        self.cfg, self.tok = cfg, tokenizer_from_json(tokenizer)
        self.save_hyperparameters({"tokenizer": tokenizer, "config": dataclasses.asdict(cfg)})
        self.model = build_model(cfg.model, len(self.tok), cfg.features.n_mels)
        self._augmenters: Augmenters | None = None

    def _features(self, batch: Batch, train: bool) -> tuple[torch.Tensor, ...]:
        if self._augmenters is None or self._augmenters.device != self.device:
            self._augmenters = Augmenters(self.cfg, self.device)
        waves, lengths, targets, target_lengths = to_device(batch, self.device, self.tok)
        gen = None
        if train:
            gen = torch.Generator().manual_seed(augment_seed(self.cfg.train.seed, batch.epoch, batch.step,
                                                             self.global_rank))
        # outside Lightning's autocast, as the trainer runs them: in bf16/fp16 the resampler crashed on the CPU
        # (a dtype mismatch) and the log-mel lost precision on the GPU
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            feats, feat_lengths = self._augmenters(waves, lengths, batch.sample_rate_hz, gen,
                                                   train=train and self.cfg.train.augment)
        return feats, feat_lengths, targets, target_lengths

    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        # dropout depends only on the batch, so a resumed run repeats the uninterrupted run's losses
        torch.manual_seed(augment_seed(self.cfg.train.seed + 1, batch.epoch, batch.step, self.global_rank))

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        feats, feat_lengths, targets, target_lengths = self._features(batch, train=True)
        loss_sum, _, _ = self.model(feats, feat_lengths, targets, target_lengths)
        tokens, _ = alignable_tokens(self.model, feat_lengths, targets, target_lengths)  # per token CTC can align
        loss = loss_sum / max(tokens, 1.0) * (1.0 if len(batch) else 0.0)  # empty batch: joins DDP
        self.log("train_loss", loss, batch_size=max(len(batch), 1), prog_bar=True)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        if len(batch) == 0:
            return
        feats, feat_lengths, targets, target_lengths = self._features(batch, train=False)
        loss_sum, _, _ = self.model(feats, feat_lengths, targets, target_lengths)
        tokens, _ = alignable_tokens(self.model, feat_lengths, targets, target_lengths)
        # weighted by the tokens CTC can align, so the epoch's val_loss is the pooled per-token loss of those (an
        # utterance it cannot align adds zero_infinity's 0; counting its tokens read lower, and a set of only such
        # utterances as 0.0, the top-3's best for good); none at all gives 0/0 = NaN, which is never the best
        self.log("val_loss", loss_sum / max(tokens, 1.0), batch_size=int(tokens), sync_dist=True)

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        tc = self.cfg.train
        decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr, betas=tc.betas)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, tc))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def build_trainer(cfg: RunConfig, out_dir: str | Path, *, callbacks: list | None = None,
                  **trainer_kwargs: Any) -> pl.Trainer:
    """A Trainer with top-3 checkpoints by val_loss (`best-step=N-val_loss=X.ckpt`), one `step=N.ckpt` and a
    rolling `last.ckpt` every `train.ckpt_every_steps` (`shardtrain transcribe/evaluate/export RUN_DIR` read them),
    TensorBoard logs and an LR monitor, stepping `train.max_steps` and validating every `train.val_every_steps`.
    `train.grad_accum_steps` and `train.precision` become Lightning's accumulate_grad_batches and precision (left
    out, a config run by `shardtrain train` as bf16 with 8-step accumulation trained here in fp32 on 1/8 the
    global batch at the same learning rate, saying nothing). Lightning counts val_check_interval in batches, not
    optimiser steps: it is val_every_steps x grad_accum_steps.
    `callbacks` are added to these; `trainer_kwargs` (accelerator, devices, strategy, ...) override the defaults.
    The top-3 callback monitors val_loss, so give the ShardDataModule a validation set."""
    tc, out = cfg.train, Path(out_dir)
    val_every = tc.val_every_steps or tc.max_steps
    callbacks = [
        *(callbacks or []),
        ModelCheckpoint(dirpath=out / "checkpoints", filename="best-step={step}-val_loss={val_loss:.4f}",
                        monitor="val_loss", mode="min", save_top_k=3, auto_insert_metric_name=False),
        ModelCheckpoint(dirpath=out / "checkpoints", filename="step={step}", save_top_k=-1,  # step=200.ckpt
                        every_n_train_steps=tc.ckpt_every_steps or tc.max_steps, save_last=True,
                        auto_insert_metric_name=False),
        LearningRateMonitor(logging_interval="step"),
    ]
    kwargs: dict[str, Any] = dict(
        max_steps=tc.max_steps, val_check_interval=val_every * tc.grad_accum_steps, check_val_every_n_epoch=None,
        limit_val_batches=tc.val_max_batches if tc.val_max_batches is not None else 1.0,
        gradient_clip_val=tc.grad_clip_norm or None, accumulate_grad_batches=tc.grad_accum_steps,
        precision=PRECISIONS[tc.precision], log_every_n_steps=min(tc.log_every_steps, 50),
        logger=TensorBoardLogger(str(out), name="tensorboard"), callbacks=callbacks,
        default_root_dir=str(out), enable_progress_bar=tc.progress, num_sanity_val_steps=0)
    kwargs.update(trainer_kwargs)
    if not math.isfinite(float(kwargs["max_steps"])):
        raise ValueError("build_trainer needs a finite max_steps (the shardtrain stream repeats forever)")
    return pl.Trainer(**kwargs)
