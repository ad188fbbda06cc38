"""Checkpoints that are never half-written: one directory per step, committed by a single rename.

    DIR/checkpoints/
      step_000200/            committed (the rename is the commit point; readers see only these)
        model.pt              rank 0: model state_dict (unwrapped from DDP)
        train_state.pt        rank 0: optimizer, scheduler, grad scaler, step, tokenizer
        rank00000.pt ...      every rank: its torch RNG states + the loader state of its last consumed batch
        meta.json             step, val_loss, world_size, resolved config (written last inside the temp dir)
      .tmp-step_000300/       being written; ignored by readers, removed on the next save

Protocol: rank 0 creates the temp dir -> barrier -> every rank writes its files (fsync) -> barrier -> rank 0
writes meta.json, fsyncs, renames the temp dir to `step_NNNNNN` (atomic on a POSIX filesystem) and prunes
-> barrier. A crash at any point leaves either the previous set of committed checkpoints or the new one.
The directory must be on a filesystem every rank sees (as for any multi-node checkpoint). Object stores
(s3://) have no atomic directory rename and are not supported for checkpoints yet.

Retention: the newest `keep_last` plus the one with the lowest validation loss.
Loading uses `torch.load(weights_only=True)`: nothing but tensors and plain containers is unpickled.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save(obj: object, path: Path) -> None:
    torch.save(obj, path)
    _fsync_file(path)


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Committed checkpoints as (step, path), oldest first. Temp dirs and stray files are ignored."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / "meta.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(ckpt_dir: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(ckpt_dir)
    return ckpts[-1][1] if ckpts else None


def save_checkpoint(ckpt_dir: str | os.PathLike, *, step: int, rank: int, world_size: int,
                    barrier: Callable[[], None], rank_state: dict, main_state: dict | None,
                    model_state: dict | None, meta: dict, keep_last: int) -> Path:
    """Collective: every rank calls it with its `rank_state`; rank 0 also passes model/main state and meta."""
    root = Path(ckpt_dir)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    barrier()
    _save(rank_state, tmp / f"rank{rank:05d}.pt")
    if rank == 0:
        assert model_state is not None and main_state is not None
        _save(model_state, tmp / "model.pt")
        _save(main_state, tmp / "train_state.pt")
    barrier()
    if rank == 0:
        missing = [r for r in range(world_size) if not (tmp / f"rank{r:05d}.pt").is_file()]
        if missing:
            raise RuntimeError(f"checkpoint {final}: ranks {missing} wrote no state")
        meta_path = tmp / "meta.json"
        meta_path.write_text(json.dumps({**meta, "step": step, "world_size": world_size}, indent=1))
        _fsync_file(meta_path)
        if final.exists():  # the same step saved again after a restart: move the old copy aside first
            os.replace(final, root / f".tmp-old-{final.name}")
        os.replace(tmp, final)  # the commit point
        shutil.rmtree(root / f".tmp-old-{final.name}", ignore_errors=True)
        dfd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        prune(root, keep_last)
        log.info("saved checkpoint %s", final)
    barrier()
    return final


def read_meta(path: Path) -> dict:
    return json.loads((path / "meta.json").read_text())


def prune(ckpt_dir: Path, keep_last: int) -> list[Path]:
    """Delete committed checkpoints other than the newest `keep_last` and the best by val_loss."""
    ckpts = list_checkpoints(ckpt_dir)
    keep = {p for _, p in ckpts[-keep_last:]} if keep_last > 0 else set()
    scored = [(m["val_loss"], s, p) for s, p in ckpts if (m := read_meta(p)).get("val_loss") is not None]
    if scored:
        keep.add(min(scored)[2])
    removed = []
    for _, p in ckpts:
        if p not in keep:
            # rename first (atomic): a kill during rmtree must not leave a visible step dir missing its files;
            # the `.tmp-*` leftover is swept by the next save
            trash = p.with_name(f".tmp-del-{p.name}")
            os.replace(p, trash)
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(p)
    return removed


def load_checkpoint(path: Path, *, rank: int, world_size: int) -> dict:
    """-> {meta, model, main, rank}. Any world size: `rank` is this rank's own file when the checkpoint has one;
    a rank the checkpoint did not have gets rank 0's loader state (the same cursor on every rank; the loader
    re-stripes the rest of the epoch) and no RNG state (`rng_cpu` None: the trainer seeds it). See elastic.py."""
    meta = read_meta(path)
    own = path / f"rank{rank:05d}.pt"
    if own.is_file():
        rank_state = torch.load(own, map_location="cpu", weights_only=True)
    else:
        first = torch.load(path / "rank00000.pt", map_location="cpu", weights_only=True)
        rank_state = {"loader_state": first["loader_state"], "rng_cpu": None, "rng_cuda": None}
    if meta["world_size"] != world_size:
        log.info("checkpoint %s was written by %d processes, resuming on %d", path, meta["world_size"], world_size)
    return {
        "meta": meta,
        "model": torch.load(path / "model.pt", map_location="cpu", weights_only=True),
        "main": torch.load(path / "train_state.pt", map_location="cpu", weights_only=True),
        "rank": rank_state,
    }
