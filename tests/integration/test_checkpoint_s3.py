"""Checkpoints on an object store: `--out s3://bucket/run` saves, commits by meta.json, and resumes bit-exactly."""
from __future__ import annotations

import json

import pytest
import torch

from pipelines import load_pipeline
from shardtrain import faults, storage
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.train import checkpoint as ckpt
from shardtrain.train.loop import train
from shardtrain.train.overrides import apply_overrides
from shardtrain.world import World

pytestmark = pytest.mark.s3

SMALL = ["model.d_model=96", "model.num_layers=2", "model.dropout=0", "train.augment=false", "train.lr=3e-3",
         "train.warmup_steps=20", "stream.bucket.max_batch_seconds=30", "stream.bucket.num_buckets=1",
         "train.tensorboard=false", "train.progress=false", "train.cpu_threads=1", "train.log_every_steps=1",
         "train.ckpt_every_steps=3"]


def run(data: str, out: str, so: dict | None, resume: bool = False) -> dict:
    cfg = apply_overrides(load_pipeline("tiny_cpu"), SMALL + [
        f"train.data_url={data}", f"train.out_dir={out}", "train.max_steps=6"])
    return train(cfg, World(), resume=resume, storage_options=so)


def test_s3_checkpoint_round_trip_resumes_bit_exactly(s3, s3_bucket, tmp_path, monkeypatch, speech_corpus):
    rows = (speech_corpus / "manifest.tsv").read_text().splitlines()
    tsv = tmp_path / "six.tsv"
    tsv.write_text("\n".join([rows[0]] + [str(speech_corpus / r.split("\t")[0]) + "\t" + r.split("\t", 1)[1]
                                          for r in rows[1:7]]) + "\n")
    data = str(tmp_path / "six")
    pack(PackConfig(input=str(tsv), output=data, max_samples_per_shard=2, progress=False))
    so = s3.storage_options
    run(data, str(tmp_path / "local"), None)
    url = f"{s3_bucket}/run"
    monkeypatch.setenv(faults.ENV, "train.step.rank0=3")  # crash right after the step-3 checkpoint
    with pytest.raises(faults.InjectedFault):
        run(data, url, so)
    assert [s for s, _ in ckpt.list_checkpoints(f"{url}/checkpoints", so)] == [3]
    # a step folder without meta.json (an upload cut short) is not a checkpoint
    storage.atomic_write_bytes(f"{url}/checkpoints/step_000009/model.pt", b"partial", so)
    assert [s for s, _ in ckpt.list_checkpoints(f"{url}/checkpoints", so)] == [3]
    with pytest.raises(ValueError, match="--resume"):
        run(data, url, so)
    storage.remove(f"{url}/checkpoints/step_000009", so, recursive=True)
    result = run(data, url, so, resume=True)
    assert result["checkpoint"] == f"{url}/checkpoints/step_000006"
    local = [json.loads(x) for x in (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()]
    remote = [json.loads(x) for x in storage.read_bytes(f"{url}/metrics.jsonl", so).decode().splitlines()]
    assert [r["step"] for r in remote if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in remote if "loss" in r] == [r["loss"] for r in local if "loss" in r]
    state = ckpt.load_checkpoint(f"{url}/checkpoints/step_000006", rank=0, world_size=1, storage_options=so)
    ref = torch.load(tmp_path / "local/checkpoints/step_000006/model.pt", weights_only=True)
    assert all(torch.equal(state["model"][k], ref[k]) for k in ref)
