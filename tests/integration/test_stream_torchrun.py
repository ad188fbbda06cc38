"""Two real torchrun processes (gloo): equal batch counts, and together every sample exactly once."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from shardtrain.format.manifest import open_dataset
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from shardtrain.load.plan import BucketConfig
    from shardtrain.load.loader import StreamConfig, build_loader
    from shardtrain.world import World

    dist.init_process_group("gloo")
    world = World.from_env()
    cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=6.0, chunk_mb=0.05), epochs=1, decode_threads=1)
    keys, steps = [], 0
    for batch, state in build_loader(sys.argv[1], world=world, seed=0, cfg=cfg):
        keys += batch.keys
        steps += 1
        dist.barrier()  # a rank with fewer batches would hang here (the test has a timeout)
    with open(f"{sys.argv[2]}/rank{world.rank}.json", "w") as f:
        json.dump({"keys": keys, "steps": steps}, f)
    dist.destroy_process_group()
""")


def test_torchrun_two_ranks_equal_steps_exactly_once(tmp_path):
    corpus = make_corpus(tmp_path / "c", [0.4 + 0.23 * (i % 13) for i in range(45)], seed=3)
    ds = tmp_path / "ds"
    pack(PackConfig(input=str(corpus), output=str(ds), max_samples_per_shard=7, workers=1, progress=False))
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), str(ds), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["steps"] == ranks[1]["steps"] > 0
    keys = ranks[0]["keys"] + ranks[1]["keys"]
    want = open_dataset(str(ds)).read_index(columns=["key"]).column("key").to_pylist()
    assert len(keys) == len(set(keys)) and sorted(keys) == sorted(want)
