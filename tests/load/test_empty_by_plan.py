"""A batch empty by plan (equal steps over ranks with fewer rows than batches) is counted and logged as such,
never as a decode failure; and the loader with a fine-grained budget table plans and streams (the issue 29 hang)."""
import json
import logging
import subprocess
import sys

import pytest

from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus
from shardtrain.train.budget import FILE_VERSION, write_budget
from shardtrain.world import World


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("emptyplan")
    corpus = make_corpus(root / "corpus", [0.3, 0.4, 0.5, 0.6, 1.9, 2.0, 2.1, 2.2, 2.3], seed=3)
    out = root / "ds"
    pack(PackConfig(input=str(corpus), output=str(out), workers=1, progress=False))
    return str(out)


@pytest.mark.timeout(120)
def test_empty_by_plan_counted_and_named(small, caplog):
    # edges every 0.25-0.5 s: buckets of 0-2 rows; 4 ranks, 2.x s rows with a 2.5 s budget: one a batch
    table = tuple((0.25 + 0.3 * i, 2.5) for i in range(10))
    cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=2.5, budget_table=table), epochs=1)
    planned_empty, keys, steps = 0, [], set()
    with caplog.at_level(logging.INFO, logger="shardtrain.load.loader"):
        for rank in range(4):
            loader = build_loader(small, world=World(rank=rank, world_size=4), seed=0, cfg=cfg)
            batches = [b for b, _ in loader]
            steps.add(len(batches))
            keys += [k for b in batches for k in b.keys]
            assert all(b.planned == len(b) for b in batches), "a planned sample went missing"
            empty = sum(b.planned == 0 for b in batches)
            assert loader.counters["empty_by_plan"] == empty
            planned_empty += empty
    assert len(steps) == 1 and len(keys) == len(set(keys)) == 9
    assert planned_empty > 0  # 9 rows over 4 ranks in >= 3 steps: some batch must be empty
    lines = [r.getMessage() for r in caplog.records]
    assert sum("empty by plan" in m for m in lines) == planned_empty
    assert not any("failed to decode" in m for m in lines)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", ["3", "8"])
def test_plan_cli_with_a_fine_budget_table_returns(small, tmp_path, world_size):
    """`shardtrain plan --batch-budget` with edges every 0.25-0.5 s returns (it never did: the issue 29 hang)."""
    budget = tmp_path / "budget.json"
    edges = [round(0.25 + 0.35 * i, 3) for i in range(12)]
    write_budget(budget, {"version": FILE_VERSION, "budget_table": [[e, 2.5] for e in edges]})
    res = subprocess.run([sys.executable, "-m", "shardtrain", "plan", small, "--world-size", world_size,
                          "--batch-budget", str(budget), "--seed", "0", "--json"],
                         capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(res.stdout)
    assert rep["steps_per_epoch"] > 0 and rep["rows_per_epoch"] == 9
