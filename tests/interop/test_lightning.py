"""Lightning on real processes: Trainer(accelerator="cpu", devices=2, strategy="ddp") on gloo, a checkpoint taken
mid-epoch, and a resumed run whose next batches and losses equal the uninterrupted run's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus
from shardtrain.world import World

ROOT = Path(__file__).resolve().parents[2]
DURS = [0.4 + 0.15 * ((i * 5) % 11) for i in range(48)]
BUCKET = BucketConfig(max_batch_seconds=3.0, num_buckets=2, chunk_mb=0.05)

DRIVER = '''
import dataclasses, json, sys
import pytorch_lightning as pl
import torch
from pipelines.tiny_cpu import config
from shardtrain.interop.lightning import CTCLightningModule, ShardDataModule, build_trainer
from shardtrain.load.plan import BucketConfig
from shardtrain.train.model import ModelConfig
from shardtrain.train.text import CharVocab

torch.set_num_threads(1)
data, out, max_steps, ckpt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] or None
base = config()
cfg = dataclasses.replace(
    base, stream=dataclasses.replace(base.stream, bucket=BucketConfig(max_batch_seconds=3.0, num_buckets=2,
                                                                      chunk_mb=0.05), decode_threads=1),
    model=ModelConfig(d_model=32, num_layers=1, num_heads=2, conv_kernel=3),
    train=dataclasses.replace(base.train, max_steps=max_steps, val_every_steps=3, ckpt_every_steps=3,
                              val_max_batches=2, warmup_steps=2, progress=False))

class Record(pl.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        with open(f"{out}/trace-rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "epoch": batch.epoch, "batch": batch.step,
                                "keys": batch.keys, "loss": float(outputs["loss"])}) + "\\n")

dm = ShardDataModule(data, data, stream=cfg.stream, seed=0)
module = CTCLightningModule(cfg, CharVocab.from_index(data).to_json())
trainer = build_trainer(cfg, out, callbacks=[Record()], accelerator="cpu", devices=2, strategy="ddp",
                        enable_model_summary=False)
trainer.fit(module, datamodule=dm, ckpt_path=ckpt)
'''


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("pl")
    out = root / "ds"
    pack(PackConfig(input=str(make_corpus(root / "corpus", DURS, seed=5)), output=str(out),
                    max_samples_per_shard=8, workers=1, progress=False))
    return str(out)


def fit(tmp: Path, data: str, out: str, max_steps: int, ckpt: str = "") -> dict[int, list[dict]]:
    driver = tmp / "driver.py"
    driver.write_text(DRIVER)
    Path(out).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(driver), data, out, str(max_steps), ckpt], env=env, cwd=tmp,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    return {r: [json.loads(x) for x in (Path(out) / f"trace-rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}


@pytest.mark.slow
def test_lightning_ddp_resumes_mid_epoch_with_the_same_batches_and_losses(dataset, tmp_path):
    steps = build_loader(dataset, world=World(world_size=2), seed=0, cfg=StreamConfig(bucket=BUCKET)).steps_per_epoch()
    assert steps > 6  # so the checkpoint at step 3 and the steps after it are mid-epoch
    full = fit(tmp_path, dataset, str(tmp_path / "a"), 6)
    ckpt = tmp_path / "a" / "checkpoints" / "step=3.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["ShardDataModule"]["loader"]["epoch"] == 0 and saved["ShardDataModule"]["loader"]["step"] == 3
    resumed = fit(tmp_path, dataset, str(tmp_path / "b"), 6, str(ckpt))
    for r in (0, 1):
        assert [x["step"] for x in full[r]] == [1, 2, 3, 4, 5, 6]
        assert [x["batch"] for x in full[r]] == [0, 1, 2, 3, 4, 5] and {x["epoch"] for x in full[r]} == {0}
        assert [(x["step"], x["keys"]) for x in resumed[r]] == [(x["step"], x["keys"]) for x in full[r][3:]]
        assert [x["loss"] for x in resumed[r]] == [x["loss"] for x in full[r][3:]]  # bit-exact on CPU
    assert set(full[0][0]["keys"]).isdisjoint(full[1][0]["keys"])  # ranks read different batches
    names = {p.name for p in (tmp_path / "a" / "checkpoints").iterdir()}
    assert any(n.startswith("best-") for n in names) and "last.ckpt" in names
    assert list((tmp_path / "a" / "tensorboard").rglob("events.out.tfevents*"))


def test_the_validation_loader_reads_every_utterance_whatever_the_training_filters_and_budget(dataset):
    """The training stream's duration filter and a budget below the longest utterance left dev utterances out of
    Lightning's val_loss (as they did of the trainer's validation)."""
    from shardtrain.interop.lightning import ShardDataModule

    stream = StreamConfig(bucket=BucketConfig(max_batch_seconds=1.0, num_buckets=1), max_duration_s=1.2,
                          decode_threads=1)
    dm = ShardDataModule(dataset, dataset, stream=stream, seed=0)
    keys = [k for b in dm.val_dataloader() for k in b.keys]
    assert max(DURS) > 1.2 and sorted(keys) == sorted(set(keys)) and len(keys) == len(DURS)


def test_build_trainer_accumulates_and_casts_as_the_config_says(dataset, tmp_path):
    """train.grad_accum_steps and train.precision were dropped by build_trainer: a config trained in bf16 with
    accumulation by `shardtrain train` ran here in fp32 on a smaller global batch; validation is still every
    val_every_steps optimiser steps (Lightning counts its interval in batches), and the features are computed
    outside autocast, as the trainer does (in it, speed perturbation crashed on a dtype mismatch)."""
    import dataclasses

    import pytorch_lightning as pl

    from pipelines.tiny_cpu import config
    from shardtrain.interop.lightning import CTCLightningModule, ShardDataModule, build_trainer
    from shardtrain.train.model import ModelConfig
    from shardtrain.train.text import CharVocab

    base = config()
    cfg = dataclasses.replace(
        base, stream=dataclasses.replace(base.stream, bucket=BUCKET, decode_threads=1),
        model=ModelConfig(d_model=32, num_layers=1, num_heads=2, conv_kernel=3),
        train=dataclasses.replace(base.train, max_steps=2, val_every_steps=1, ckpt_every_steps=2, val_max_batches=1,
                                  warmup_steps=1, progress=False, grad_accum_steps=3, precision="bf16"))
    seen: dict[str, list] = {"batches": [], "val_at": [], "dtype": [], "feats": []}

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen["batches"].append(trainer.global_step)

        def on_validation_end(self, trainer, module):
            seen["val_at"].append(trainer.global_step)

    module = CTCLightningModule(cfg, CharVocab.from_index(dataset, normalizer=cfg.text).to_json())
    module.model.head.register_forward_hook(lambda m, i, o: seen["dtype"].append(o.dtype))
    module.model.subsample.register_forward_pre_hook(lambda m, i: seen["feats"].append(i[0].dtype))
    trainer = build_trainer(cfg, tmp_path, callbacks=[Record()], accelerator="cpu", devices=1,
                            enable_model_summary=False)
    trainer.fit(module, datamodule=ShardDataModule(dataset, dataset, stream=cfg.stream, seed=0))
    assert trainer.accumulate_grad_batches == 3 and trainer.global_step == 2
    assert seen["batches"] == [0, 0, 1, 1, 1, 2]  # three batches per optimiser step
    assert seen["val_at"] == [1, 2] and set(seen["dtype"]) == {torch.bfloat16}
    assert set(seen["feats"]) == {torch.float32}  # features as the trainer computes them: outside autocast
