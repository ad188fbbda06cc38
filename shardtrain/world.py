"""Who this process is in a distributed job: rank, world size, DataLoader worker.

Library code never reads RANK/WORLD_SIZE itself; entry points (cli, train) call `World.from_env()` once and
pass the result down. That keeps every planning function pure and testable for 256 simulated ranks without
a process group.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class World:
    rank: int = 0
    """Global rank of this process (0-based)."""
    world_size: int = 1
    """Number of ranks in the job."""
    local_rank: int = 0
    """Rank on this node; selects the CUDA device."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "World":
        """Read torchrun's variables. Call only from entry points (cli/train)."""
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        )
