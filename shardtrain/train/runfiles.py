"""The run folder's files (config.json, vocab.json, metrics.jsonl) and an object-store --out's local mirror.

With `--out s3://bucket/run`, metrics and TensorBoard are written to a local folder and copied up at each
checkpoint; a resume on a fresh node brings them back first. Cost: a few small uploads per checkpoint.
"""
from __future__ import annotations

from pathlib import Path

from shardtrain import storage
from shardtrain.train import checkpoint as ckpt


# run files (config.json, vocab.json, metrics.jsonl) mirrored to an object-store --out at each checkpoint
_RUN_FILES = ("config.json", "vocab.json", "metrics.jsonl")


def run_dirs(out_dir: str) -> tuple[Path, Path | str]:
    """(local run folder, checkpoint folder or URL). With an object-store --out (s3://bucket/run), metrics and
    TensorBoard are written to a local mirror (checkpoint.run_mirror: a private folder of this user), copied up at
    each checkpoint; checkpoints go straight to s3://bucket/run/checkpoints (committed by their meta.json)."""
    if not ckpt.is_remote(out_dir):
        return Path(out_dir), Path(out_dir) / "checkpoints"
    return ckpt.run_mirror(out_dir), storage.join(out_dir, "checkpoints")


def push_run_files(local: Path, url: str, storage_options: dict | None) -> None:
    for name in _RUN_FILES:
        if (local / name).is_file():
            storage.atomic_write_bytes(storage.join(url, name), (local / name).read_bytes(), storage_options)


def fetch_run_files(url: str, local: Path, storage_options: dict | None) -> None:
    """A resume on a fresh node: bring back the run files the last checkpoint copied up (metrics continue). A new
    run (nothing up there yet) starts from an empty local mirror, whatever an earlier run with this URL left."""
    names = set(storage.ls_names(url, storage_options))
    if not names & set(_RUN_FILES):
        import shutil

        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True, exist_ok=True)
    for name in _RUN_FILES:
        if name in names and not (local / name).exists():
            (local / name).write_bytes(storage.read_bytes(storage.join(url, name), storage_options))
