"""train/showcase.py (`shardtrain augment-demo`): the WAVs and PNGs it writes, read back: the original is the input,
the augmented one has the length the chain gave it, the disabled chain changes nothing, the PNG is a real image."""
from __future__ import annotations

import numpy as np
import soundfile as sf
import torch

from shardtrain.testing.corpus import synth_wave
from shardtrain.train.augment import AugmentConfig, SpeedConfig
from shardtrain.train.showcase import write_examples


def batch():
    a, b = synth_wave(1.0, seed=1), synth_wave(0.6, seed=2)
    waves = torch.zeros(2, len(a))
    waves[0, :len(a)], waves[1, :len(b)] = torch.from_numpy(a), torch.from_numpy(b)
    return waves, torch.tensor([len(a), len(b)])


def test_written_files_match_the_chain(tmp_path):
    waves, lengths = batch()
    aug = AugmentConfig(speed=SpeedConfig(p=1.0, factors=(1.25,)))  # every utterance 1.25x faster: 4/5 the samples
    got = write_examples(waves, lengths, ["a", "b"], aug, str(tmp_path), seed=3)
    assert [g["samples_in"] for g in got] == [16000, 9600]
    assert [g["samples_out"] for g in got] == [12800, 7680]
    for g, n in zip(got, (16000, 9600)):
        orig, rate = sf.read(g["orig"], dtype="float32")
        assert rate == 16000 and len(orig) == n
        assert np.abs(orig - waves[got.index(g), :n].numpy()).max() <= 1 / 32768 + 1e-6  # PCM_16 of the input
        assert len(sf.read(g["aug"])[0]) == g["samples_out"]
        assert open(g["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00_a.png", "00_a_aug.wav", "00_a_orig.wav", "01_b.png",
                                                          "01_b_aug.wav", "01_b_orig.wav"]


def test_disabled_chain_writes_the_input_back(tmp_path):
    waves, lengths = batch()
    (g,) = write_examples(waves[:1], lengths[:1], ["x"], AugmentConfig.disabled(), str(tmp_path), seed=0)
    assert g["samples_out"] == g["samples_in"] == 16000 and not g["peak_normalised"]
    np.testing.assert_array_equal(sf.read(g["aug"], dtype="int16")[0], sf.read(g["orig"], dtype="int16")[0])
