"""The run folder's files (config.json, vocab.json, metrics.jsonl) and an object-store --out's local mirror.

With `--out s3://bucket/run`, metrics and TensorBoard are written to a local folder and copied up at each
checkpoint; a resume on a fresh node brings them back first. Cost: a few small uploads per checkpoint.
One trainer per run folder: RunLease, an expiring lease on --out renewed while training.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from shardtrain import storage
from shardtrain.storage.lock import LEASE_NAME, LeaseLost, acquire_lock
from shardtrain.train import checkpoint as ckpt

log = logging.getLogger(__name__)


# run files (config.json, vocab.json, metrics.jsonl) mirrored to an object-store --out at each checkpoint
_RUN_FILES = ("config.json", "vocab.json", "metrics.jsonl")


def run_dirs(out_dir: str) -> tuple[Path, Path | str]:
    """(local run folder, checkpoint folder or URL). With an object-store --out (s3://bucket/run), metrics and
    TensorBoard are written to a local mirror (checkpoint.run_mirror: a private folder of this user), copied up at
    each checkpoint; checkpoints go straight to s3://bucket/run/checkpoints (committed by their meta.json)."""
    if not ckpt.is_remote(out_dir):  # `file://...` and `~/...` name the folder the lease and sync calls use
        local = Path(storage.local_path(out_dir))
        return local, local / "checkpoints"
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


class RunLease:
    """The run folder's exclusive lease (storage/lock.py, `--out/_train.lease`), held by rank 0 and renewed every
    ttl/3 by a daemon thread; `lost` is set when a renewal finds another holder (the loop then stops).
    Cost: one small read + write per renewal (every 100 s at the default ttl of 300 s)."""

    def __init__(self, out_dir: str, ttl_s: float, storage_options: dict | None) -> None:
        self._lock = acquire_lock(out_dir, storage_options, purpose="trainer", name=LEASE_NAME, ttl_s=ttl_s)
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, args=(ttl_s / 3,), name="lease-renew", daemon=True)
        self._thread.start()

    def _renew_loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self._lock.renew()
            except LeaseLost as e:
                self.lost = str(e)
                return
            except OSError as e:  # storage hiccup: the lease stays valid until its expiry; retry next period
                log.warning("renewing the run lease %s failed (%s); retrying in %.0f s", self._lock.url, e, every_s)

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.lost is None:
            self._lock.release()
