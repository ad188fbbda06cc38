"""Checkpoints that are never half-written: one directory per step, committed by a single rename.

    DIR/checkpoints/
      step_000200/            committed (the rename is the commit point; readers see only these)
        model.pt              rank 0: model state_dict (unwrapped from DDP)
        train_state.pt        rank 0: optimizer, scheduler, grad scaler, step, tokenizer
        rank00000.pt ...      every rank: its torch RNG states + the loader state of its last consumed batch
        meta.json             step, val_loss, world_size, rank_files, resolved config (written last inside the temp dir)
      .tmp-step_000300/       being written; ignored by readers, removed on the next save

Protocol: rank 0 creates the temp dir -> barrier -> every rank writes its files (fsync) -> barrier -> rank 0
writes meta.json, fsyncs, renames the temp dir to `step_NNNNNN` (atomic on a POSIX filesystem) and prunes
-> barrier. A crash at any point leaves either the previous set of committed checkpoints or the new one.
The directory must be on a filesystem every rank sees (as for any multi-node checkpoint), or an object store.

On an object store (`s3://bucket/run/checkpoints`, for multi-node jobs without a shared filesystem) there is no
directory rename: every file is uploaded under its final name (each upload is atomic by itself), and `meta.json`,
written by rank 0 after all the others are there, is the commit point: readers list only step folders holding
one. Re-saving a step first deletes its meta.json; pruning deletes meta.json first, then the rest.

Membership: meta.json names the rank files of its step (`rank_files`), and a load reads only those. On an object
store a step folder can hold rank files of an attempt that died before committing (a re-save at a smaller world
size leaves them); they are ignored, so after an elastic shrink and regrow every rank resumes from the committed
cursors. A checkpoint without `rank_files` (older) counts the files of ranks below its world_size.

Local mirror: with an `s3://` --out, run files are written to a private folder of this user
(`run_mirror(out_dir)`: <tempdir>/shardtrain-<uid>/runs/<name>-<digest>, storage.private) and copied up.

Failures: each save stage (create, write, commit) ends in an all-reduce of "did any rank fail" (`agree`), so a
rank that cannot write (disk full, read-only, storage refused) makes every rank raise CheckpointWriteError, one
line naming the step, the rank, the cause (torch.save reports a full disk as "unexpected pos"; statvfs names it)
and the checkpoint that stays the latest; the temp folder is removed. What the trainer then does is its policy
(trainer.py: a periodic save may fail twice in a row, a final or preemption save stops the run). On load,
load_newest_intact names a truncated or corrupt newest checkpoint and falls back to the newest one every rank
reads; explain_mismatch turns a model that does not fit its checkpoint into one line of fields and shapes.

Retention: the newest `keep_last` plus the one with the lowest validation loss.
Loading uses `torch.load(weights_only=True)`: nothing but tensors and plain containers is unpickled.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import io
import pickle
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from shardtrain import storage
from shardtrain.storage.private import private_dir, temp_file, user_dir
from shardtrain.world import World

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_RANK_FILE = re.compile(r"^rank\d{5}\.pt$")


def _save(obj: object, path: Path) -> None:
    torch.save(obj, path)
    storage.sync(path)


def rank_files(world_size: int) -> list[str]:
    """The rank files a step saved by `world_size` processes consists of."""
    return [f"rank{r:05d}.pt" for r in range(world_size)]


def _commit_meta(meta: dict, step: int, world_size: int) -> dict:
    return {**meta, "step": step, "world_size": world_size, "rank_files": rank_files(world_size)}


def committed_rank_files(meta: dict) -> set[str]:
    """The rank files a committed step's meta.json names (older checkpoints: those of ranks below world_size)."""
    names = meta.get("rank_files")
    if isinstance(names, list):
        return {n for n in names if isinstance(n, str) and _RANK_FILE.match(n)}
    return set(rank_files(int(meta.get("world_size", 1))))


def run_mirror(out_dir: str) -> Path:
    """The local folder mirroring an object-store --out (metrics, TensorBoard, run files): private to this user
    and named by the URL (readable part + digest: no `..` or `/` from the URL reaches the path)."""
    rest = out_dir.split("://", 1)[-1].strip("/")
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", rest).strip("._")[:80] or "run"
    digest = hashlib.sha256(out_dir.encode()).hexdigest()[:12]
    return private_dir(user_dir("runs", setting="--out") / f"{name}-{digest}")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def is_remote(path: str | os.PathLike) -> bool:
    """True for object-store URLs (s3://...): checkpoints there use the meta.json commit protocol."""
    return not storage.is_local(str(path))


