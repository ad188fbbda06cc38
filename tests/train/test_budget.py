"""train/budget.py: budget.json written and read back, tables checked, rows mapped to buckets, and the closed loop's
pure `adapt` hand-checked against its affine model (the loop on real training is tests/train/test_tune.py)."""
from __future__ import annotations

import json
import math

import pytest

from shardtrain.train.budget import BudgetConfig, adapt, bucket_of, check_table, read_budget, write_budget

MB = 2**20
TABLE = ((2.0, 40.0), (5.0, 30.0), (10.0, 20.0))


def test_write_read_round_trip_and_refusals(tmp_path):
    path = tmp_path / "sub" / "budget.json"
    write_budget(path, {"budget_table": [list(r) for r in TABLE], "memory_target_bytes": 123})
    doc = read_budget(path)
    assert doc["budget_table"] == TABLE and doc["memory_target_bytes"] == 123 and doc["version"] == 1
    assert not list(path.parent.glob("*.tmp"))  # written through a temporary file, renamed
    path.write_text(json.dumps({**json.loads(path.read_text()), "version": 2}))
    with pytest.raises(ValueError, match=r"--batch-budget .*version 2.*re-run `shardtrain tune`"):
        read_budget(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read it"):
        read_budget(path)


@pytest.mark.parametrize("table, msg", [((), "empty budget table"), (((2, 1), (1, 1)), "edges must ascend"),
                                        (((1, 1), (1, 2)), "edges must ascend"), (((1, 0),), "must be > 0"),
                                        (((1, math.inf),), "must be > 0")])
def test_check_table_refuses(table, msg):
    with pytest.raises(ValueError, match=msg):
        check_table(table, "here")


def test_bucket_of_takes_the_first_edge_at_or_above():
    assert [bucket_of(TABLE, d) for d in (0.1, 2.0, 2.01, 5.0, 9.9, 10.0, 30.0)] == [0, 0, 1, 1, 2, 2, 2]
    assert bucket_of(None, 3.7) == 3  # without a table: the 1-second band


def test_config_refuses_inconsistent_shares():
    with pytest.raises(ValueError, match="low < budget.target < budget.high"):
        BudgetConfig(low=0.9, target=0.85)
    with pytest.raises(ValueError, match="max_step must be > 1"):
        BudgetConfig(max_step=1.0)
    with pytest.raises(ValueError, match="memory_limit_mb must be >= 0"):
        BudgetConfig(memory_limit_mb=-1)


def test_adapt_moves_each_bucket_by_its_own_peak():
    cfg = BudgetConfig()  # high 0.92, low 0.6, target 0.85, max_step 1.25, scale [0.25, 4]
    limit, fixed = 100 * MB, 10 * MB
    # bucket 0 far below (30 MB): per_s = 20 MB / 40 s, wants 75 MB / 0.5 MB = 150 s, capped at 40 * 1.25 = 50
    # bucket 1 ran out of memory: halved; bucket 2 near the limit (95 MB): per_s = 85/20, wants 75/4.25 = 17.6 s
    new, moves = adapt(TABLE, TABLE, [30 * MB, math.inf, 95 * MB], limit, fixed, cfg)
    assert new == ((2.0, 50.0), (5.0, 15.0), (10.0, 17.6))
    assert [(m.bucket, m.why) for m in moves] == [(0, "far below the limit"), (1, "out of memory"),
                                                  (2, "near the limit")]
    assert moves[1].as_dict()["peak_mb"] is None and moves[0].as_dict()["peak_mb"] == 30.0
    # a bucket not seen (-1) or inside [low, high] keeps its budget; the tuned bounds clamp the move
    same, none = adapt(TABLE, TABLE, [-1.0, 70 * MB, 80 * MB], limit, fixed, cfg)
    assert same == TABLE and none == []
    floor, _ = adapt(((2.0, 11.0),), ((2.0, 40.0),), [math.inf], limit, fixed, cfg)
    assert floor == ((2.0, 10.0),)  # 5.5 s would be under 0.25 x the tuned 40 s
