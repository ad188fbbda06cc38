"""Tiny CNN + BiLSTM CTC model (the seed trainer's architecture, ~0.95M parameters) on the tiny_cpu recipe.

    shardtrain train --data shards/train --val-data shards/dev --pipeline tiny_bilstm --max-steps 600 --out runs/lstm

Same data, augmentation, schedule and text normaliser as tiny_cpu; only the encoder differs (3 BiLSTM layers of
2 x 96 units after the 4x convolutional subsampling), so the two presets compare encoders on equal terms.
"""
from __future__ import annotations

import dataclasses

from pipelines.tiny_cpu import config as tiny_cpu
from shardtrain.train.config import RunConfig
from shardtrain.train.model import ModelConfig


def config() -> RunConfig:
    return dataclasses.replace(tiny_cpu(), model=ModelConfig(encoder="bilstm", d_model=192, num_layers=3))