def list_checkpoints(ckpt_dir: str | os.PathLike, storage_options: dict | None = None) -> list[tuple[int, Path]]:
    """Committed checkpoints as (step, path), oldest first. Temp dirs and stray files are ignored. On an object
    store the paths are URL strings (typed as Path for the local callers; pass them back to this module)."""
    if is_remote(ckpt_dir):
        return _list_remote(str(ckpt_dir), storage_options)
    root = Path(storage.local_path(ckpt_dir))
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / "meta.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def _list_remote(root: str, storage_options: dict | None) -> list[tuple[int, Path]]:
    out = []
    for name in storage.ls_names(root, storage_options):
        m = _STEP_DIR.match(name)
        if m and "meta.json" in storage.ls_names(storage.join(root, name), storage_options):
            out.append((int(m.group(1)), storage.join(root, name)))
    return sorted(out)  # type: ignore[arg-type]


def latest_checkpoint(ckpt_dir: str | os.PathLike, storage_options: dict | None = None) -> Path | None:
    ckpts = list_checkpoints(ckpt_dir, storage_options)
    return ckpts[-1][1] if ckpts else None


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only, storage refused); the previous one is still the
    latest. The message is one line naming the step, the rank and the cause."""


def _why(e: BaseException, where: Path) -> str:
    """The cause of a failed local write in words: torch.save reports a full disk as `unexpected pos ...`."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} ({where})"
    try:
        st = os.statvfs(where if where.exists() else where.parent)
    except OSError:
        st = None
    if st is not None and st.f_flag & os.ST_RDONLY:
        return f"read-only filesystem ({where})"
    if st is not None and st.f_bavail * st.f_frsize < 64 * 2**20:
        return f"disk full: {st.f_bavail * st.f_frsize / 2**20:.1f} MB free on the filesystem of {where}"
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return f"{type(e).__name__}: {first[:200]} ({where})"


def _stage(agree: Callable[[bool], bool], fn: Callable[[], None], where: Path) -> str | None:
    """Run this rank's part of a save stage, then agree over ranks whether every rank succeeded. -> this rank's
    error in words, "another rank" when only another rank failed, None when all succeeded."""
    why = None
    try:
        fn()
    except (OSError, RuntimeError) as e:
        why = _why(e, where)
    if agree(why is not None):
        return why or "another rank failed to write its part (see its log line)"
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointParts:
    """What one rank writes into the checkpoint of `step`: every rank its `rank_state`, rank 0 also the weights, the
    rest of the run's state and meta.json's fields. One value for what a save writes, apart from who writes it (the
    World) and where (the folder, retention, storage options): the protocol below never reads one of them into
    another. Built by RunState.checkpoint_parts; holding references costs nothing (nothing is copied)."""

    step: int
    rank_state: dict
    """This rank's RNG states and the loader state of its last consumed batch (rankNNNNN.pt)."""
    main_state: dict | None = None
    """Rank 0: optimiser, scheduler, scaler, counters, tokenizer (train_state.pt); None on the other ranks."""
    model_state: dict | None = None
    """Rank 0: the model's state_dict, unwrapped from DDP (model.pt); None on the other ranks."""
    meta: dict = field(default_factory=dict)
    """meta.json's own fields (val_loss, config, ...); rank 0's are written, step/world_size/rank_files added."""


def _own_flag(bad: bool) -> bool:
    """`agree` of a single process: its own flag is every rank's."""
    return bad


