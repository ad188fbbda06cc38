"""train/config.py: TrainConfig refuses a bad value at construction, naming the field (so `--set` and the CLI fail
before any data is read); data_sources is one URL or (url, weight) pairs; RunConfig is frozen."""
from __future__ import annotations

import dataclasses

import pytest

from pipelines import load_pipeline
from shardtrain.train.config import RunConfig, TrainConfig, data_sources


@pytest.mark.parametrize("fields, match", [
    ({"max_steps": 0}, r"train.max_steps \(--max-steps\) must be >= 1"),
    ({"grad_accum_steps": 0}, "train.grad_accum_steps"),
    ({"precision": "fp8"}, "train.precision must be one of"),
    ({"tokenizer": "bpe"}, "train.tokenizer must be"),
    ({"tokenizer": "sentencepiece"}, "needs train.sentencepiece_model"),
    ({"lr": 0.0}, "train.lr must be > 0"),
    ({"min_lr_ratio": 1.5}, "min_lr_ratio in"),
    ({"mix_urls": ("b",), "mix_weights": (1.0,)}, "1 --weight values for 2 --data datasets"),
    ({"mix_urls": ("b",), "mix_weights": (1.0, 0.0)}, "--weight values must be > 0"),
    ({"elastic_batch": "double"}, "train.elastic_batch must be"),
    ({"cpu_threads": -1}, "train.cpu_threads"),
    ({"max_impossible_share": 0.0}, "max_impossible_share in"),
    ({"lease_ttl_s": 5}, "train.lease_ttl_s must be >= 10"),
    ({"keep_last": -1}, "train.keep_last >= 0"),
    ({"val_data_url": "/a/dev", "val_extra_urls": ("/a/dev",)}, "dev"),  # the same URL twice (valsets.py)
])
def test_a_bad_value_is_refused_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(data_url="d", **fields)


def test_data_sources_one_url_or_weighted_pairs():
    assert data_sources(TrainConfig(data_url="a")) == "a"
    assert data_sources(TrainConfig(data_url="a", mix_urls=("b", "c"))) == [("a", 1.0), ("b", 1.0), ("c", 1.0)]
    assert data_sources(TrainConfig(data_url="a", mix_urls=("b",), mix_weights=(3.0, 1.0))) == [("a", 3.0),
                                                                                                 ("b", 1.0)]


def test_run_config_is_frozen_and_composes_the_stages():
    cfg = load_pipeline("tiny_cpu")
    assert isinstance(cfg, RunConfig) and isinstance(cfg.train, TrainConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.max_steps = 3
    edited = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=3))
    assert edited.train.max_steps == 3 and cfg.train.max_steps != 3 and edited.model == cfg.model
    assert {f.name for f in dataclasses.fields(RunConfig)} >= {"stream", "augment", "features", "model", "train",
                                                                "text", "budget"}
