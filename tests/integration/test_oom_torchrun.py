"""An out-of-memory error on one rank under real torchrun (2 CPU processes, gloo): the step is redone in halves on
that rank while the other waits at the flag all-reduce; nothing hangs, no sample of the step is lost, and the
losses of that and every later step equal those of the same run without the fault."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import pack_subset

pytestmark = pytest.mark.slow

SMALL = ["model.d_model=96", "model.num_layers=2", "model.dropout=0", "train.augment=false", "train.lr=3e-3",
         "train.warmup_steps=3", "stream.bucket.max_batch_seconds=10", "stream.bucket.num_buckets=2",
         "train.tensorboard=false", "train.log_every_steps=1", "train.ckpt_every_steps=0", "train.cpu_threads=1",
         "train.log_keys=true"]
STEPS = 8
TIMEOUT_S = 300


def torchrun(data: str, out: Path, **env_extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "shardtrain",
           "train", "--data", data, "--pipeline", "tiny_cpu", "--max-steps", str(STEPS), "--out", str(out)]
    for s in SMALL:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(speech_corpus, tmp_path_factory) -> str:
    return pack_subset(speech_corpus, tmp_path_factory.mktemp("twelve"), 12)


def test_injected_oom_on_rank0_is_redone_in_halves_and_training_goes_on(data, tmp_path):
    torchrun(data, tmp_path / "clean")
    res = torchrun(data, tmp_path / "oom", SHARDTRAIN_FAULTS="train.step.rank0=5:oom")
    assert "out of memory in step 5" in res.stderr and (tmp_path / "oom" / ".fault_oom_step_5.done").is_file()
    got = rows(tmp_path / "oom")
    [ev] = [r for r in got if r.get("event") == "oom_split"]
    assert ev["step"] == 5 and ev["ranks"] == [0] and ev["parts"] == 2 and ev["oom_splits"] == 1
    step5 = [json.loads(x) for x in (tmp_path / "oom" / "keys" / "rank00000.jsonl").read_text().splitlines()
             if json.loads(x)["step"] == 5]
    assert ev["samples"] == sum(len(ln["keys"]) for ln in step5) >= 2  # rank 0's whole batch, redone
    clean = [(r["step"], r["loss"]) for r in rows(tmp_path / "clean") if "loss" in r]
    oom = [(r["step"], r["loss"]) for r in got if "loss" in r]
    assert [s for s, _ in oom] == list(range(1, STEPS + 1))  # every step once: no rank ran ahead or hung
    for (s1, a), (s2, b) in zip(clean, oom):  # step 5's loss includes every sample; later steps the same updates
        assert s1 == s2 and b == pytest.approx(a, rel=1e-5, abs=1e-6), (clean, oom)
    for r in range(2):  # the keys each rank trained on are those of the clean run, step by step
        keys = lambda out: [(ln["step"], sorted(ln["keys"])) for ln in map(  # noqa: E731
            json.loads, (out / "keys" / f"rank{r:05d}.jsonl").read_text().splitlines())]
        assert keys(tmp_path / "oom") == keys(tmp_path / "clean")
