"""train/step.py on its own: the collectives are exact no-ops in one process, an empty batch becomes a silent
half-second dummy with no target, targets are encoded on the CPU, one augmentation chain per input rate."""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from pipelines import load_pipeline
from shardtrain.load.batch import Batch
from shardtrain.train.step import Augmenters, Collectives, autocast, to_device
from shardtrain.train.text import CharVocab
from shardtrain.world import World

CPU = torch.device("cpu")


def batch(texts: list[str], seconds: float = 0.5, rate: int = 16000) -> Batch:
    n = int(seconds * rate)
    waves = torch.randn(len(texts), n, generator=torch.Generator().manual_seed(0)) * 0.1
    return Batch(waves=waves, lengths=torch.full((len(texts),), n), keys=[f"k{i}" for i in range(len(texts))],
                 texts=texts, durations_s=torch.full((len(texts),), seconds, dtype=torch.float64),
                 sample_rate_hz=rate, epoch=0, step=0)


def test_collectives_in_one_process_return_the_values_and_never_touch_torch_distributed():
    comm = Collectives(World(), CPU)
    assert not comm.on and not torch.distributed.is_initialized()
    assert comm.sum([1.5, 2.0, -3.0]) == [1.5, 2.0, -3.0]
    assert comm.max([0.0, 7.25]) == [0.0, 7.25]
    comm.barrier()  # no process group: a no-op, not an error


def test_to_device_encodes_targets_and_turns_an_empty_batch_into_a_silent_dummy():
    tok = CharVocab(list(" abc"))
    waves, lengths, targets, target_lengths = to_device(batch(["ab", "cab c"]), CPU, tok)
    assert waves.shape == (2, 8000) and lengths.tolist() == [8000, 8000]
    assert target_lengths.tolist() == [2, 5] and targets.tolist() == [2, 3, 4, 2, 3, 1, 4]
    empty = batch([])
    waves, lengths, targets, target_lengths = to_device(empty, CPU, tok)
    assert waves.shape == (1, 8000) and float(waves.abs().sum()) == 0.0  # half a second of silence
    assert lengths.tolist() == [8000] and targets.numel() == 0 and target_lengths.tolist() == [0]


def test_int16_batches_arrive_as_float_in_range():
    b = batch(["a"])
    b.waves = (b.waves * 32767).to(torch.int16)
    waves, *_ = to_device(b, CPU, CharVocab(list("a")))
    assert waves.dtype == torch.float32 and float(waves.abs().max()) <= 1.0


def test_augmenters_build_one_chain_per_rate_and_reuse_it():
    cfg = load_pipeline("tiny_cpu")
    aug = Augmenters(cfg, CPU)
    for rate in (16000, 8000, 16000):
        b = batch(["a"], rate=rate)
        feats, feat_lengths = aug(b.waves, b.lengths, rate, torch.Generator().manual_seed(1), train=False)
        # half a second at either rate: the same frames of n_mels log-mels (each rate has its own mel filters)
        assert feats.shape == (1, int(feat_lengths[0]), cfg.features.n_mels) and int(feat_lengths[0]) > 40
    assert sorted(aug._by_rate) == [8000, 16000]


def test_autocast_is_a_no_op_in_fp32_and_bf16_autocast_otherwise():
    cfg = load_pipeline("tiny_cpu").train
    assert isinstance(autocast(cfg, CPU), contextlib.nullcontext)
    with autocast(dataclasses.replace(cfg, precision="bf16"), CPU):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
