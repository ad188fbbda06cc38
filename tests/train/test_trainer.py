"""The Trainer object (train/trainer.py) driven directly, without the process entry (train/loop.py): a run on a
small real dataset returns its metrics and writes one row per step, and the closed loop's re-plan between epochs
restarts the trainer's own loader (Loader.restart) with the moved budget table instead of building another."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import pack_subset
from pipelines import load_pipeline
from shardtrain.format.manifest import open_dataset
from shardtrain.train.budget import write_budget
from shardtrain.train.overrides import apply_overrides
from shardtrain.train.preempt import Preemption
from shardtrain.train.trainer import Interrupts, Trainer
from shardtrain.world import World

SMALL = ["model.d_model=64", "model.num_layers=1", "model.dropout=0", "train.augment=false", "train.lr=3e-3",
         "train.warmup_steps=4", "stream.bucket.max_batch_seconds=12", "train.tensorboard=false",
         "train.progress=false", "train.cpu_threads=1", "train.log_every_steps=1", "train.val_every_steps=0",
         "train.ckpt_every_steps=0", "train.log_keys=true"]


@pytest.fixture(scope="module")
def data(speech_corpus, tmp_path_factory) -> str:
    return pack_subset(speech_corpus, tmp_path_factory.mktemp("ten"), 10)


def trainer(data: str, out: Path, steps: int, *extra: str) -> Trainer:
    cfg = apply_overrides(load_pipeline("tiny_cpu"), SMALL + [
        f"train.data_url={data}", f"train.out_dir={out}", f"train.max_steps={steps}", *extra])
    return Trainer(cfg, World(), torch.device("cpu"), resume=False, storage_options=None,
                   interrupts=Interrupts(Preemption(())))


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_fit_runs_to_max_steps_and_returns_the_last_metrics(data, tmp_path):
    t = trainer(data, tmp_path, 5)
    assert t.run.step == 0 and (tmp_path / "config.json").exists() and (tmp_path / "vocab.json").exists()
    res = t.fit()
    assert res["step"] == t.run.step == 5 and res["out_dir"] == str(tmp_path)
    losses = [r for r in rows(tmp_path) if "loss" in r]
    assert [r["step"] for r in losses] == [1, 2, 3, 4, 5]
    assert res["loss"] == losses[-1]["loss"] > 0 and res["checkpoint"].endswith("step_000005")
    assert res["nonfinite_steps"] == 0 and res["oom_splits"] == 0
    assert t.run.loader_state is not None and t.run.loader_state["counters"]["batches"] >= 5
    # the ledger's content id comes from the loader's own manifest, and is the dataset's
    attempt = json.loads(next((tmp_path / "ledger").glob("a*.json")).read_text())
    assert attempt["datasets"] == [{"url": data, "weight": 1.0, "content": open_dataset(data).content_id}]
    assert t.loader.content_ids == [open_dataset(data).content_id]


def test_the_closed_loop_restarts_the_same_loader_with_the_moved_table(data, tmp_path):
    budget = tmp_path / "budget.json"
    table = [[2.5, 9.0], [4.5, 11.0], [6.0, 14.0]]
    write_budget(budget, {"budget_table": table, "memory_target_bytes": 1 << 40, "device": "cpu", "buckets": []})
    t = trainer(data, tmp_path / "run", 10, f"budget.file={budget}", "budget.memory_limit_mb=100000")
    loader, ctx = t.loader, t.ctx
    assert t.closed.active and loader.cfg.bucket.budget_table == tuple(map(tuple, table))
    assert ctx.table == t.closed.table and ctx.meter is not None
    # one home per value: the config, world, device, collectives, augmenters and meter live in the step context
    assert not {"cfg", "world", "device", "comm", "augmenters", "mem"} & set(vars(t)), sorted(vars(t))
    t.fit()
    evs = [r for r in rows(tmp_path / "run") if r.get("event") == "budget"]
    assert evs[0]["epoch"] == 1 and evs[0]["moves"], evs  # far under the limit: budgets move up
    moved = tuple(map(tuple, [ev for ev in evs if ev["moves"]][-1]["table"]))
    assert t.loader is loader, "the re-plan built another loader instead of restarting the trainer's"
    now = t.ctx.cfg.stream.bucket.budget_table
    assert loader.cfg.bucket.budget_table == now == moved != tuple(map(tuple, table))
    # the step's context was rebuilt with the moved config and table; the rest of it is the run's
    assert t.ctx is not ctx and tuple(map(tuple, t.ctx.table)) == moved
    assert (t.ctx.world, t.ctx.comm, t.ctx.augmenters, t.ctx.meter) == (ctx.world, ctx.comm, ctx.augmenters, ctx.meter)
    keys = [json.loads(x) for x in (tmp_path / "run" / "keys" / "rank00000.jsonl").read_text().splitlines()]
    assert any(k["epoch"] == 1 for k in keys) and t.run.loader_state["epoch"] >= 1
