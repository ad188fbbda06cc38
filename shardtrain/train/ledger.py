"""What a run consumed: the index rows each rank trained on, step by step, written with every checkpoint.

    trainer, every step:  (step, epoch, batch, rows of each micro-batch, dataset of each row) -> memory
    every checkpoint:     RUN/ledger/a<attempt>-r<rank>-s<step>.npz   (immutable; steps since the last flush)
    every start:          RUN/ledger/a<attempt>.json                  (rank 0: start step, world size, datasets)
    `shardtrain ledger RUN`: attempts in start order, each one cutting what came after its start step
                             -> per epoch: rows seen once / never / more than once, per-dataset share vs weight

Why with the checkpoint and not per step: what a crash loses after the last checkpoint is trained again by the
resumed run, so a ledger flushed at each checkpoint is exactly what the committed model saw; a file flushed for a
checkpoint that never committed is cut by the next attempt's start step. Why attempts, not truncation: a resumed,
restarted or re-sized run never rewrites a file (object stores append nothing), ranks that no longer exist leave
their files, and the reader still reconstructs one history.

Cost: one numpy append per micro-batch (~2 us) and one small file per rank and checkpoint. Size: 4 bytes per
utterance (uint32 row) + 1-2 bytes for the dataset number + 1 byte for whether it reached the weights + 16 bytes
per batch: ~6.1 MB per million utterances trained (uncompressed .npz).
"""
from __future__ import annotations

import io
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shardtrain import storage

log = logging.getLogger(__name__)

LEDGER_VERSION = 1
FOLDER = "ledger"
_RECORD = re.compile(r"a(?P<attempt>\d{9}-\d{13})-r(?P<rank>\d{5})-s(?P<step>\d{9})\.npz")
_ATTEMPT = re.compile(r"a(?P<attempt>\d{9}-\d{13})\.json")


def attempt_id(start_step: int, time_ms: int) -> str:
    """Names sort by start step then time; the time (rank 0's, shared by all ranks) orders attempts that resume
    from the same step."""
    return f"{start_step:09d}-{time_ms:013d}"


class LedgerWriter:
    """One rank's ledger: rows per step buffered in memory, written as one immutable file per checkpoint."""

    def __init__(self, local: Path, *, rank: int, attempt: str, remote: str | None = None,
                 storage_options: dict | None = None) -> None:
        self.folder = local / FOLDER
        self.folder.mkdir(parents=True, exist_ok=True)
        self.rank, self.attempt, self.remote, self.storage_options = rank, attempt, remote, storage_options
        self._steps: list[tuple[int, int, int, int]] = []  # (step, epoch, batch, count)
        self._rows: list[np.ndarray] = []
        self._sources: list[np.ndarray] = []
        self._trained: list[np.ndarray] = []

    def start(self, *, start_step: int, world_size: int, datasets: list[dict], redone: dict | None = None) -> None:
        """Rank 0 records the attempt: where it started, on how many ranks, over which datasets, and what it
        trains again of the attempt before it (`redone`: steps and audio seconds logged past start_step)."""
        meta = {"version": LEDGER_VERSION, "attempt": self.attempt, "start_step": start_step,
                "world_size": world_size, "datasets": datasets, "time_unix": time.time(),
                "redone": redone or {"steps": 0, "audio_s": 0.0}}
        self._write(f"a{self.attempt}.json", json.dumps(meta, indent=1).encode())

    def add(self, step: int, micro: list, dropped: list | None = None) -> None:
        """The micro-batches of optimiser step `step` (their rows and datasets; keys are not stored). `dropped`:
        per micro-batch, a bool mask of the utterances that reached the trainer but not the weights (targets CTC
        cannot align, a step skipped as non-finite or not taken), or None for none."""
        for i, (batch, _) in enumerate(micro):
            rows = np.asarray(batch.rows)
            self._steps.append((step, batch.epoch, batch.step, len(rows)))
            self._rows.append(rows.astype(np.uint32 if rows.size == 0 or rows.max() < 2**32 else np.uint64))
            self._sources.append(np.asarray(batch.sources, np.uint16))
            mask = dropped[i] if dropped is not None else None
            self._trained.append(np.ones(len(rows), np.uint8) if mask is None
                                 else (~np.asarray(mask, bool)).astype(np.uint8))

    def flush(self, step: int) -> None:
        """Write what was trained since the last flush (called with every checkpoint; nothing when empty)."""
        if not self._steps:
            return
        buf = io.BytesIO()
        rows = np.concatenate(self._rows) if self._rows else np.zeros(0, np.uint32)
        np.savez(buf, steps=np.asarray(self._steps, np.int64).reshape(-1, 4), rows=rows,
                 sources=np.concatenate(self._sources) if self._sources else np.zeros(0, np.uint16),
                 trained=np.concatenate(self._trained) if self._trained else np.zeros(0, np.uint8))
        self._write(f"a{self.attempt}-r{self.rank:05d}-s{step:09d}.npz", buf.getvalue())
        self._steps, self._rows, self._sources, self._trained = [], [], [], []

    def _write(self, name: str, data: bytes) -> None:
        tmp = self.folder / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(self.folder / name)
        if self.remote is not None:
            storage.atomic_write_bytes(storage.join(storage.join(self.remote, FOLDER), name), data,
                                       self.storage_options)


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class Attempt:
    attempt: str
    start_step: int
    world_size: int
    datasets: list[dict]
    redone: dict = field(default_factory=dict)
    """Steps and audio seconds of the previous attempt this one trains again (what its interruption wasted)."""


