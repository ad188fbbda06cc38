"""The loader under torch.utils.data conventions: an IterableDataset of `Batch` with `state_dict`/`load_state_dict`.

    Loader (yields (Batch, state)) -> BatchStream (yields Batch; state_dict() = state after the last batch taken)
      -> DataLoader(stream, batch_size=None[, pin_memory=True])        plain torch
      -> torchdata StatefulDataLoader(stream, batch_size=None)          its state_dict() carries the loader cursor

Why a wrapper instead of passing the Loader itself: a DataLoader with worker processes would copy the Loader into
every worker and each would yield the whole epoch (duplicates), and the Loader already decodes in threads of this
process (`stream.decode_threads`; worker processes measured slower and were removed). So BatchStream refuses to run
inside a DataLoader worker, and with `num_workers=0` the DataLoader adds only its per-item overhead (no prefetch: the
state read after `next()` is exactly that of the batch just returned).
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

import torch

from shardtrain.load.batch import Batch
from shardtrain.load.loader import Loader

log = logging.getLogger(__name__)


class BatchStream(torch.utils.data.IterableDataset):
    """`Loader` as an IterableDataset of Batch; state after the last batch taken, resumable with load_state_dict."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Batch]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("BatchStream runs in the main process: use DataLoader(stream, batch_size=None, "
                               "num_workers=0); the loader decodes in its own threads: set stream.decode_threads for more")
        return self._batches()

    def _batches(self) -> Iterator[Batch]:
        n = 0
        for n, batch in enumerate(self.loader.batches(), 1):
            yield batch
        if n == 0:  # `for epoch in range(N): for b in dl` over a one-epoch loader: every later pass is empty
            log.warning("BatchStream: no batch: the loader's epochs (stream.epochs=%s) are all consumed; build it "
                        "with more (None: endless) to iterate again", self.loader.cfg.epochs)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