def save_checkpoint(ckpt_dir: str | os.PathLike, parts: CheckpointParts, *, world: World, keep_last: int,
                    storage_options: dict | None = None, agree: Callable[[bool], bool] = _own_flag) -> Path:
    """Collective: every rank calls it with its `parts` (rank 0's hold the weights, the main state and meta).

    `agree(failed) -> any rank failed` (an all-reduce in a job: Collectives.any) is also the barrier between the
    stages (create, write, commit), so a failure on one rank is a failure on all: every rank raises
    CheckpointWriteError (one line: step, rank, cause), the temp files are removed and the previous checkpoint stays
    the latest. The default is one process's own flag; threads standing in for ranks pass a barrier that returns it."""
    if is_remote(ckpt_dir):
        return _save_remote(str(ckpt_dir), parts, world, agree, keep_last, storage_options)
    root = Path(storage.local_path(ckpt_dir))
    final = root / step_dir_name(parts.step)
    tmp = root / f".tmp-{final.name}"
    rank = world.rank

    def fail(why: str) -> CheckpointWriteError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointWriteError(f"checkpoint {final.name} not written (rank {rank}): {why}; "
                                    f"the latest checkpoint is still {_name(latest_checkpoint(root))}")

    def create() -> None:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-*"):  # left by a crash mid-save
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()

    def write() -> None:
        _save(parts.rank_state, tmp / f"rank{rank:05d}.pt")
        if rank == 0:
            assert parts.model_state is not None and parts.main_state is not None
            _save(parts.model_state, tmp / "model.pt")
            _save(parts.main_state, tmp / "train_state.pt")

    for fn in (create, write, lambda: _commit_local(root, tmp, final, parts, world, keep_last)):
        why = _stage(agree, fn, tmp if fn is not create else root)
        if why is not None:
            raise fail(why)
    return final


def _name(path: Path | None) -> str:
    return "none" if path is None else os.path.basename(str(path))


def _commit_local(root: Path, tmp: Path, final: Path, parts: CheckpointParts, world: World, keep_last: int) -> None:
    """Rank 0: meta.json, then the rename that commits, the directory fsync and pruning."""
    if world.rank != 0:
        return
    missing = [r for r in range(world.world_size) if not (tmp / f"rank{r:05d}.pt").is_file()]
    if missing:
        raise RuntimeError(f"checkpoint {final}: ranks {missing} wrote no state")
    meta_path = tmp / "meta.json"
    meta_path.write_text(json.dumps(_commit_meta(parts.meta, parts.step, world.world_size), indent=1))
    storage.sync(meta_path)
    if final.exists():  # the same step saved again after a restart: move the old copy aside first
        os.replace(final, root / f".tmp-old-{final.name}")
    os.replace(tmp, final)  # the commit point
    shutil.rmtree(root / f".tmp-old-{final.name}", ignore_errors=True)
    dfd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    prune(root, keep_last, committed=parts.step)
    log.info("saved checkpoint %s", final)


