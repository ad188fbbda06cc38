"""interop: shardtrain datasets and loaders in the tools speech teams already train with. Imports `train`, `load`,
`format`, `storage`; each module imports its tool lazily or at its top, and nothing here is imported by the rest
of shardtrain, so none of these tools is needed unless its adapter is used.

    torchdata.py   BatchStream: the Loader as an IterableDataset of `Batch` with state_dict/load_state_dict,
                   for `DataLoader(..., batch_size=None)` and torchdata's `StatefulDataLoader`
    lightning.py   ShardDataModule (rank/world size from the Trainer, loader cursor in the checkpoint) and
                   CTCLightningModule (the CTC baseline with top-k checkpoints, TensorBoard, LR monitor)
    lhotse.py      open a dataset as a lazy lhotse CutSet (audio read by byte range from the shards, no re-pack)
    hf.py          the `datasets.load_dataset("webdataset", ...)` arguments for a dataset's shards

Optional extras, one per adapter: `pip install 'shardtrain[lightning]'` (pytorch-lightning), `[lhotse]`, `[hf]`
(datasets), `[torchdata]` (only for StatefulDataLoader: `BatchStream` works with a plain DataLoader).
"""
