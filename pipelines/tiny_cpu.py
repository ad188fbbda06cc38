"""Tiny CTC Conformer (~2M parameters) that learns on 2 CPU cores in minutes; also the preset tests start from.

    shardtrain train --data shards/train --val-data shards/dev --pipeline tiny_cpu --max-steps 600 --out runs/tiny

Batches of at most 60 s of audio per rank; light augmentation (speed perturbation, SpecAugment, some gain and
noise; no reverberation, whose FFT convolutions cost more than the model on a CPU). Transcripts are normalised as
speech recipes do (normalize.SPEECH: NFC, lower case, punctuation stripped except apostrophes, whitespace collapsed),
for the vocabulary, the targets, validation and scoring; `--set text.case=keep` etc. change it.
"""
from __future__ import annotations

from shardtrain.train.augment import AugmentConfig, GainConfig, NoiseConfig, ReverbConfig
from shardtrain.train.features import FeatureConfig
from shardtrain.train.model import SIZES
from shardtrain.train.normalize import SPEECH
from shardtrain.load.plan import BucketConfig
from shardtrain.load.config import StreamConfig
from shardtrain.train.config import RunConfig, TrainConfig


def config() -> RunConfig:
    return RunConfig(
        stream=StreamConfig(bucket=BucketConfig(max_batch_seconds=60.0, num_buckets=8),
                            decode_threads=2),
        augment=AugmentConfig(reverb=ReverbConfig(p=0.0), noise=NoiseConfig(p=0.3, snr_db=(10.0, 30.0)),
                              gain=GainConfig(p=0.3)),
        features=FeatureConfig(n_mels=80),
        model=SIZES["tiny"],
        train=TrainConfig(lr=2e-3, warmup_steps=100, max_steps=1000, log_every_steps=10, val_every_steps=200,
                          ckpt_every_steps=200, keep_last=2, grad_clip_norm=5.0),
        text=SPEECH,
    )
