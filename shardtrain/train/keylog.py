"""An audit of what each step trained on: `DIR/keys/rank{R}.jsonl`, one line per micro-batch (`train.log_keys`).

    {"step": optimiser step, "epoch": e, "batch": loader batch index in its epoch, "rank": R, "keys": [...]}

Why: "which utterances did step 1234 see" is the first question when a loss spikes, and the only direct proof
that an interrupted, resumed or re-sized run still saw every sample of an epoch exactly once. Lines past the
checkpoint a run resumes from are dropped first (those steps are trained again). Cost: one JSON line per
micro-batch (~30 bytes per utterance), off by default.
"""
from __future__ import annotations

import json
from pathlib import Path

from shardtrain.train.metrics import truncate_after


class KeyLog:
    def __init__(self, out_dir: Path, rank: int, start_step: int) -> None:
        folder = out_dir / "keys"
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank:05d}.jsonl"
        self.rank = rank
        truncate_after(self.path, start_step)
        self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, micro: list) -> None:
        for batch, _ in micro:
            self._fh.write(json.dumps({"step": step, "epoch": batch.epoch, "batch": batch.step, "rank": self.rank,
                                       "keys": list(batch.keys)}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()
