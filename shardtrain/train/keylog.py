"""An audit of what each step trained on: `DIR/keys/rank{R}.jsonl`, one line per micro-batch (`train.log_keys`).

    {"step": optimiser step, "epoch": e, "batch": loader batch index in its epoch, "rank": R, "keys": [...]}

Why: "which utterances did step 1234 see" is the first question when a loss spikes, and the only direct proof
that an interrupted, resumed or re-sized run still saw every sample of an epoch exactly once. Lines past the
checkpoint a run resumes from are dropped first (those steps are trained again), in the files of ranks the
resumed run no longer has too: a run killed on 3 ranks and resumed on 2 would otherwise keep rank 2's lines of the
steps it trains again, and the audit would count those utterances twice. Cost: one JSON line per micro-batch
(~30 bytes per utterance), off by default.
"""
from __future__ import annotations

import json
from pathlib import Path

from shardtrain.train.metrics import truncate_after


class KeyLog:
    def __init__(self, out_dir: Path, rank: int, start_step: int, world_size: int = 1) -> None:
        folder = out_dir / "keys"
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank:05d}.jsonl"
        self.rank = rank
        truncate_after(self.path, start_step)
        for gone in _rank_files(folder):  # ranks a larger earlier attempt had: rank R trims R + k x world_size
            if gone[0] >= world_size and gone[0] % world_size == rank:
                truncate_after(gone[1], start_step)
        self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, micro: list) -> None:
        for batch, _ in micro:
            self._fh.write(json.dumps({"step": step, "epoch": batch.epoch, "batch": batch.step, "rank": self.rank,
                                       "keys": list(batch.keys)}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _rank_files(folder: Path) -> list[tuple[int, Path]]:
    """(rank, path) of every rank's key file in `folder`."""
    out = []
    for path in folder.glob("rank*.jsonl"):
        digits = path.stem.removeprefix("rank")
        if digits.isdigit():
            out.append((int(digits), path))
    return sorted(out)