def _upload(obj: object, url: str, storage_options: dict | None) -> None:
    """torch.save to a local temp file, then one upload (multipart above s3fs's block size): no second copy of a
    large model in memory, and the object appears only once complete. The temp file is this user's (mkstemp in
    the private folder: 0600, never an existing name) and is removed whatever happens (by a later save when the
    process was killed: storage.private.temp_file)."""
    fd, tmp = temp_file("ckpt", ".pt")
    os.close(fd)
    try:
        torch.save(obj, tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    storage.commit_local_file(tmp, url, storage_options)


def _save_remote(root: str, parts: CheckpointParts, world: World, agree: Callable[[bool], bool], keep_last: int,
                 storage_options: dict | None) -> Path:
    """The object-store protocol (module docstring): files under their final names, meta.json last."""
    final = storage.join(root, step_dir_name(parts.step))
    rank = world.rank

    def uncommit() -> None:
        if rank == 0:
            storage.remove(storage.join(final, "meta.json"), storage_options)  # a re-save: not committed meanwhile

    def write() -> None:
        _upload(parts.rank_state, storage.join(final, f"rank{rank:05d}.pt"), storage_options)
        if rank == 0:
            assert parts.model_state is not None and parts.main_state is not None
            _upload(parts.model_state, storage.join(final, "model.pt"), storage_options)
            _upload(parts.main_state, storage.join(final, "train_state.pt"), storage_options)

    for fn in (uncommit, write, lambda: _commit_remote(root, final, parts, world, keep_last, storage_options)):
        why = _stage(agree, fn, Path(user_dir("tmp")))
        if why is not None:
            raise CheckpointWriteError(f"checkpoint {final} not written (rank {rank}): {why}; the latest "
                                       f"checkpoint is still {_name(latest_checkpoint(root, storage_options))}")
    return final  # type: ignore[return-value]


def _commit_remote(root: str, final: str, parts: CheckpointParts, world: World, keep_last: int,
                   storage_options: dict | None) -> None:
    if world.rank != 0:
        return
    names = set(storage.ls_names(final, storage_options))
    missing = [r for r in range(world.world_size) if f"rank{r:05d}.pt" not in names]
    if missing:
        raise RuntimeError(f"checkpoint {final}: ranks {missing} wrote no state")
    stray = sorted(n for n in names if _RANK_FILE.match(n) and n not in rank_files(world.world_size))
    for n in stray:  # left by a dead attempt with more ranks: never part of this step
        storage.remove(storage.join(final, n), storage_options)
    body = json.dumps(_commit_meta(parts.meta, parts.step, world.world_size), indent=1).encode()
    storage.atomic_write_bytes(storage.join(final, "meta.json"), body, storage_options)  # the commit point
    prune(root, keep_last, storage_options, committed=parts.step)  # type: ignore[arg-type]
    log.info("saved checkpoint %s", final)


def read_meta(path: Path, storage_options: dict | None = None) -> dict:
    if is_remote(path):
        return json.loads(storage.read_bytes(storage.join(path, "meta.json"), storage_options))
    return json.loads((path / "meta.json").read_text())


def prune(ckpt_dir: Path, keep_last: int, storage_options: dict | None = None, *,
          committed: int | None = None) -> list[Path]:
    """Delete committed checkpoints other than the newest `keep_last` and the best by val_loss.

    `committed`: the step just saved. A checkpoint of a later step belongs to an attempt this run went back past
    (its resume fell back to an older checkpoint because those were unreadable): it is deleted, never counted
    among the newest, so it can neither push the checkpoint just written out of `keep_last` nor be the one the
    next resume or `--which latest` picks."""
    ckpts = list_checkpoints(ckpt_dir, storage_options)
    stale = [p for s, p in ckpts if committed is not None and s > committed]
    if stale:
        log.warning("removing checkpoint(s) %s: newer than %s, which this run went back to",
                    ", ".join(_name(p) for p in stale), step_dir_name(committed or 0))
    ckpts = [(s, p) for s, p in ckpts if p not in stale]
    keep = {p for _, p in ckpts[-keep_last:]} if keep_last > 0 else set()
    best = lowest_val_loss([(v, s, p) for s, p in ckpts if (v := _val_loss(p, storage_options)) is not None])
    if best is not None:
        keep.add(best)
    removed = []
    for p in stale + [p for _, p in ckpts if p not in keep]:
        if is_remote(p):  # de-commit first: a kill mid-delete leaves an ignored folder, never a broken checkpoint
            storage.remove(storage.join(p, "meta.json"), storage_options)
            storage.remove(p, storage_options, recursive=True)
            removed.append(p)
        else:
            # rename first (atomic): a kill during rmtree must not leave a visible step dir missing its files;
            # the `.tmp-*` leftover is swept by the next save
            trash = p.with_name(f".tmp-del-{p.name}")
            os.replace(p, trash)
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(p)
    return removed


def lowest_val_loss(scored: list[tuple[float, int, Any]]) -> Any:
    """The checkpoint of the lowest val_loss among (val_loss, step, checkpoint) triples, lowest step on a tie; None
    when none has a score. A NaN val_loss (a validation that diverged) is no score: min() over tuples keeps a
    leading NaN (every comparison with it is False), which would call the diverged checkpoint the best (and prune
    the real best one)."""
    finite = [x for x in scored if not math.isnan(float(x[0]))]
    return min(finite)[2] if finite else None


def _val_loss(path: Path, storage_options: dict | None) -> float | None:
    """A checkpoint's validation loss; None without one, or when its meta.json is unreadable (a damaged old
    checkpoint must not stop a save after the new one committed)."""
    try:
        v = read_meta(path, storage_options).get("val_loss")
    except (OSError, ValueError, AttributeError):
        return None
    return None if v is None else float(v)


def _load(path: Path, name: str, storage_options: dict | None) -> dict:
    if is_remote(path):
        data = storage.read_bytes(storage.join(path, name), storage_options)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return torch.load(path / name, map_location="cpu", weights_only=True)


def _has(path: Path, name: str, storage_options: dict | None) -> bool:
    if is_remote(path):
        return storage.exists(storage.join(path, name), storage_options)
    return (path / name).is_file()


def load_checkpoint(path: Path, *, rank: int, world_size: int, storage_options: dict | None = None) -> dict:
    """-> {meta, model, main, rank}, from a local folder or an object-store prefix. Any world size: `rank` is this
    rank's own file when the checkpoint has one; a rank the checkpoint did not have gets rank 0's loader state
    (the same cursor on every rank; the loader re-stripes the rest of the epoch) and no RNG state (`rng_cpu`
    None: the trainer seeds it). See elastic.py. Only rank files the step's meta.json names are read."""
    meta = read_meta(path, storage_options)
    own = f"rank{rank:05d}.pt"
    if own in committed_rank_files(meta) and _has(path, own, storage_options):
        rank_state = _load(path, own, storage_options)
    else:
        first = _load(path, "rank00000.pt", storage_options)
        rank_state = {"loader_state": first["loader_state"], "rng_cpu": None, "rng_cuda": None}
    if meta["world_size"] != world_size:
        log.info("checkpoint %s was written by %d processes, resuming on %d", path, meta["world_size"], world_size)
    return {
        "meta": meta,
        "model": _load(path, "model.pt", storage_options),
        "main": _load(path, "train_state.pt", storage_options),
        "rank": rank_state,
    }


def load_newest_intact(ckpt_dir: str | os.PathLike, *, rank: int, world_size: int,
                       agree: Callable[[bool], bool] = lambda bad: bad,
                       storage_options: dict | None = None) -> tuple[Path, dict] | tuple[None, None]:
    """The newest committed checkpoint every rank can read, and this rank's state from it (load_checkpoint).

    A truncated or corrupt file (a disk that lost its tail, a copy cut short) makes its checkpoint unusable on
    every rank (`agree`, an all-reduce, so all ranks resume from the same step); it is named in one warning and
    the next older one is tried. (None, None) when there is no checkpoint; a
    ValueError naming every checkpoint and its fault when none is readable."""
    faults: list[str] = []
    for _, path in reversed(list_checkpoints(ckpt_dir, storage_options)):
        why = None
        try:
            state = load_checkpoint(path, rank=rank, world_size=world_size, storage_options=storage_options)
        except (OSError, RuntimeError, EOFError, ValueError, KeyError, pickle.UnpicklingError) as e:
            why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0].split('. ')[0][:160]}"
        if not agree(why is not None):
            if faults:
                log.warning("resuming from %s, the newest intact checkpoint (skipped: %s)", path, "; ".join(faults))
            return path, state
        faults.append(f"{_name(path)} is unreadable ({why or 'on another rank'})")
        log.warning("checkpoint %s is corrupt or incomplete (%s); trying the previous one", path,
                    why or "unreadable on another rank")
    if faults:
        raise ValueError(f"no readable checkpoint in {ckpt_dir}: {'; '.join(faults)}")
    return None, None


