"""shardtrain: pack speech corpora into length-sorted WebDataset shards, stream them, train, benchmark.

`shardtrain.pack(PackConfig(...))` and `shardtrain.open_dataset(url)` are the packing API; the loader names are
imported lazily so `shardtrain pack` and `shardtrain inspect` never pay for torch (~700 MB and ~1 s).
"""
from __future__ import annotations

import importlib

from shardtrain._version import __version__

from shardtrain.format.manifest import Dataset, DatasetError, ShardInfo, open_dataset
from shardtrain.pack.packer import PackConfig, PackResult, pack
from shardtrain.load.plan import BucketConfig, plan_epoch
from shardtrain.world import World  # noqa: E402

_LAZY = {name: "shardtrain.load.loader" for name in ("Batch", "Loader", "StreamConfig", "StreamError", "build_loader")}
__all__ = ["__version__", "BucketConfig", "Dataset", "DatasetError", "PackConfig", "PackResult", "ShardInfo",
           "World", "open_dataset", "pack", "plan_epoch", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardtrain' has no attribute {name!r}")
