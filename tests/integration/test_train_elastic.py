"""Elastic training under real torchrun (gloo, CPU): 2 processes -> checkpoint -> 1 process -> 3 processes.

One epoch of 12 utterances, one utterance per batch. The run keeps the epoch's exactly-once promise across both
resizes (the loader re-stripes the rest of the epoch each time), carries the optimiser state through them, and
answers the changed global batch as train/elastic.py documents ("accumulate": 2 -> 1 doubles accumulation,
1 x 2 -> 3 x 1 scales the learning rate by 3/2).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from shardtrain.pack.packer import PackConfig, pack
from shardtrain.train.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

UTTERANCES = 12
LR = 3e-3
SMALL = ["model.d_model=32", "model.num_layers=1", "model.dropout=0", "train.augment=false", f"train.lr={LR}",
         "train.warmup_steps=0", "stream.bucket.max_batch_seconds=30", "stream.bucket.num_buckets=1",
         "stream.bucket.max_batch_size=1", "train.tensorboard=false", "train.log_every_steps=1",
         "train.ckpt_every_steps=2", "train.cpu_threads=1", "train.log_keys=true"]


def train(nproc: int | None, data: str, out: Path, max_steps: int, resume: bool,
          extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "shardtrain"] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "shardtrain"]
    args = ["train", "--data", data, "--pipeline", "tiny_cpu", "--max-steps", str(max_steps), "--out", str(out)]
    args += ["--resume"] if resume else []
    for s in SMALL + list(extra):
        args += ["--set", s]
    res = subprocess.run(launcher + args, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def _pack12(speech_corpus, tmp_path) -> str:
    rows = (speech_corpus / "manifest.tsv").read_text().splitlines()
    tsv = tmp_path / "subset.tsv"
    tsv.write_text("\n".join([rows[0]] + [str(speech_corpus / r.split("\t")[0]) + "\t" + r.split("\t", 1)[1]
                                          for r in rows[1:UTTERANCES + 1]]) + "\n")
    data = str(tmp_path / "shards")
    pack(PackConfig(input=str(tsv), output=data, max_samples_per_shard=3, progress=False))
    return data


def _epoch0_keys(out: Path) -> tuple[list[str], list[dict]]:
    lines = [json.loads(x) for p in sorted((out / "keys").glob("rank*.jsonl")) for x in p.read_text().splitlines()]
    return sorted(k for ln in lines if ln["epoch"] == 0 for k in ln["keys"]), lines


def test_two_then_one_then_three_processes_see_the_epoch_exactly_once(speech_corpus, tmp_path):
    data = _pack12(speech_corpus, tmp_path)
    out = tmp_path / "run"

    train(2, data, out, max_steps=2, resume=False)          # 2 ranks x 1 batch x 2 steps = 4 utterances
    one = train(None, data, out, max_steps=4, resume=True)  # 1 rank x 2 batches x 2 steps = 4 more
    assert "elastic resume: world size 2 -> 1; grad_accum_steps 1 -> 2" in one.stderr
    three = train(3, data, out, max_steps=7, resume=True)   # the last 4 over 3 ranks, then into epoch 1
    assert "elastic resume: world size 1 -> 3; grad_accum_steps 2 -> 1" in three.stderr and "x1.5" in three.stderr

    epoch0, lines = _epoch0_keys(out)
    every = sorted(pq.read_table(Path(data) / "index.parquet", columns=["key"]).column("key").to_pylist())
    assert epoch0 == every, "an utterance of epoch 0 was skipped or repeated across the two resizes"
    assert {ln["rank"] for ln in lines} == {0, 1, 2}
    assert any(ln["epoch"] == 1 for ln in lines)  # the run went on into the next epoch

    state = torch.load(latest_checkpoint(out / "checkpoints") / "train_state.pt", weights_only=True)
    assert state["step"] == 7
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {7}, "optimiser state not carried"
    assert state["scheduler"]["base_lrs"][0] == pytest.approx(LR * 1.5)
    events = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"elastic"' in x]
    assert [(e["old_world_size"], e["world_size"], e["grad_accum_steps"]) for e in events] == [(2, 1, 2), (1, 3, 1)]


def test_block_planner_two_then_one_then_three_processes_see_the_epoch_exactly_once(speech_corpus, tmp_path):
    """The same resizes with the block planner over a memory-mapped index (what corpora past 4M rows use)."""
    data = _pack12(speech_corpus, tmp_path)
    out = tmp_path / "run"
    blocks = ("stream.planner=blocks", "stream.block_s=2", f"stream.index_cache_dir={tmp_path / 'map'}")
    train(2, data, out, max_steps=2, resume=False, extra=blocks)
    one = train(None, data, out, max_steps=4, resume=True, extra=blocks)
    assert "elastic resume: world size 2 -> 1" in one.stderr
    three = train(3, data, out, max_steps=14, resume=True, extra=blocks)  # past the end of epoch 0 on any plan
    assert "elastic resume: world size 1 -> 3" in three.stderr
    epoch0, lines = _epoch0_keys(out)
    every = sorted(pq.read_table(Path(data) / "index.parquet", columns=["key"]).column("key").to_pylist())
    assert epoch0 == every, "an utterance of epoch 0 was skipped or repeated across the two resizes"
    assert any(ln["epoch"] == 1 for ln in lines)
    rank0 = torch.load(latest_checkpoint(out / "checkpoints") / "rank00000.pt", weights_only=True)
    assert json.loads(rank0["loader_state"])["planner"] == "blocks"

