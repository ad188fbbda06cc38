"""What the loader hands the trainer: `Batch` (padded PCM + lengths + keys/texts/durations) and pcm_to_float.

    ChunkBatches row (int16 or float32 [B, T], lengths [B], keys, texts, durations_s)
      -> Batch(waves [B, T] zero-padded, lengths [B] int64, ..., rows/sources: where each utterance came from)
      -> .to(device) / .pin_memory() in the trainer (rows and sources stay numpy on the host)

int16 batches (`pcm_dtype="int16"`: half the host memory and copy) become float32 with pcm_to_float on the
device, which is where the trainer and `shardtrain bench` both convert them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
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
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """int64 [B]: each utterance's row in its dataset's index.parquet (what a ledger or `shardtrain plan` joins
    on; free: the plan's own row ids)."""
    sources: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int16))
    """int16 [B]: each utterance's dataset, its position in the mixture's list (0 for a single dataset)."""
    planned: int = -1
    """Utterances the plan put in this batch (-1: not known). 0 with len 0: empty by plan (equal steps gave a
    rank a batch its chunk had no row for); > 0 with len 0: every planned sample failed to decode."""

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
