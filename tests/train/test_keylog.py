"""train/keylog.py: keys/rank{R}.jsonl names every utterance of every micro-batch with its step, epoch and batch;
a resume drops the lines past its checkpoint, so each step appears once (the real runs that use it:
tests/train/test_preempt.py, tests/integration/test_train_elastic.py)."""
from __future__ import annotations

import json

import torch

from shardtrain.load.batch import Batch
from shardtrain.train.keylog import KeyLog


def batch(keys: list[str], epoch: int, step: int) -> Batch:
    n = len(keys)
    return Batch(waves=torch.zeros(n, 8), lengths=torch.full((n,), 8), keys=keys, texts=[""] * n,
                 durations_s=torch.ones(n), sample_rate_hz=16000, epoch=epoch, step=step)


def test_lines_per_micro_batch_and_resume_drops_the_redone_steps(tmp_path):
    log = KeyLog(tmp_path, rank=3, start_step=0)
    log.write(1, [(batch(["a", "b"], 0, 0), {}), (batch(["c"], 0, 1), {})])
    log.write(2, [(batch(["d"], 0, 2), {})])
    log.write(3, [(batch(["e", "f"], 1, 0), {})])
    log.close()
    path = tmp_path / "keys" / "rank00003.jsonl"
    assert log.path == path
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0] == {"step": 1, "epoch": 0, "batch": 0, "rank": 3, "keys": ["a", "b"]}
    assert [(x["step"], x["batch"], x["keys"]) for x in lines] == [(1, 0, ["a", "b"]), (1, 1, ["c"]),
                                                                   (2, 2, ["d"]), (3, 0, ["e", "f"])]
    resumed = KeyLog(tmp_path, rank=3, start_step=2)  # the checkpoint was at step 2: step 3 is trained again
    resumed.write(3, [(batch(["e", "f"], 1, 0), {})])
    resumed.close()
    steps = [json.loads(x)["step"] for x in path.read_text().splitlines()]
    assert steps == [1, 1, 2, 3]


def test_a_smaller_resumed_run_trims_the_ranks_it_no_longer_has(tmp_path):
    """Killed on 3 ranks past its checkpoint at step 2, resumed on 2: rank 2's lines of step 3 are gone (step 3 is
    trained again by ranks 0 and 1), so the audit sees each utterance once."""
    for r in range(3):
        log = KeyLog(tmp_path, rank=r, start_step=0, world_size=3)
        for step in (1, 2, 3):
            log.write(step, [(batch([f"r{r}s{step}"], 0, step), {})])
        log.close()
    KeyLog(tmp_path, rank=1, start_step=2, world_size=2).close()  # rank 1 owns neither rank 0's nor rank 2's file
    def steps(r: int) -> list[int]:
        return [json.loads(x)["step"] for x in (tmp_path / "keys" / f"rank{r:05d}.jsonl").read_text().splitlines()]

    assert steps(2) == [1, 2, 3] and steps(0) == [1, 2, 3] and steps(1) == [1, 2]
    KeyLog(tmp_path, rank=0, start_step=2, world_size=2).close()  # rank 0 trims its own and rank 2's (2 % 2 == 0)
    assert steps(0) == [1, 2] and steps(2) == [1, 2]
