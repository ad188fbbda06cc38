"""testing/indexes.py: the metadata-only dataset the planning and index-cache tests build on must be one the real
readers accept as the packer's (manifest and index agree, every validation passes) and plan over."""
from __future__ import annotations

import numpy as np

from shardtrain.format.manifest import open_dataset
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.testing.indexes import write_index_dataset
from shardtrain.world import World


def test_index_dataset_opens_validates_and_plans(tmp_path):
    url = write_index_dataset(tmp_path / "ds", 2500, per_shard=1000, text="HELLO", lo_s=2.0, hi_s=4.0, row_group=700)
    ds = open_dataset(url)
    assert [s.samples for s in ds.shards] == [1000, 1000, 500] and ds.manifest["totals"]["samples"] == 2500
    t = ds.read_index()  # format/validate's checks: offsets, durations x rate, (shard, offset) order
    assert t.num_rows == 2500 and set(t.column("text").to_pylist()) == {"HELLO"}
    dur = t.column("duration_s").to_numpy()
    assert dur[0] == 2.0 and dur[-1] == 4.0 and np.all(np.diff(dur) >= 0)
    assert abs(sum(s.seconds for s in ds.shards) - dur.sum()) < 1e-6
    loader = build_loader(url, world=World(), seed=0, cfg=StreamConfig(bucket=BucketConfig(max_batch_seconds=40)))
    assert loader.steps_per_epoch() > 0  # plannable without reading a shard


def test_zero_rows_is_a_dataset_with_no_shards(tmp_path):
    ds = open_dataset(write_index_dataset(tmp_path / "empty", 0))
    assert ds.shards == [] and ds.manifest["totals"]["samples"] == 0
