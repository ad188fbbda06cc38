"""Streaming loader: planned batches read from shards on disk or S3, with exact resume.

    manifest.json + index.parquet (numeric columns only)            -> PlanIndex (~40 B/row, shared by workers)
      -> plan_epoch(seed, epoch, world_size, BucketConfig)          -> groups of chunks, batches fixed per chunk
      -> this rank's chunks; DataLoader worker w takes chunk j when (j + chunks before) % num_workers == w
      -> read_chunk: one ranged read per byte run (retry + resume at byte reached; optional local shard cache)
      -> decode: libsndfile in a thread pool straight into batch rows (no GIL: audio.decode_into)
      -> ChunkBatches: per batch int16 [B, T] + lengths + keys/texts (half the bytes of float32 across IPC)
      -> Loader (main process): float32 [B, T] zero-padded (pinned when CUDA exists) -> (Batch, state)

Why threads, and why whole chunks per worker item: decoding in a thread pool inside one process reaches the
decode-only limit without the inter-process copy (stack.md), so `num_workers=0` with `decode_threads=3` is the
default; with worker processes, each DataLoader item is one chunk's batches, so DataLoader's round-robin over
workers yields chunks in plan order whatever `num_workers` is. The state is a cursor (epoch, step) kept by the
main process, never by workers, so a checkpoint cannot run ahead of the trainer.

A resume with a different world size re-plans only the rest of the epoch: rows consumed under the old world
size are recomputed from the (pure) plan and excluded (`chain` in the state).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch



@dataclass(slots=True)
class Batch:
    waves: torch.Tensor
    """float32 [B, T] in [-1, 1) (int16 PCM with stream.pcm_dtype="int16"), zero-padded past each length."""
    lengths: torch.Tensor
    """int64 [B], samples."""
    keys: list[str]
    texts: list[str]
    durations_s: torch.Tensor
    """float64 [B]."""
    sample_rate_hz: int
    epoch: int
    step: int
    """Index of this batch within its epoch."""

    def __len__(self) -> int:
        return len(self.keys)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """The batch with its tensors on `device` (Lightning's and `move_data_to_device`'s convention); keys and
        texts stay Python lists. `non_blocking` overlaps the copy only when the waves are pinned."""
        return replace(self, waves=self.waves.to(device, non_blocking=non_blocking),
                       lengths=self.lengths.to(device, non_blocking=non_blocking),
                       durations_s=self.durations_s.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        """Pinned host copy (called by `DataLoader(pin_memory=True)`); needs CUDA, like `Tensor.pin_memory`."""
        return replace(self, waves=self.waves.pin_memory(), lengths=self.lengths.pin_memory(),
                       durations_s=self.durations_s.pin_memory())


def pcm_to_float(waves: torch.Tensor) -> torch.Tensor:
    """Batch.waves as float32 in [-1, 1): int16 batches (`pcm_dtype="int16"`) are converted where they are,
    normally on the training device after the copy; float32 ones pass through."""
    return waves.float().mul_(1.0 / 32768.0) if waves.dtype == torch.int16 else waves
