"""`shardtrain plan` (load/preflight.py) says what the loader then does: steps, fill, padding, mixture shares.

Compared with real Loaders of every rank over one epoch of real (tone) audio, so the report cannot drift from
the loader it describes."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig, cost_s
from shardtrain.pack import PackConfig, pack
from shardtrain.testing.corpus import make_corpus
from shardtrain.world import World

BUDGET = 12.0


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory, tone_corpus):
    root = tmp_path_factory.mktemp("preflight")
    a = str(root / "a")
    pack(PackConfig(input=str(tone_corpus), output=a, max_samples_per_shard=5, progress=False))
    small = make_corpus(root / "small", [0.5, 0.8, 1.1, 1.4, 1.7, 2.0], seed=3)
    b = str(root / "b")
    pack(PackConfig(input=str(small), output=b, progress=False))
    return a, b


def _plan(*args: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "shardtrain", "plan", *args, "--json",
                          "--set", f"stream.bucket.max_batch_seconds={BUDGET}", "--set", "stream.bucket.num_buckets=3"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def _epoch(url, world_size: int):
    cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=BUDGET, num_buckets=3), epochs=1)
    loaders = [build_loader(url, world=World(rank=r, world_size=world_size), seed=0, cfg=cfg)
               for r in range(world_size)]
    batches = [[b for b, _ in ld] for ld in loaders]
    return loaders, batches


def test_plan_matches_the_loader(two_datasets):
    a, _ = two_datasets
    rep = _plan(a, "--world-size", "2", "--seed", "0")
    loaders, batches = _epoch(a, 2)
    assert rep["steps_per_epoch"] == len(batches[0]) == len(batches[1])
    durs = [b.durations_s.numpy() for rank in batches for b in rank if len(b)]
    fill = sum(float(cost_s(d, BucketConfig(max_batch_seconds=BUDGET)).sum()) for d in durs) / (BUDGET * len(durs))
    padding = sum(float(d.sum()) for d in durs) / sum(float(d.max()) * len(d) for d in durs)
    assert rep["fill"] == pytest.approx(fill, abs=1e-9)
    assert rep["padding_efficiency"] == pytest.approx(padding, abs=1e-9)
    assert rep["too_long"] == loaders[0].too_long_per_epoch
    assert rep["rows_per_epoch"] == sum(len(b) for rank in batches for b in rank)
    assert rep["memory"]["per_rank_bytes"] > 0 and rep["io"]["node_read_mb_s"] > 0


def test_plan_mixture_shares_match_the_loader(two_datasets):
    a, b = two_datasets
    rep = _plan(a, b, "--weight", "1", "--weight", "3", "--world-size", "1", "--seed", "0")
    loaders, batches = _epoch([(a, 1.0), (b, 3.0)], 1)
    sec = np.array(loaders[0].counters["dataset_seconds"])
    got = [m["share_per_epoch"][0] for m in rep["mixture"]]
    assert got == pytest.approx((sec / sec.sum()).tolist(), abs=1e-9)
    assert rep["mixture"][1]["epochs_until_repeat"] < 1  # the small dataset repeats inside an epoch, as planned
    assert rep["steps_per_epoch"] == len(batches[0])


def test_plan_refuses_bad_sizes_in_one_line(two_datasets):
    a, _ = two_datasets
    res = subprocess.run([sys.executable, "-m", "shardtrain", "plan", a, "--world-size", "3", "--nodes", "2"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "--nodes" in res.stderr and len(res.stderr.strip().splitlines()) == 1
