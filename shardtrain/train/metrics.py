"""Where training numbers go: `DIR/metrics.jsonl` (one JSON object a line) and TensorBoard, rank 0 only.

A line always has `step`; training lines add loss, lr, audio_s_per_s, data_wait_pct, skipped (and
gpu_mem_gib on GPU); validation lines add val_loss, cer, wer (pooled over the validation sets) and
val/<name>/{loss,cer,wer,utts,audio_s,chars,words,tokens,skipped} per set (evaluate.py). JSON lines are the contract other tools read;
TensorBoard is a convenience (skipped when `tensorboard` is False; importing it costs ~1 s).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def redone_after(path: Path, step: int) -> dict:
    """What a resume from `step` trains again: the steps and audio seconds logged past it by the attempt that
    stopped (to `log_every_steps` precision; read before truncate_after drops them). Zero after a preemption."""
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
    past = [r for r in rows if r.get("step", 0) > step and "loss" in r]
    return {"steps": max((r["step"] for r in past), default=step) - step,
            "audio_s": round(sum(float(r.get("audio_s", 0.0)) for r in past), 2)}


def truncate_after(path: Path, step: int) -> int:
    """Drop lines logged after `step` (by a run that crashed past its last checkpoint); returns lines dropped.

    Resumed runs re-log those steps, so without this the file would hold two values for one step.
    """
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    keep = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    os.replace(tmp, path)
    return len(lines) - len(keep)


class MetricsLogger:
    """Append-only metrics sink. Inactive (all calls no-ops) on ranks other than 0."""

    def __init__(self, out_dir: Path, *, active: bool, tensorboard: bool, start_step: int = 0) -> None:
        self.active = active
        self.path = out_dir / "metrics.jsonl"
        self._fh = None
        self._tb = None
        if not active:
            return
        truncate_after(self.path, start_step)
        self._fh = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start_step + 1)
            except ImportError:  # tensorboard is a declared dependency, but keep training without it
                log.warning("tensorboard is not installed; metrics go to %s only", self.path)

    def log(self, row: dict) -> None:
        if not self.active:
            return
        assert self._fh is not None  # opened in __init__ when active
        self._fh.write(json.dumps(row, sort_keys=True) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, row["step"])

    def text(self, tag: str, value: str, step: int) -> None:
        if self._tb is not None:
            self._tb.add_text(tag, value, step)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()
