"""train/features.py: log-mel features equal torchaudio's on single utterances, utterance and global
normalisation over true frames only, SpecAugment masks inside true lengths and within their fractions."""
from __future__ import annotations

import dataclasses

import torch
import torchaudio

from conftest import WAVE_LENGTHS as LENGTHS, assert_padding_zero as _assert_padding_zero, seeded as _gen
from conftest import wave_batch as _batch
from shardtrain.train.features import FeatureConfig, SpecAugmentConfig, log_mel, normalize, spec_augment, valid_mask

RATE = 16000


def test_log_mel_matches_torchaudio_on_single_utterances():
    cfg = FeatureConfig(normalize="none")
    waves, lens = _batch(LENGTHS)
    feats, feat_lens = log_mel(cfg.mel_module(), waves, lens, cfg)
    ref_mel = torchaudio.transforms.MelSpectrogram(sample_rate=RATE, n_fft=512, win_length=400, hop_length=160,
                                                   n_mels=80)
    for i, n in enumerate(LENGTHS):
        ref = ref_mel(waves[i, :n]).clamp_min(1e-10).log().T
        assert int(feat_lens[i]) == ref.shape[0] == cfg.feature_lengths(torch.tensor(n))
        torch.testing.assert_close(feats[i, : ref.shape[0]], ref, atol=1e-4, rtol=1e-5)
    _assert_padding_zero(feats.abs().sum(2), feat_lens)


def test_utterance_normalisation_zero_mean_unit_var_over_true_frames():
    cfg = FeatureConfig()
    waves, lens = _batch(LENGTHS)
    feats, feat_lens = log_mel(cfg.mel_module(), waves, lens, cfg)
    normed = normalize(feats, feat_lens, cfg)
    for i in range(len(LENGTHS)):
        x = normed[i, : int(feat_lens[i])]
        torch.testing.assert_close(x.mean(0), torch.zeros(80), atol=1e-4, rtol=0)
        torch.testing.assert_close(x.std(0, unbiased=False), torch.ones(80), atol=1e-3, rtol=0)
    _assert_padding_zero(normed.abs().sum(2), feat_lens)
    glob = FeatureConfig(normalize="global", global_mean=(-5.0,), global_std=(2.0,))
    torch.testing.assert_close(normalize(feats, feat_lens, glob), (feats + 5) / 2 * valid_mask(feat_lens, feats.shape[1])[:, :, None])


def test_spec_augment_masks_stay_inside_true_lengths_and_fractions():
    cfg = SpecAugmentConfig(p=1.0, n_time_masks=2, max_time_frames=100, max_time_fraction=0.05, n_freq_masks=2,
                            max_freq_bins=27)
    lens = torch.tensor([1000, 700, 301, 40, 1])
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(5, 1000, 80, generator=g) * valid_mask(lens, 1000)[:, :, None] + 3.0 * valid_mask(lens, 1000)[:, :, None]
    any_time = False
    for seed in range(20):
        out = spec_augment(feats, lens, cfg, _gen(seed))
        changed = out != feats
        _assert_padding_zero(out.abs().sum(2), lens)
        full_rows = changed.all(2)  # frames masked across every bin = time masks
        for i, n in enumerate(lens.tolist()):
            assert not changed[i, n:].any()
            masked_frames = int(full_rows[i, :n].sum())
            assert masked_frames <= 2 * min(100, int(0.05 * n))
            any_time |= masked_frames > 0
        masked_bins = changed.all(1)[lens > 100]  # bins masked in every frame = frequency masks
        assert int(masked_bins.sum(1).max()) <= 2 * 27
    assert any_time
    assert torch.equal(spec_augment(feats, lens, dataclasses.replace(cfg, p=0.0), _gen(0)), feats)


def test_spec_augment_never_masks_every_bin_or_frame_of_an_utterance():
    """Two frequency masks of up to 27 bins over 40 mels (or time masks of half the frames each) could cover the
    whole utterance, every cell then its fill value: widths are capped so one bin and one frame always remain."""
    lens = torch.tensor([300, 120, 37, 2])
    feats = torch.randn(4, 300, 40, generator=_gen(1)) * valid_mask(lens, 300)[:, :, None]
    for cfg in (SpecAugmentConfig(p=1.0), SpecAugmentConfig(p=1.0, n_time_masks=2, max_time_fraction=0.5)):
        for seed in range(300):
            changed = spec_augment(feats, lens, cfg, _gen(seed)) != feats
            for i, n in enumerate(lens.tolist()):
                assert not changed[i, :n].all(0).all(), (cfg, seed, i)  # some bin of some frame kept
                assert int(changed[i, :n].all(0).sum()) < 40 and int(changed[i, :n].all(1).sum()) < n
