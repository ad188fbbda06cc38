"""shardtrain: pack speech corpora into length-sorted WebDataset shards, stream them, train, benchmark.

`shardtrain.pack(PackConfig(...))` and `shardtrain.open_dataset(url)` are the packing API, `shardtrain.build_loader`
the streaming one. Every name is imported lazily: `shardtrain pack` and `shardtrain inspect` never pay for torch
(~700 MB and ~1 s), and no command pays for pyarrow before it needs it.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

from shardtrain._version import __version__

if TYPE_CHECKING:  # the names as types; at run time each is imported on first use (__getattr__)
    from shardtrain.format.manifest import Dataset, DatasetError, ShardInfo, open_dataset
    from shardtrain.load.loader import Batch, Loader, StreamConfig, StreamError, build_loader
    from shardtrain.load.plan import BucketConfig, plan_epoch
    from shardtrain.pack.packer import PackConfig, PackResult, pack
    from shardtrain.world import World

_LAZY = {
    **{name: "shardtrain.format.manifest" for name in ("Dataset", "DatasetError", "ShardInfo", "open_dataset")},
    **{name: "shardtrain.pack.packer" for name in ("PackConfig", "PackResult", "pack")},
    **{name: "shardtrain.load.plan" for name in ("BucketConfig", "plan_epoch")},
    "World": "shardtrain.world",
    **{name: "shardtrain.load.loader" for name in ("Batch", "Loader", "StreamConfig", "StreamError", "build_loader")},
}
"""Every public name, imported on first use: `import shardtrain.cli` (every command's start) then costs no pyarrow,
numpy, fsspec or torch, so a mistyped path is reported before any of them loads."""
__all__ = ["__version__", *sorted(_LAZY)]


def _arrow_allocator() -> None:
    """Arrow's C++ default allocator: glibc's (the system pool), unless ARROW_DEFAULT_MEMORY_POOL says otherwise.

    Why: pyarrow's wheels default to mimalloc, and Arrow reads this variable once, when pyarrow is imported; so it
    is set here, before any room imports pyarrow. The Parquet reader allocates from the C++ default whatever
    pyarrow's own default pool is (format.arrownp.lean_memory_pool switches only that one): its pre-buffering and
    decompression buffers. mimalloc's first allocation reserves a 1 GB arena with MADV_HUGEPAGE and faults in
    2 MB pages: reading the 4k benchmark corpus's 156 KB index took 35-115 ms instead of 5-6 ms in about half of
    the fresh processes on this VM (the first batch 0.11-0.15 s instead of 0.04 s, a 0.9 s epoch 6% slower in
    benchmarks/load/compare.py) and ~5 MB more RSS. Costs nothing measurable: the loader's Arrow use is small.
    With pyarrow already imported (a script that imports it first) this does nothing, and lean_memory_pool still
    moves pyarrow's own default. The variable is inherited by child processes, like any other."""
    if "pyarrow" not in sys.modules:
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")


_arrow_allocator()

# `pack` names both the room and the function. Python binds a subpackage onto its parent when the subpackage first
# loads, which would hide the function behind the module once anything under shardtrain.pack is imported; loading
# the room now (light: its own names load on first use) and unbinding it leaves `shardtrain.pack` to __getattr__.
importlib.import_module("shardtrain.pack")
del globals()["pack"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