@dataclass
class History:
    """One row per micro-batch the committed run trained on, after attempts cut what they trained again."""

    attempts: list[Attempt]
    step: np.ndarray
    epoch: np.ndarray
    batch: np.ndarray
    rank: np.ndarray
    attempt: np.ndarray
    """Index into `attempts`."""
    offsets: np.ndarray
    """Rows of micro-batch i are rows[offsets[i]:offsets[i+1]]."""
    rows: np.ndarray
    sources: np.ndarray
    trained: np.ndarray
    """bool per row: it reached the weights (False: dropped before the loss, or its step was skipped; True for
    every row of a ledger written before this was recorded)."""
    cut: list[str] = field(default_factory=list)
    """What later attempts replaced (for the report)."""


def read_history(run: str, storage_options: dict | None = None) -> History:
    """Every attempt's files under RUN/ledger, replayed in start order (a local folder or an object-store URL)."""
    folder = storage.join(run, FOLDER)
    if not storage.exists(folder, storage_options):
        raise FileNotFoundError(f"{run}: no ledger/ folder (a run from before the ledger, or not a run folder)")
    names = storage.ls_names(folder, storage_options)
    attempts = sorted((m.group("attempt") for n in names if (m := _ATTEMPT.fullmatch(n))),
                      key=lambda a: (int(a.split("-")[1]), a))
    metas = []
    for a in attempts:
        meta = json.loads(storage.read_bytes(storage.join(folder, f"a{a}.json"), storage_options))
        metas.append(Attempt(a, int(meta["start_step"]), int(meta["world_size"]), list(meta.get("datasets", [])),
                             dict(meta.get("redone") or {})))
    by_attempt: dict[str, list[tuple[int, str]]] = {}
    for n in names:
        if m := _RECORD.fullmatch(n):
            by_attempt.setdefault(m.group("attempt"), []).append((int(m.group("rank")), n))
    kept: dict[int, list] = {}  # step -> [(attempt no, rank, epoch, batch, rows, sources, trained)]
    cut: list[str] = []
    for no, at in enumerate(metas):
        gone = sorted(s for s in kept if s > at.start_step)
        if gone:
            cut.append(f"attempt {at.attempt} resumed at step {at.start_step}: steps {gone[0]}-{gone[-1]} of earlier "
                       "attempts were trained again")
        for s in gone:
            del kept[s]
        for rank, name in sorted(by_attempt.get(at.attempt, [])):
            with np.load(io.BytesIO(storage.read_bytes(storage.join(folder, name), storage_options))) as z:
                steps, rows, sources = z["steps"], z["rows"].astype(np.int64), z["sources"].astype(np.int64)
                trained = z["trained"].astype(bool) if "trained" in z.files else np.ones(len(rows), bool)
            ends = np.cumsum(steps[:, 3])
            for (step, epoch, batch, _), b, e in zip(steps.tolist(), ends - steps[:, 3], ends):
                kept.setdefault(step, []).append((no, rank, epoch, batch, rows[b:e], sources[b:e], trained[b:e]))
    flat = [(s, *r) for s in sorted(kept) for r in kept[s]]
    counts = np.array([len(r[5]) for r in flat], np.int64)
    return History(
        attempts=metas, step=np.array([r[0] for r in flat], np.int64), attempt=np.array([r[1] for r in flat], np.int64),
        rank=np.array([r[2] for r in flat], np.int64), epoch=np.array([r[3] for r in flat], np.int64),
        batch=np.array([r[4] for r in flat], np.int64), offsets=np.concatenate([[0], np.cumsum(counts)]),
        rows=np.concatenate([r[5] for r in flat]) if flat else np.zeros(0, np.int64),
        sources=np.concatenate([r[6] for r in flat]) if flat else np.zeros(0, np.int64),
        trained=np.concatenate([r[7] for r in flat]) if flat else np.zeros(0, bool), cut=cut)