def explain_mismatch(stored_cfg: dict, cfg: dict, saved: dict, model: dict, limit: int = 4) -> str:
    """Why a checkpoint's model state does not fit the model built from `cfg`, in one line: the config fields
    that differ from the checkpoint's config.json section by section, then the tensors whose shapes differ."""
    fields = [f"{sec}.{k} {v!r} -> {cfg.get(sec, {}).get(k)!r}" for sec in ("model", "features")
              for k, v in sorted((stored_cfg.get(sec) or {}).items()) if cfg.get(sec, {}).get(k) != v]
    shapes = [f"{k} {list(saved[k].shape)} vs {list(model[k].shape)}" for k in saved
              if k in model and hasattr(saved[k], "shape") and saved[k].shape != model[k].shape]
    missing = sorted(set(model) - set(saved))
    extra = sorted(set(saved) - set(model))
    parts = [f"changed fields: {', '.join(fields)}" if fields else "no model field differs in config"]
    if shapes:
        parts.append(f"{len(shapes)} tensors differ in shape ({', '.join(shapes[:limit])}{', ...' if len(shapes) > limit else ''})")
    if missing or extra:
        parts.append(f"{len(missing)} tensors missing from the checkpoint, {len(extra)} unexpected "
                     f"({', '.join((missing + extra)[:limit])})")
    return "; ".join(parts)
