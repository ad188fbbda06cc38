"""train/overrides.py: `--set key=value` on the real run config: types coerced, errors naming the key and what it
takes, and the stored config rebuilt exactly (checkpoints store it: tests/train/test_preempt.py)."""
from __future__ import annotations

import pytest

from pipelines import load_pipeline
from shardtrain.train.config import RunConfig
from shardtrain.train.overrides import apply_override, apply_overrides, from_dict, to_dict


def test_values_are_coerced_to_the_field_types():
    cfg = apply_overrides(load_pipeline("tiny_cpu"), ["train.lr=3e-3", "train.max_steps=7", "train.augment=false",
                                                      "model.d_model=96", "train.val_data_url=/d",
                                                      "stream.bucket.num_buckets=3"])
    assert cfg.train.lr == 0.003 and cfg.train.max_steps == 7 and cfg.train.augment is False
    assert cfg.model.d_model == 96 and cfg.train.val_data_url == "/d" and cfg.stream.bucket.num_buckets == 3
    assert apply_override(cfg, "train.val_max_batches", "none").train.val_max_batches is None
    assert apply_override(cfg, "train.val_max_batches", "3").train.val_max_batches == 3


@pytest.mark.parametrize("pair, msg", [
    ("train.nope=1", r"--set train.nope: unknown config key; valid keys here: .*train.lr"),
    ("train.max_steps=1.5", r"--set train.max_steps: expected int, got '1.5'"),
    ("train.augment=maybe", r"expected a bool \(true/false\)"),
    ("train=1", r"--set train: is a section; set one of its fields: train\."),
    ("train.lr.x=1", r"--set train.lr: is not a section"),
    ("train.lr", r"--set expects key=value"),
])
def test_errors_name_the_key(pair, msg):
    with pytest.raises(ValueError, match=msg):
        apply_overrides(load_pipeline("tiny_cpu"), [pair])


def test_stored_config_round_trips_and_unknown_keys_raise():
    cfg = apply_overrides(load_pipeline("tiny_cpu"), ["train.val_data_url=/v", "train.val_extra_urls=/a,/b"])
    d = to_dict(cfg)
    assert from_dict(RunConfig, d) == cfg
    d["train"]["removed_field"] = 1
    with pytest.raises(ValueError, match="TrainConfig: unknown key 'removed_field' in stored config"):
        from_dict(RunConfig, d)
