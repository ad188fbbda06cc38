"""What one batch needs on the device, shared by the training step and validation, and validation itself.

    Batch (CPU, pinned) -> to_device (targets via the tokenizer; B=0 -> a silent dummy) -> Augmenters (one
    DeviceAugment per input rate) -> model under `autocast` -> evaluate: loss, greedy CTC decode, CER/WER sums
    per validation set -> Collectives.sum (ONE all-reduce for all sets) -> per-set and overall rates over every
    rank's share of each set.

Several validation sets (valsets.py) are evaluated one after the other, each over its whole set (every rank its
stripe). Each reports its own loss / CER / WER; the overall `val_loss`, `cer`, `wer` (best-checkpoint selection
reads val_loss) are pooled over every set: total loss / total target tokens (of the utterances CTC can align in
the model's output frames: the others' loss is 0 by `zero_infinity`, counted as `unalignable`), total character
edits / total reference characters, total word edits / total reference words. So a set weighs by its size (in
tokens, characters, words), exactly as if the sets were one set; with one set they are that set's figures.
References and hypotheses are compared after the tokenizer's normaliser (train/normalize.py), the one its targets
were encoded with. Every utterance of a set is scored: the training stream's load-time filters (duration, speakers)
choose what training reads, not what it is scored on, so validation reads without them, and with budgets that hold
its longest utterance (`validation_stream`: only lengths the training budget cannot hold get a larger one).
"""
from __future__ import annotations

import dataclasses
import math

from typing import cast

import torch

from shardtrain.format.manifest import open_dataset
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.train.guards import alignable_tokens
from shardtrain.train.text import error_counts
from shardtrain.train.valsets import ValSet, val_sets
from shardtrain.train.model import SpeechModel
from shardtrain.train.step import StepContext, autocast, to_device

SUMS = ("loss", "tokens", "char_errors", "chars", "word_errors", "words", "utts", "audio_s", "skipped", "unalignable")
"""What each rank adds up per validation set; summed over ranks in one all-reduce."""
SET_KEYS = ("loss", "cer", "wer", "utts", "audio_s", "chars", "words", "tokens", "skipped", "unalignable")
"""Per-set metrics, logged as val/<name>/<key> (metrics.jsonl and TensorBoard)."""


def _rates(s: dict) -> dict:
    """Per token, character and word. The loss is over the utterances CTC can align (guards.alignable_tokens):
    NaN when there are none, never a 0.0 that best-checkpoint selection would keep."""
    return {"loss": s["loss"] / s["tokens"] if s["tokens"] > 0 else float("nan"),
            "cer": s["char_errors"] / max(s["chars"], 1.0),
            "wer": s["word_errors"] / max(s["words"], 1.0)}


def validation_stream(stream: StreamConfig, url: str, storage_options: dict | None) -> StreamConfig:
    """The training stream config for one pass over the validation set at `url`, leaving out nothing: without the
    load-time filters (a `max_duration_s` or a speaker list chosen for training left matching dev utterances
    out of CER/WER, counted nowhere in the val row) and with budgets that hold its longest utterance (else one
    longer than `max_batch_seconds`, or than its budget table entry, was left out as too long). Only lengths the
    training budget cannot hold get a budget of their own (`_fitting_table`): no batch costs more than the
    longest utterance alone, which validation must run anyway. Costs one manifest read (shards' longest)."""
    bucket = stream.bucket
    longest = max((s.max_duration_s for s in open_dataset(url, storage_options).shards), default=0.0)
    table = bucket.budget_table or ((max(longest, bucket.max_batch_seconds), bucket.max_batch_seconds),)
    fitted = _fitting_table(table, longest, bucket.quadratic_duration_s)
    if fitted != table:
        bucket = dataclasses.replace(bucket, budget_table=fitted)
    return dataclasses.replace(stream, epochs=1, bucket=bucket, min_duration_s=None, max_duration_s=None,
                               speakers=(), exclude_speakers=())


def _fitting_table(table: tuple[tuple[float, float], ...], longest: float,
                   quadratic: float | None) -> tuple[tuple[float, float], ...]:
    """`table` (BucketConfig.budget_table) with each entry whose budget one of its lengths (up to `longest`)
    exceeds alone cut in two: the lengths its budget holds keep it, the rest get the cost of the entry's longest."""
    def cost(d: float) -> float:
        return d if quadratic is None else d + d * d / quadratic

    def holds(b: float) -> float:  # the longest utterance whose cost alone is within b
        d = b if quadratic is None else quadratic / 2 * (math.sqrt(1 + 4 * b / quadratic) - 1)
        return d * (1 - 1e-9)

    out: list[tuple[float, float]] = []
    prev = 0.0
    for i, (edge, budget) in enumerate(table):
        last = i == len(table) - 1
        top = longest if last else min(edge, longest)
        if cost(top) <= budget:
            out.append((edge, budget))
        else:
            if holds(budget) > prev:
                out.append((holds(budget), budget))
            out.append((max(edge, longest) if last else edge, cost(top) * (1 + 1e-6)))
        prev = out[-1][0]
    return tuple(out)


