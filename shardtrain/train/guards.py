"""What never reaches the weights: non-finite steps, targets CTC cannot align, and a checkpoint of NaN weights.

    per step (update.py): targets CTC cannot align are dropped before the loss (counted); after backward and the
      gradient all-reduce, a NaN/Inf loss or gradient norm on any rank skips the optimiser step on every rank
    per step (loop): StepGuard counts both and stops the run in one line when they are no longer accidents
    per checkpoint: check_finite_weights refuses to write weights that are not all finite

Why: one NaN sample made the loss NaN from step 1, every weight NaN, and the run saved and exited 0; clips too short
for their transcript gave zero loss (ctc_loss's zero_infinity) while their tokens still divided the step's loss,
so a dataset of nothing else "trained" at loss 0.000. A target of L labels with r adjacent repeats needs L + r
output frames (a blank between each repeated pair).
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

WINDOW_STEPS = 20
"""Steps over which the share of impossible targets is judged (a bad shard passes; a bad dataset does not)."""


class TrainingHalted(RuntimeError):
    """The run cannot train on what it is given (non-finite steps in a row, mostly impossible targets, NaN
    weights): one line naming the cause and what to check; the CLI exits 1."""


def ctc_frames_needed(targets: torch.Tensor, target_lengths: torch.Tensor) -> torch.Tensor:
    """Per utterance: output frames CTC needs for its target (labels + adjacent repeats), from the concatenated
    1-D `targets`. Vectorised, on the targets' device."""
    if targets.numel() == 0:
        return target_lengths.clone()
    same = torch.zeros_like(targets, dtype=torch.int64)
    same[1:] = (targets[1:] == targets[:-1]).to(torch.int64)
    starts = torch.cumsum(target_lengths, 0) - target_lengths
    valid = starts < targets.numel()
    same[starts[valid & (target_lengths > 0)]] = 0  # the first label of an utterance repeats nothing
    owner = torch.repeat_interleave(torch.arange(len(target_lengths), device=targets.device), target_lengths)
    repeats = torch.zeros(len(target_lengths), dtype=torch.int64, device=targets.device).index_add_(0, owner, same)
    return target_lengths + repeats


def alignable(model: torch.nn.Module, feat_lengths: torch.Tensor, targets: torch.Tensor,
              target_lengths: torch.Tensor) -> torch.Tensor | None:
    """Bool per utterance: can CTC align its target in the model's output frames? None when the model does not
    say how many frames it outputs (`output_lengths`, a method of the baseline): the check is then skipped."""
    out_lengths = getattr(model, "output_lengths", None)
    if out_lengths is None:
        return None
    return out_lengths(feat_lengths) >= ctc_frames_needed(targets, target_lengths)


def alignable_tokens(model: torch.nn.Module, feat_lengths: torch.Tensor, targets: torch.Tensor,
                     target_lengths: torch.Tensor) -> tuple[float, int]:
    """(target tokens of the utterances CTC can align, how many utterances it cannot): the divisor of a per-token
    loss that `zero_infinity` computed as 0 for the unalignable ones (counting their tokens too would read as a
    lower loss: a set of only such utterances as 0.0, "the best checkpoint"). All tokens when the model does not
    say how many frames it outputs."""
    ok = alignable(model, feat_lengths, targets, target_lengths)
    if ok is None:
        return float(target_lengths.sum()), 0
    return float(target_lengths[ok].sum()), int((~ok).sum())


def keep_utterances(keep: torch.Tensor, feats: torch.Tensor, feat_lengths: torch.Tensor, targets: torch.Tensor,
                    target_lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The micro-batch without the utterances `keep` is False for (targets are concatenated per utterance)."""
    tokens = torch.repeat_interleave(keep, target_lengths)
    return feats[keep], feat_lengths[keep], targets[tokens], target_lengths[keep]


def is_finite(*values: torch.Tensor | float) -> bool:
    return all(bool(torch.isfinite(torch.as_tensor(v)).all()) for v in values)


def check_finite_weights(model: torch.nn.Module, step: int) -> None:
    """TrainingHalted when a parameter holds NaN/Inf: such weights are never checkpointed (one pass over the
    parameters, small against the write itself)."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise TrainingHalted(f"step {step}: {len(bad)} parameter tensor(s) hold NaN/Inf (first: {bad[0]}); no "
                             "checkpoint written. Lower train.lr or check the data (`shardtrain inspect --verify`)")


@dataclass(slots=True)
class StepGuard:
    """Counts skipped steps and impossible targets across the run and decides when they stop it."""

    max_nonfinite_steps: int
    max_impossible_share: float
    nonfinite_in_row: int = 0
    nonfinite_steps: int = 0
    overflow_steps: int = 0
    impossible: int = 0
    _window: collections.deque = field(default_factory=lambda: collections.deque(maxlen=WINDOW_STEPS))

    def after_step(self, step: int, *, nonfinite: bool, overflow: bool, impossible: int, samples: int) -> None:
        """Record one step's outcome (the same on every rank); TrainingHalted when the run should stop."""
        self.impossible += impossible
        self._window.append((impossible, samples + impossible))
        if overflow:  # fp16 loss-scale backoff: expected, counted, never fatal
            self.overflow_steps += 1
        if nonfinite:
            self.nonfinite_in_row += 1
            self.nonfinite_steps += 1
            log.warning("step %d: non-finite loss or gradient on some rank; optimiser step skipped on every rank "
                        "(%d in a row, %d in all)", step, self.nonfinite_in_row, self.nonfinite_steps)
            if self.nonfinite_in_row >= self.max_nonfinite_steps:
                raise TrainingHalted(
                    f"{self.nonfinite_in_row} steps in a row with a NaN/Inf loss or gradient (to step {step}); the "
                    "weights were not touched. Check the data (`shardtrain inspect --verify`), lower train.lr, or "
                    "use train.precision=fp32")
        elif not overflow:
            self.nonfinite_in_row = 0
        bad, seen = (sum(x) for x in zip(*self._window))
        if len(self._window) == WINDOW_STEPS and seen and bad / seen > self.max_impossible_share:
            raise TrainingHalted(
                f"{bad} of {seen} utterances in the last {WINDOW_STEPS} steps (to step {step}) have transcripts "
                "too long for their audio (CTC needs a frame per label and a blank between repeats): check that "
                "transcripts match their audio, or pack with --max-chars-per-s")

    def counters(self) -> dict:
        return {"nonfinite_steps": self.nonfinite_steps, "overflow_steps": self.overflow_steps,
                "impossible_targets": self.impossible}
