"""`shardtrain train` under real torchrun (2 CPU processes, gloo): parity with one process, recovery from a
killed rank under --max-restarts, and an empty batch on one rank that must not hang DDP."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardtrain import faults
from shardtrain.train.checkpoint import list_checkpoints

pytestmark = pytest.mark.slow

# Same global batch for 1 and 2 processes: one duration bucket and a budget above the whole dataset, so world
# size 1 takes all 6 utterances per step and each of 2 ranks takes its half. No augmentation or dropout.
SMALL = ["model.d_model=96", "model.num_layers=2", "model.dropout=0", "train.augment=false", "train.lr=3e-3",
         "train.warmup_steps=3", "stream.bucket.max_batch_seconds=30", "stream.bucket.num_buckets=1",
         "train.tensorboard=false", "train.log_every_steps=1", "train.ckpt_every_steps=2", "train.cpu_threads=1"]
STEPS = 5
TIMEOUT_S = 240



def train_cmd(nproc: int | None, data: str, out: Path, *extra: str, restarts: int = 0) -> list[str]:
    launcher = [sys.executable, "-m", "shardtrain"] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        f"--max-restarts={restarts}", "-m", "shardtrain"]
    args = ["train", "--data", data, "--pipeline", "tiny_cpu", "--max-steps", str(STEPS), "--out", str(out)]
    for s in SMALL + list(extra):
        args += ["--set", s]
    return launcher + args


def run_ok(cmd: list[str], **env_extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def data(six_utts) -> str:
    return six_utts  # conftest's: the first 6 speech utterances, 2 a shard


@pytest.fixture(scope="module")
def two_rank_run(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    run_ok(train_cmd(2, data, out))
    return out


def test_two_processes_match_one_process_with_the_same_global_batch(data, two_rank_run, tmp_path):
    run_ok(train_cmd(None, data, tmp_path))
    one, two = losses(tmp_path), losses(two_rank_run)
    assert [s for s, _ in two] == list(range(1, STEPS + 1))  # rank 0 logs each step once
    for (s1, l1), (s2, l2) in zip(one, two):
        assert s1 == s2 and l2 == pytest.approx(l1, rel=2e-3), (one, two)
    assert one[-1][1] < one[0][1]  # and it is learning
    meta = json.loads((two_rank_run / "checkpoints" / f"step_{STEPS:06d}" / "meta.json").read_text())
    assert meta["world_size"] == 2 and (two_rank_run / "checkpoints" / f"step_{STEPS:06d}" / "rank00001.pt").is_file()


def test_killed_rank_recovers_from_last_checkpoint_under_max_restarts(data, two_rank_run, tmp_path):
    """Rank 1 raises once after step 3; torchrun restarts both ranks, which resume from step 2 on their own."""
    res = run_ok(train_cmd(2, data, tmp_path, restarts=1), **{faults.ENV: "train.step.rank1=3"})
    assert "injected fault at train.step.rank1=3" in res.stderr
    assert (tmp_path / ".fault_step_3.done").is_file()
    assert "resumed from" in res.stderr and "step_000002" in res.stderr
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")][-1] == STEPS
    # the recovered run is the uninterrupted run: same losses, bit for bit, each step logged once
    assert losses(tmp_path) == losses(two_rank_run)


def test_empty_batch_on_one_rank_does_not_hang(data, tmp_path):
    """Corrupt one sample and use 1-utterance batches: one rank gets B=0 while the other has a sample."""
    ds = tmp_path / "corrupt"
    shutil.copytree(data, ds)
    row = pq.read_table(ds / "index.parquet").to_pylist()[0]
    with open(ds / f"shard-{row['shard']:06d}.tar", "r+b") as f:
        f.seek(row["audio_offset"])
        f.write(b"\x00" * row["audio_size"])
    out = tmp_path / "run"
    res = run_ok(train_cmd(2, str(ds), out, "stream.bucket.max_batch_size=1", "stream.bucket.max_batch_seconds=6",
                               "stream.max_skipped_share=0.5"))
    assert "empty batch" in res.stderr and "silent dummy" in res.stderr  # the DDP path under test was taken
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["skipped"] >= 1


def test_a_nan_on_one_rank_skips_the_step_on_both_and_they_stay_in_step(data, tmp_path):
    """Rank 1's loss turns NaN on its 3rd forward (tests/train/nanmodel.py): both ranks skip that optimiser step
    (the weights each sees at its 4th forward are those of its 3rd), hold the same weights throughout, and the
    run finishes with the skip counted."""
    here = Path(__file__).resolve().parent.parent / "train"
    res = run_ok(train_cmd(2, data, tmp_path / "run", "model.factory=nanmodel:build"),
                 NAN_AT="3", NAN_RANK="1", NAN_LOG=str(tmp_path / "w"),
                 PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["step"] == STEPS and result["nonfinite_steps"] == 1
    logs = [[json.loads(x)["weights"] for x in Path(f"{tmp_path / 'w'}.rank{r}").read_text().splitlines()]
            for r in (0, 1)]
    assert logs[0] == logs[1]  # the same weights on both ranks at every forward
    assert logs[0][2] == logs[0][3] and logs[0][1] != logs[0][2]