def _evaluate_set(ctx: StepContext, model: torch.nn.Module, tok, vs: ValSet,
                  storage_options: dict | None) -> tuple[dict, list[tuple[str, str]]]:
    """This rank's sums (SUMS) and (reference, hypothesis) pairs over its stripe of one validation set."""
    tc, device = ctx.cfg.train, ctx.device
    loader = build_loader(vs.url, world=ctx.world, seed=tc.seed,
                          cfg=validation_stream(ctx.cfg.stream, vs.url, storage_options), storage_options=storage_options)
    sums = dict.fromkeys(SUMS, 0.0)
    examples: list[tuple[str, str]] = []
    batches = iter(loader)
    try:
        for i, (batch, _) in enumerate(batches):
            if tc.val_max_batches is not None and i >= tc.val_max_batches:
                break
            if len(batch) == 0:
                continue
            waves, lengths, targets, target_lengths = to_device(batch, device, tok)
            feats, feat_lengths = ctx.augmenters(waves, lengths, batch.sample_rate_hz, None, train=False)
            with autocast(tc, device):
                loss_sum, outputs, out_lengths = model(feats, feat_lengths, targets, target_lengths)
            hyps = [tok.decode(ids) for ids in cast(SpeechModel, model).decode(outputs, out_lengths)]
            for k, v in error_counts(batch.texts, hyps, tok.normalizer).items():
                sums[k] += v
            sums["loss"] += float(loss_sum)  # 0 for an utterance CTC cannot align (zero_infinity)
            tokens, unalignable = alignable_tokens(model, feat_lengths, targets, target_lengths)
            sums["tokens"] += tokens
            sums["unalignable"] += unalignable
            sums["utts"] += len(batch)
            sums["audio_s"] += float(batch.durations_s.sum())
            examples.extend(zip(map(tok.normalizer.apply, batch.texts), hyps))  # the reference as scored
    finally:
        getattr(batches, "close", lambda: None)()  # stops the loader's prefetch after an early break
    sums["skipped"] = float(loader.stats().get("skipped", 0))
    return sums, examples


def evaluate(ctx: StepContext, model: torch.nn.Module, tok, storage_options: dict | None) -> dict:
    """Validation loss per token, CER and WER of every validation set and pooled over all of them (see the module
    docstring); sums all-reduced across ranks in one collective.

    Takes the run's config, world, collectives and augmenters from `ctx` (train/step.py); uses the unwrapped
    model (no DDP collectives) and features without augmentation. Returns {val_loss, cer, wer, val_chars, examples,
    sets: {name: {SET_KEYS..., examples}}}; examples are this rank's first `val_examples` (normalised reference,
    hypothesis) pairs of each set.
    """
    cfg = ctx.cfg
    sets = val_sets(cfg.train)
    local: list[float] = []
    examples: dict[str, list[tuple[str, str]]] = {}
    model.eval()
    try:
        with torch.no_grad():
            for vs in sets:
                sums, ex = _evaluate_set(ctx, model, tok, vs, storage_options)
                local += [sums[k] for k in SUMS]
                examples[vs.name] = ex[: cfg.train.val_examples]
    finally:
        model.train()
    total = ctx.comm.sum(local) if local else []
    per = {vs.name: dict(zip(SUMS, total[i * len(SUMS):(i + 1) * len(SUMS)])) for i, vs in enumerate(sets)}
    pooled = {k: sum(p[k] for p in per.values()) for k in SUMS}
    rates = _rates(pooled)
    out_sets = {name: {**{k: p[k] for k in SET_KEYS if k in p}, **_rates(p), "examples": examples[name]}
                for name, p in per.items()}
    return {"val_loss": rates["loss"], "cer": rates["cer"], "wer": rates["wer"], "val_chars": int(pooled["chars"]),
            "unalignable": int(pooled["unalignable"]),
            "examples": [e for ex in examples.values() for e in ex], "sets": out_sets}


def metrics_row(res: dict, step: int) -> dict:
    """The metrics.jsonl line of one validation: pooled val_loss/cer/wer plus val/<name>/<key> per set."""
    row = {"step": step, "val_loss": res["val_loss"], "cer": res["cer"], "wer": res["wer"]}
    for name, s in res["sets"].items():
        row.update({f"val/{name}/{k}": (int(s[k]) if k in ("utts", "chars", "words", "tokens", "skipped", "unalignable")
                                        else s[k]) for k in SET_KEYS})
    return row
