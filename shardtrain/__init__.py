"""shardtrain: pack speech corpora into length-sorted WebDataset shards, stream them, train, benchmark."""
__version__ = "0.1.0"

from shardtrain.index import Dataset, DatasetError, ShardInfo, open_dataset  # noqa: E402
from shardtrain.pack import PackConfig, PackResult, pack  # noqa: E402
from shardtrain.plan import BucketConfig, plan_epoch  # noqa: E402
from shardtrain.stream import Batch, Loader, StreamConfig, StreamError, build_loader  # noqa: E402
from shardtrain.world import World  # noqa: E402

__all__ = [
    "__version__", "Batch", "BucketConfig", "Dataset", "DatasetError", "Loader", "PackConfig", "PackResult",
    "ShardInfo", "StreamConfig", "StreamError", "World", "build_loader", "open_dataset", "pack", "plan_epoch",
]
