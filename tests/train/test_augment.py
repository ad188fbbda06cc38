"""Device augmentation: exact lengths, zero padding, determinism, SNR, identities, torchaudio parity, NoiseBank.
CPU only except the CUDA parity test (skipped visibly without CUDA). (Features and SpecAugment: test_features.py.)"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torchaudio

from shardtrain.train.augment import AugmentConfig, DeviceAugment, GainConfig, NoiseBank, NoiseConfig, ReverbConfig, SpeedConfig, add_noise, apply_gain, resample, resampled_lengths, reverb, speed_perturb, synthetic_rirs
from conftest import WAVE_LENGTHS as LENGTHS, assert_padding_zero as _assert_padding_zero, seeded as _gen
from conftest import wave_batch as _batch
from shardtrain.train.features import FeatureConfig, SpecAugmentConfig, valid_mask

RATE = 16000


# ---- speed perturbation and resampling -----------------------------------------------------------------------
@pytest.mark.parametrize("factor", [0.9, 1.1, 0.8, 1.2, 0.95])
def test_speed_lengths_and_values_match_single_utterance_resample(factor):
    waves, lens = _batch(LENGTHS)
    out, new_lens = speed_perturb(waves, lens, [factor] * len(LENGTHS), sample_rate_hz=RATE)
    orig = round(factor * RATE)
    for i, n in enumerate(LENGTHS):
        alone = torchaudio.functional.resample(waves[i : i + 1, :n], orig, RATE)[0]
        assert int(new_lens[i]) == alone.shape[0]
        torch.testing.assert_close(out[i, : alone.shape[0]], alone, atol=2e-5, rtol=1e-4)
    assert out.shape[1] == int(new_lens.max())
    _assert_padding_zero(out, new_lens)


def test_resampled_lengths_formula_matches_torchaudio_over_many_lengths():
    lens = torch.arange(1, 3000, 37)
    for orig, new in [(14400, 16000), (17600, 16000), (44100, 16000), (8000, 16000), (15200, 16000)]:
        expected = [torchaudio.functional.resample(torch.zeros(1, int(n)), orig, new).shape[-1] for n in lens]
        assert resampled_lengths(lens, orig, new).tolist() == expected


def test_mixed_factors_grouped_in_one_batch():
    waves, lens = _batch(LENGTHS)
    factors = [0.9, 1.0, 1.1, 0.9, 1.1]
    out, new_lens = speed_perturb(waves, lens, factors, sample_rate_hz=RATE)
    for i, (n, f) in enumerate(zip(LENGTHS, factors)):
        alone, alone_len = speed_perturb(waves[i : i + 1, :n], lens[i : i + 1], [f], sample_rate_hz=RATE)
        assert int(new_lens[i]) == int(alone_len[0])
        torch.testing.assert_close(out[i, : int(alone_len[0])], alone[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out[1, :LENGTHS[1]], waves[1, :LENGTHS[1]])  # factor 1.0 row untouched
    _assert_padding_zero(out, new_lens)


def test_speed_factor_one_is_identity_and_resample_changes_rate():
    waves, lens = _batch(LENGTHS)
    out, new_lens = speed_perturb(waves, lens, [1.0] * 5, sample_rate_hz=RATE)
    assert out is waves and torch.equal(new_lens, lens)
    down, down_lens = resample(waves, lens, RATE, 8000)
    assert down_lens.tolist() == [(n + 1) // 2 for n in LENGTHS]
    _assert_padding_zero(down, down_lens)


# ---- noise, gain, reverb -------------------------------------------------------------------------------------

def test_add_noise_hits_drawn_snr_and_keeps_padding_zero():
    waves, lens = _batch(LENGTHS)
    bank = NoiseBank.coloured(clip_seconds=2.0, seed=3)
    noise = bank.windows(len(LENGTHS), waves.shape[1], _gen(1))
    snr = torch.tensor([5.0, 12.5, 20.0, 30.0, 0.0])
    mixed = add_noise(waves, lens, noise, snr)
    _assert_padding_zero(mixed, lens)
    for i, n in enumerate(LENGTHS):
        added = mixed[i, :n] - waves[i, :n]
        measured = 10 * math.log10(float(waves[i, :n].pow(2).sum() / added.pow(2).sum()))
        assert abs(measured - float(snr[i])) < 0.5, (i, measured)


def test_gain_scales_by_db():
    waves, lens = _batch(LENGTHS)
    out = apply_gain(waves, torch.tensor([6.0, -6.0, 0.0, 20.0, -20.0]))
    ratios = out[:, :401].abs().sum(1) / waves[:, :401].abs().sum(1)
    torch.testing.assert_close(ratios, torch.tensor([10 ** 0.3, 10 ** -0.3, 1.0, 10.0, 0.1]))
    assert torch.equal(out[2], waves[2])
    _assert_padding_zero(out, lens)


def test_reverb_compensates_direct_path_delay():
    waves, lens = _batch(LENGTHS)
    delayed = torch.zeros(len(LENGTHS), 800)
    delayed[torch.arange(5), torch.tensor([0, 17, 80, 399, 799])] = 0.5  # pure delays: output must equal input
    torch.testing.assert_close(reverb(waves, lens, delayed), waves, atol=1e-5, rtol=1e-4)
    rirs = synthetic_rirs(5, rt60_s=(0.3, 0.6), drr_db=(0.0, 5.0), max_seconds=1.0, sample_rate_hz=RATE,
                          generator=_gen(0), device=torch.device("cpu"))
    wet = reverb(waves, lens, rirs)
    _assert_padding_zero(wet, lens)
    white = torch.randn(waves.shape, generator=_gen(2)) * valid_mask(lens, waves.shape[1])  # no periodic peaks
    wet_white = reverb(white, lens, rirs)
    for i, n in enumerate(LENGTHS[:3]):  # still aligned: correlation with the dry signal peaks at lag 0
        x, y = white[i, :n], wet_white[i, :n]
        lags = range(-40, 41)
        corr = [float((x[max(0, -k): n - max(0, k)] * y[max(0, k): n - max(0, -k)]).sum()) for k in lags]
        assert list(lags)[max(range(len(corr)), key=corr.__getitem__)] == 0
        torch.testing.assert_close(y.pow(2).sum(), x.pow(2).sum(), rtol=1e-3, atol=1e-6)  # energy kept


def test_synthetic_rir_peak_is_direct_path():
    rirs = synthetic_rirs(64, rt60_s=(0.2, 0.8), drr_db=(0.0, 10.0), max_seconds=1.0, sample_rate_hz=RATE,
                          generator=_gen(5), device=torch.device("cpu"))
    assert rirs.shape == (64, int(0.8 * RATE))
    assert int(rirs.abs().argmax(1).max()) <= 80  # peak within the 5 ms pre-delay
    torch.testing.assert_close(rirs.norm(dim=1), torch.ones(64))


# ---- the chain -----------------------------------------------------------------------------------------------

FULL = AugmentConfig(speed=SpeedConfig(p=1.0), reverb=ReverbConfig(p=0.5), noise=NoiseConfig(p=0.8),
                     gain=GainConfig(p=0.8), spec_augment=SpecAugmentConfig(p=1.0))


def test_chain_lengths_equal_per_utterance_computation_and_padding_zero():
    waves, lens = _batch(LENGTHS)
    chain = DeviceAugment(FULL, FeatureConfig(), RATE)
    out, new_lens = chain.augment_waves(waves, lens, _gen(7))
    # recompute the factors the chain drew (first draw of the same generator) and the lengths utterance by utterance
    u = torch.rand((5, 2), generator=_gen(7))
    factors = torch.tensor(FULL.speed.factors, dtype=torch.float64)[(u[:, 1] * 3).long()]
    for i, n in enumerate(LENGTHS):
        alone = torchaudio.functional.resample(torch.zeros(1, n), round(float(factors[i]) * RATE), RATE)
        assert int(new_lens[i]) == alone.shape[-1]
    _assert_padding_zero(out, new_lens)
    feats, feat_lens = chain(waves, lens, _gen(7))
    assert torch.equal(feat_lens, 1 + new_lens // 160)
    assert feats.shape == (5, int(feat_lens.max()), 80) and feats.dtype == torch.float32
    _assert_padding_zero(feats.abs().sum(2), feat_lens)


def test_empty_chain_is_identity_and_eval_skips_augmentation():
    waves, lens = _batch(LENGTHS)
    chain = DeviceAugment(AugmentConfig.disabled(), FeatureConfig(), RATE)
    out, new_lens = chain.augment_waves(waves, lens, _gen(0))
    assert torch.equal(out, waves) and torch.equal(new_lens, lens)
    full = DeviceAugment(FULL, FeatureConfig(), RATE)
    a, al = chain(waves, lens, _gen(0))
    for gen, train in [(None, True), (_gen(0), False)]:
        b, bl = full(waves, lens, gen, train=train)
        assert torch.equal(a, b) and torch.equal(al, bl)


def test_same_generator_state_same_output_and_seeds_differ():
    waves, lens = _batch(LENGTHS)
    chain = DeviceAugment(FULL, FeatureConfig(), RATE)
    a, al = chain(waves, lens, _gen(11))
    b, bl = chain(waves, lens, _gen(11))
    assert torch.equal(a, b) and torch.equal(al, bl)
    g = _gen(11)
    g.set_state(_gen(11).get_state())
    c, _ = chain(waves, lens, g)
    assert torch.equal(a, c)
    d, dl = chain(waves, lens, _gen(12))
    assert not (torch.equal(al, dl) and torch.equal(a, d))


def test_empty_batch():
    chain = DeviceAugment(FULL, FeatureConfig(), RATE)
    feats, feat_lens = chain(torch.zeros(0, 0), torch.zeros(0, dtype=torch.long), _gen(0))
    assert feats.shape == (0, 1, 80) and feat_lens.shape == (0,)


def test_input_rate_is_resampled_to_model_rate():
    waves, lens = _batch([8000, 4000])
    chain = DeviceAugment(AugmentConfig.disabled(), FeatureConfig(), 8000)
    feats, feat_lens = chain(waves, lens, None)
    assert feat_lens.tolist() == [1 + 16000 // 160, 1 + 8000 // 160]


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="augment.noise.snr_db"):
        NoiseConfig(snr_db=(30.0, 5.0))
    with pytest.raises(ValueError, match="augment.speed.p"):
        SpeedConfig(p=1.5)
    with pytest.raises(ValueError, match="features.global_mean"):
        FeatureConfig(normalize="global")
    with pytest.raises(ValueError, match="features.sample_rate_hz"):
        DeviceAugment(FULL, FeatureConfig(), RATE, noise_bank=NoiseBank.coloured(clip_seconds=1, sample_rate_hz=8000))


# ---- NoiseBank -------------------------------------------------------------------------------------------------

def test_coloured_bank_shape_determinism_and_colour():
    a = NoiseBank.coloured(clip_seconds=1.0, seed=4)
    b = NoiseBank.coloured(clip_seconds=1.0, seed=4)
    c = NoiseBank.coloured(clip_seconds=1.0, seed=5)
    assert a.waves.shape == (3, RATE) and a.names == ["white", "pink", "brown"] and a.seconds == 3.0
    assert torch.equal(a.waves, b.waves) and not torch.equal(a.waves, c.waves)
    torch.testing.assert_close(a.waves.pow(2).mean(1), torch.ones(3), rtol=1e-4, atol=1e-4)
    power = torch.fft.rfft(a.waves).abs().pow(2)
    low_share = power[:, 1:400].sum(1) / power.sum(1)  # share of power below 400 Hz
    assert low_share[0] < low_share[1] < low_share[2]
    w1 = a.windows(4, 5000, _gen(1))
    assert w1.shape == (4, 5000) and torch.equal(w1, a.windows(4, 5000, _gen(1)))
    assert a.windows(2, 50000, _gen(1)).shape == (2, 50000)  # longer than the bank: wraps around


def test_noise_bank_from_packed_dataset(tmp_path):
    import soundfile

    from shardtrain.pack.packer import PackConfig, pack

    src = tmp_path / "noise"
    src.mkdir()
    for i, seconds in enumerate([0.5, 1.0, 2.0]):
        wave, _ = _batch([int(seconds * 8000)], seed=i)
        soundfile.write(src / f"n{i}.wav", wave[0].numpy(), 8000)
        (src / f"n{i}.txt").write_text("noise")
    pack(PackConfig(input=str(src), output=str(tmp_path / "ds"), progress=False))
    bank = NoiseBank.from_dataset(str(tmp_path / "ds"), max_seconds=2.5, sample_rate_hz=RATE)
    assert abs(bank.seconds - 2.5) < 1e-3 and bank.sample_rate_hz == RATE
    assert float(bank.waves.abs().max()) > 0.01
    chain = DeviceAugment(FULL, FeatureConfig(), RATE, noise_bank=bank)
    waves, lens = _batch(LENGTHS)
    out, new_lens = chain.augment_waves(waves, lens, _gen(0))
    _assert_padding_zero(out, new_lens)


# ---- CUDA ------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gen_device", ["cpu", "cuda"])
def test_cpu_and_cuda_agree(gen_device):
    waves, lens = _batch(LENGTHS)
    cfg = dataclasses.replace(FULL, spec_augment=SpecAugmentConfig(p=0.0))
    cpu = DeviceAugment(cfg, FeatureConfig(), RATE)
    gpu = DeviceAugment(cfg, FeatureConfig(), RATE).to("cuda")
    if gen_device == "cpu":  # a CPU generator draws the same numbers for both devices
        a, al = cpu(waves, lens, _gen(3))
        b, bl = gpu(waves.cuda(), lens.cuda(), _gen(3))
        assert torch.equal(al, bl.cpu())
        torch.testing.assert_close(b.cpu(), a, atol=2e-2, rtol=1e-3)
    else:  # a CUDA generator: its own stream of numbers, but the same invariants and determinism
        g1 = torch.Generator(device="cuda").manual_seed(3)
        g2 = torch.Generator(device="cuda").manual_seed(3)
        b, bl = gpu(waves.cuda(), lens.cuda(), g1)
        c, cl = gpu(waves.cuda(), lens.cuda(), g2)
        assert torch.equal(b, c) and torch.equal(bl, cl)
        _assert_padding_zero(b.abs().sum(2), bl)


def test_augment_demo_writes_audible_and_visible_examples(tmp_path, capsys):
    import numpy as np
    import soundfile

    from shardtrain.cli import main

    assert main(["augment-demo", "--tone", "--n", "2", "--duration-s", "1.5", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2
    for i in range(2):
        orig, rate = soundfile.read(tmp_path / f"{i:02d}_tone{i}_orig.wav")
        aug, rate2 = soundfile.read(tmp_path / f"{i:02d}_tone{i}_aug.wav")
        assert rate == rate2 == 16000 and len(orig) > 0 and len(aug) > 0
        assert len(orig) != len(aug) or not np.allclose(orig, aug)  # p=1.0: every op ran, so the audio changed
        assert (tmp_path / f"{i:02d}_tone{i}.png").stat().st_size > 10_000
