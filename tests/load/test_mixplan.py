"""load/mixplan.py: the weighted mixture as a planner over two real packed datasets, by rows and by blocks: the
sources parsed, each epoch's selection in the weight shares of audio, every selected (dataset, row) planned exactly
once over the ranks, one sample rate (the mixture through the loader: tests/integration/test_mixture_s3.py; the
pure selection: tests/load/test_mixture.py)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from shardtrain.format.manifest import open_dataset
from shardtrain.load.config import StreamConfig
from shardtrain.load.errors import StreamError
from shardtrain.load.mixplan import MixturePlanner, make_planner, parse_sources
from shardtrain.load.plan import BucketConfig
from shardtrain.pack.config import AudioTarget

from conftest import pack_tones

BIG = [0.5 + 0.11 * ((i * 7) % 19) for i in range(40)]  # 40 rows, ~2.5 s mean
SMALL = [0.4 + 0.2 * i for i in range(8)]  # 8 rows


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixplan")
    return pack_tones(root / "big", BIG, seed=5), pack_tones(root / "small", SMALL, seed=6)


def cfg(tmp_path, planner: str) -> StreamConfig:
    return StreamConfig(bucket=BucketConfig(max_batch_seconds=6.0, chunk_mb=0.05, num_buckets=2), planner=planner,
                        block_s=3.0, index_cache_dir=str(tmp_path / "cache"))


def test_parse_sources():
    assert parse_sources(["a", ("b", 3), ["c", "0.5"]]) == [("a", 1.0), ("b", 3.0), ("c", 0.5)]
    with pytest.raises(ValueError, match="weight of b must be > 0"):
        parse_sources(["a", ("b", 0)])
    with pytest.raises(ValueError, match="at least one dataset"):
        parse_sources([])


@pytest.mark.parametrize("planner", ["rows", "blocks"])
def test_selection_in_weight_shares_and_planned_exactly_once(two, tmp_path, planner):
    big, small = two
    p = make_planner([big, (small, 3.0)], seed=4, cfg=cfg(tmp_path, planner))
    assert isinstance(p, MixturePlanner) and p.name == planner and p.rows_total == 48
    durs = [open_dataset(u).read_index(columns=["duration_s"]).column("duration_s").to_numpy() for u in two]
    for epoch in (0, 1):
        src, row = p.selection(epoch)
        assert set(src.tolist()) == {0, 1} and all(row[src == i].max() < len(d) for i, d in enumerate(durs))
        secs = np.array([durs[i][row[src == i]].sum() for i in (0, 1)])
        # the small dataset (weight 3 of 4) takes ~3/4 of the audio: repeated, never before all its rows came
        assert abs(secs[1] / secs.sum() - 0.75) < 0.12, secs
        counts = np.bincount(row[src == 1], minlength=len(SMALL))
        assert counts.max() - counts.min() <= 1 and counts.min() >= 1
        # over the ranks' plans, every selected (dataset, row) at most as often as it was chosen, and all of
        # them but the equal-steps tail (fewer than a batch per rank)
        view = p.epoch(epoch, 2)
        planned = Counter()
        for rank in range(2):
            for rc in view.chunks(rank):
                for b in rc.chunk.batches:
                    rows, srcs = rc.origin(b)
                    planned.update(zip(srcs.tolist(), rows.tolist()))
        chosen = Counter(zip(src.tolist(), row.tolist()))
        assert not planned - chosen and sum((chosen - planned).values()) < 0.1 * len(src), (planned, chosen)
    assert p.fingerprint.startswith("mix-") and p.fingerprint == make_planner(
        [big, (small, 3.0)], seed=99, cfg=cfg(tmp_path, planner)).fingerprint  # the data and weights, not the seed
    assert p.fingerprint != make_planner([big, (small, 2.0)], seed=4, cfg=cfg(tmp_path, planner)).fingerprint


def test_mixed_sample_rates_are_refused(two, tmp_path):
    other = pack_tones(tmp_path / "sr8k", SMALL, seed=7, sample_rate_hz=8000, audio=AudioTarget(sample_rate_hz=8000))
    with pytest.raises(StreamError, match=r"mixes sample rates \[8000, 16000\]"):
        make_planner([two[0], other], seed=0, cfg=cfg(tmp_path, "rows"))
