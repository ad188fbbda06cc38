"""~40M-parameter CTC Conformer for LibriSpeech-sized corpora on GPUs (bf16, NCCL).

    torchrun --nproc_per_node=8 -m shardtrain train --pipeline librispeech_base --max-steps 150000 \\
        --data s3://bucket/librispeech/train-960 --val-data s3://bucket/librispeech/dev-clean --out /ckpt/ls-base

Per GPU: at most 600 s of audio per batch (padded budget, with a quadratic term for attention cost), 4 loader
workers of 4 decode threads each; global batch = 8 GPUs x 600 s x grad_accum_steps. The full augmentation chain
runs on the GPU. Tune `--set stream.bucket.max_batch_seconds=...` to the GPU memory. Transcripts are normalised
with normalize.SPEECH (NFC, lower case, punctuation stripped except apostrophes): LibriSpeech decodes in lower case.
"""
from __future__ import annotations

from shardtrain.train.augment import AugmentConfig
from shardtrain.train.features import FeatureConfig
from shardtrain.train.model import SIZES
from shardtrain.train.normalize import SPEECH
from shardtrain.load.plan import BucketConfig
from shardtrain.load.config import StreamConfig
from shardtrain.train.config import RunConfig, TrainConfig


def config() -> RunConfig:
    return RunConfig(
        stream=StreamConfig(bucket=BucketConfig(max_batch_seconds=600.0, padded_budget=True, num_buckets=30,
                                                quadratic_duration_s=60.0, chunk_mb=64.0),
                            decode_threads=4, prefetch_chunks=2),
        augment=AugmentConfig(),
        features=FeatureConfig(n_mels=80),
        model=SIZES["base"],
        train=TrainConfig(lr=1e-3, warmup_steps=5000, max_steps=150_000, weight_decay=1e-3, grad_clip_norm=5.0,
                          precision="bf16", log_every_steps=50, val_every_steps=2000, ckpt_every_steps=2000,
                          keep_last=3),
        text=SPEECH,
    )
