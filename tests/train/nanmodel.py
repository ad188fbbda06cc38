"""A test model (`model.factory=nanmodel:build`): the baseline whose loss turns NaN on chosen forward calls.

A real NaN can no longer arrive through the data (pack and the loader refuse non-finite audio), so the guard's
tests inject one at the loss: NAN_AT="3,4" makes forward calls 3 and 4 return NaN, on every rank or only on rank
NAN_RANK. Each call also records a digest of the weights it sees into NAN_LOG (one file per rank), so a test can
tell whether the step after a NaN changed the weights.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch

from shardtrain.train.model import CTCModel


class NanAt(CTCModel):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.calls = 0
        self.at = {int(x) for x in os.environ.get("NAN_AT", "").split(",") if x}
        self.rank = os.environ.get("RANK", "0")
        self.only = os.environ.get("NAN_RANK")
        self.log = os.environ.get("NAN_LOG")

    def forward(self, feats, feat_lengths, targets, target_lengths):
        self.calls += 1
        if self.log:
            h = hashlib.sha1()
            for p in self.parameters():
                h.update(p.detach().cpu().numpy().tobytes())
            with open(f"{self.log}.rank{self.rank}", "a") as f:
                f.write(json.dumps({"call": self.calls, "weights": h.hexdigest()}) + "\n")
        loss, log_probs, out_lengths = super().forward(feats, feat_lengths, targets, target_lengths)
        if self.calls in self.at and (self.only is None or self.only == self.rank):
            loss = loss * torch.tensor(float("nan"))
        return loss, log_probs, out_lengths


def build(cfg, vocab_size: int, n_mels: int) -> NanAt:
    return NanAt(cfg, vocab_size, n_mels)
