"""What one batch needs on the device, shared by the training step and validation, and validation itself.

    Batch (CPU, pinned) -> to_device (targets via the tokenizer; B=0 -> a silent dummy) -> Augmenters (one
    DeviceAugment per input rate) -> model under `autocast` -> evaluate: loss, greedy CTC decode, CER/WER sums
    -> Collectives.sum (one all-reduce) -> per-token loss and error rates over every rank's share of the set.
"""
from __future__ import annotations

import dataclasses

from typing import cast

import torch

from shardtrain.load.loader import build_loader
from shardtrain.train.text import error_counts
from shardtrain.world import World
from shardtrain.train.config import RunConfig
from shardtrain.train.model import SpeechModel
from shardtrain.train.step import Augmenters, Collectives, autocast, to_device


def evaluate(model: torch.nn.Module, cfg: RunConfig, world: World, tok, augmenters: Augmenters,
             device: torch.device, comm: Collectives, storage_options: dict | None) -> dict:
    """Validation loss per token, CER and WER over the whole validation set (sums all-reduced across ranks).

    Uses the unwrapped model (no DDP collectives) and features without augmentation. Returns the metrics plus
    a few (reference, hypothesis) examples from this rank.
    """
    tc = cfg.train
    loader = build_loader(tc.val_data_url, world=world, seed=tc.seed, cfg=dataclasses.replace(cfg.stream, epochs=1),
                          storage_options=storage_options)
    model.eval()
    sums = {"loss": 0.0, "tokens": 0.0, "char_errors": 0.0, "chars": 0.0, "word_errors": 0.0, "words": 0.0}
    examples: list[tuple[str, str]] = []
    with torch.no_grad():
        for i, (batch, _) in enumerate(loader):
            if tc.val_max_batches is not None and i >= tc.val_max_batches:
                break
            if len(batch) == 0:
                continue
            waves, lengths, targets, target_lengths = to_device(batch, device, tok)
            feats, feat_lengths = augmenters(waves, lengths, batch.sample_rate_hz, None, train=False)
            with autocast(tc, device):
                loss_sum, outputs, out_lengths = model(feats, feat_lengths, targets, target_lengths)
            hyps = [tok.decode(ids) for ids in cast(SpeechModel, model).decode(outputs, out_lengths)]
            for k, v in error_counts(batch.texts, hyps).items():
                sums[k] += v
            sums["loss"] += float(loss_sum)
            sums["tokens"] += float(target_lengths.sum())
            examples.extend(zip(batch.texts, hyps))
    model.train()
    keys = list(sums)
    total = dict(zip(keys, comm.sum([sums[k] for k in keys])))
    return {"val_loss": total["loss"] / max(total["tokens"], 1.0), "cer": total["char_errors"] / max(total["chars"], 1.0),
            "wer": total["word_errors"] / max(total["words"], 1.0), "val_chars": int(total["chars"]),
            "examples": examples[: tc.val_examples]}
