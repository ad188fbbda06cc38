"""Augmentation on the device: a batched, length-aware, reproducible chain from padded waves to features.

    Batch.waves [B, T] float32 (zero-padded, at input_rate_hz) + lengths [B] int64, torch.Generator
      -> speed_perturb (+ resample to the model rate, fused: one resample call per speed factor)  [B, T'], lengths'
      -> reverb        (FFT convolution with a RIR, direct-path delay compensated, cut to the length)
      -> add_noise     (noise window from a NoiseBank at an SNR drawn per utterance, only inside true lengths)
      -> apply_gain
      -> log_mel -> normalize -> spec_augment  (shardtrain.features)    -> feats [B, frames, n_mels], feat_lengths

Order: reverberation comes before noise so the noise (already a room recording) is not reverberated again and
the drawn SNR is the SNR of what the model hears; gain is last so it scales speech and noise together.

Invariants (tests check each): every op keeps lengths exact (speed perturbation gives each utterance the length
torchaudio's `resample` gives it alone); padding is zero after every op; a disabled op, speed factor 1.0 and an
empty chain return the input unchanged; the same generator state gives the same output.

Randomness: only from the `torch.Generator` passed in (the trainer seeds it from seed, epoch, step and rank, so a
resumed run augments exactly like an uninterrupted one). Every draw is a small per-utterance vector (plus the
synthetic RIR tails), made on the generator's device and moved to the waves' device. Both a CPU generator and a
generator on the batch's CUDA device work. A CPU generator is the cheaper choice on CUDA: grouping utterances by
speed factor needs the factor choices on the host, which with a CUDA generator costs one device->host sync per
batch; it also gives bit-identical draws on CPU and CUDA. Other sync point: one `.max()` of the new lengths after
speed perturbation, to trim the batch width.

Where Python loops remain: one iteration per distinct speed factor (<= len(factors)), and the one-off loading
of a NoiseBank from a dataset. Nothing loops over utterances.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torchaudio

from shardtrain.train.features import FeatureConfig, SpecAugmentConfig, draw_uniform, log_mel, normalize, spec_augment, valid_mask

log = logging.getLogger(__name__)


def _check_p(p: float, name: str) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"augment.{name}.p must be in [0, 1], got {p}")


def _check_range(r: tuple[float, float], name: str) -> None:
    if len(r) != 2 or r[0] > r[1]:
        raise ValueError(f"augment.{name} must be (low, high) with low <= high, got {r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeedConfig:
    p: float = 1.0
    """Probability that an utterance draws a factor at all (otherwise 1.0)."""
    factors: tuple[float, ...] = (0.9, 1.0, 1.1)
    """Speed factors, drawn uniformly per utterance (> 1 is faster and shorter), as Kaldi's 3-way perturbation."""

    def __post_init__(self) -> None:
        _check_p(self.p, "speed")
        if not self.factors or min(self.factors) <= 0:
            raise ValueError("augment.speed.factors must be a non-empty tuple of positive factors")


@dataclass(frozen=True, kw_only=True, slots=True)
class NoiseConfig:
    p: float = 0.5
    """Probability that an utterance gets additive noise."""
    snr_db: tuple[float, float] = (5.0, 30.0)
    """SNR range in dB, drawn uniformly per utterance; measured over the utterance's true length."""
    noise_url: str | None = None
    """Noise dataset packed by `shardtrain pack`; None = generated coloured noise (white, pink, brown)."""
    bank_seconds: float = 600.0
    """Cap on the noise kept on the device (600 s at 16 kHz = 38 MB of float32)."""
    seed: int = 0
    """Seed of the coloured noise bank and of the clip choice from `noise_url` (not of the per-batch draws)."""

    def __post_init__(self) -> None:
        _check_p(self.p, "noise")
        _check_range(self.snr_db, "noise.snr_db")
        if self.bank_seconds <= 0:
            raise ValueError("augment.noise.bank_seconds must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class GainConfig:
    p: float = 0.5
    """Probability that an utterance gets a gain."""
    gain_db: tuple[float, float] = (-6.0, 6.0)
    """Gain range in dB, drawn uniformly per utterance. No clipping: features do not need [-1, 1]."""

    def __post_init__(self) -> None:
        _check_p(self.p, "gain")
        _check_range(self.gain_db, "gain.gain_db")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReverbConfig:
    p: float = 0.2
    """Probability that an utterance is reverberated."""
    rir_url: str | None = None
    """RIR dataset packed by `shardtrain pack`; None = a synthetic RIR per utterance drawn from the generator."""
    rt60_s: tuple[float, float] = (0.2, 0.8)
    """Synthetic RIRs: reverberation time (60 dB decay) range in seconds."""
    drr_db: tuple[float, float] = (0.0, 10.0)
    """Synthetic RIRs: direct-to-reverberant energy ratio range in dB."""
    max_rir_seconds: float = 1.0
    """RIRs (synthetic or from `rir_url`) are cut to this length."""
    bank_seconds: float = 300.0
    """Cap on the RIR audio kept on the device when `rir_url` is set."""

    def __post_init__(self) -> None:
        _check_p(self.p, "reverb")
        _check_range(self.rt60_s, "reverb.rt60_s")
        _check_range(self.drr_db, "reverb.drr_db")
        if self.rt60_s[0] <= 0 or self.max_rir_seconds <= 0:
            raise ValueError("augment.reverb.rt60_s and augment.reverb.max_rir_seconds must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class AugmentConfig:
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    """Speed perturbation."""
    reverb: ReverbConfig = field(default_factory=ReverbConfig)
    """Reverberation by RIR convolution."""
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    """Additive noise at a random SNR."""
    gain: GainConfig = field(default_factory=GainConfig)
    """Random gain."""
    spec_augment: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)
    """Time and frequency masks on the features."""

    @classmethod
    def disabled(cls) -> "AugmentConfig":
        """Every op off: the chain only resamples and computes features."""
        return cls(speed=SpeedConfig(p=0.0), reverb=ReverbConfig(p=0.0), noise=NoiseConfig(p=0.0),
                   gain=GainConfig(p=0.0), spec_augment=SpecAugmentConfig(p=0.0))


# ---- wave ops: each takes its per-utterance parameters (or a generator) explicitly ---------------------------

def _ratio(factor: float, input_rate_hz: int, output_rate_hz: int) -> tuple[int, int]:
    """Integer (orig, new) rates, reduced, for speed `factor` plus a rate change, as torchaudio's Speed does
    (orig = factor * input rate; torchaudio truncates with int(), we round, which differs only for factors whose
    product with the rate is not an integer)."""
    orig, new = int(round(factor * input_rate_hz)), int(output_rate_hz)
    g = math.gcd(orig, new)
    return orig // g, new // g


def resampled_lengths(lengths: torch.Tensor, orig_hz: int, new_hz: int) -> torch.Tensor:
    """Length torchaudio.functional.resample gives each utterance alone: ceil(float32(new * len / orig)),
    with orig/new reduced by their gcd (torchaudio rounds the quotient through float32, and so do we)."""
    g = math.gcd(int(orig_hz), int(new_hz))
    orig, new = int(orig_hz) // g, int(new_hz) // g
    if orig == new:
        return lengths.clone()
    return torch.ceil((lengths.double() * new / orig).float()).long()


def speed_perturb(waves: torch.Tensor, lengths: torch.Tensor, factors_per_utt: Sequence[float] | torch.Tensor, *,
                  sample_rate_hz: int, target_rate_hz: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speed-perturb each utterance by its factor and resample to `target_rate_hz` (default: unchanged), batched:
    utterances sharing a factor go through one `torchaudio.functional.resample` call (orig = factor * rate,
    new = target rate). Each row's first new-length samples equal resampling that utterance alone (padding is
    zero, so the batch's extra zeros change nothing); the filter tail past it is zeroed. All factors 1.0 at an
    unchanged rate returns the input itself. Cost: one resample per distinct factor; one sync (`max` of lengths).
    """
    target = sample_rate_hz if target_rate_hz is None else target_rate_hz
    factors = torch.as_tensor(factors_per_utt, dtype=torch.float64).cpu()
    lengths = lengths.to(device=waves.device, dtype=torch.long)
    bsz, width = waves.shape
    distinct = sorted(set(factors.tolist()))
    if bsz == 0 or (distinct == [1.0] and target == sample_rate_hz):
        return waves, lengths
    groups = []
    for f in distinct:  # loop over distinct factors, not utterances
        idx = (factors == f).nonzero().squeeze(1).to(waves.device)
        orig, new = _ratio(f, sample_rate_hz, target)
        sub = waves if len(distinct) == 1 else waves.index_select(0, idx)
        out = sub if orig == new else torchaudio.functional.resample(sub, orig, new)
        groups.append((idx, out, resampled_lengths(lengths.index_select(0, idx), orig, new)))
    new_lengths = torch.empty_like(lengths)
    for idx, _, glen in groups:
        new_lengths[idx] = glen
    keep = int(new_lengths.max())  # sync point: trims the padding the longest factor would otherwise add
    if len(groups) == 1:
        result = groups[0][1][:, :keep].clone() if groups[0][1] is waves else groups[0][1][:, :keep]
    else:
        result = waves.new_empty(bsz, keep)
        for idx, out, _ in groups:
            w = min(keep, out.shape[1])
            result[idx, :w] = out[:, :w]
            if w < keep:
                result[idx, w:] = 0.0
    return result.masked_fill_(~valid_mask(new_lengths, keep), 0.0), new_lengths


def resample(waves: torch.Tensor, lengths: torch.Tensor, orig_hz: int,
             new_hz: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rate conversion of a padded batch (speed factor 1.0 for all); identity when the rates match."""
    return speed_perturb(waves, lengths, [1.0] * waves.shape[0], sample_rate_hz=orig_hz, target_rate_hz=new_hz)


def add_noise(waves: torch.Tensor, lengths: torch.Tensor, noise: torch.Tensor,
              snr_db: torch.Tensor) -> torch.Tensor:
    """Add `noise` [B, T] scaled so that, over each utterance's true length, signal power / noise power equals
    10^(snr_db/10); noise past the length is dropped. snr_db = +inf (or a silent utterance) adds nothing."""
    valid = valid_mask(lengths.to(waves.device), waves.shape[1])
    noise = noise[:, : waves.shape[1]] * valid
    p_sig = (waves * waves).sum(1)
    p_noise = (noise * noise).sum(1).clamp_min(1e-20)  # both over the same length: the 1/len cancels
    scale = torch.sqrt(p_sig / (p_noise * torch.pow(10.0, snr_db.to(waves.device, waves.dtype) / 10.0)))
    return waves + scale[:, None] * noise


def apply_gain(waves: torch.Tensor, gain_db: torch.Tensor) -> torch.Tensor:
    """Multiply each utterance by 10^(gain_db/20); zero padding stays zero."""
    return waves * torch.pow(10.0, gain_db.to(waves.device, waves.dtype) / 20.0)[:, None]


def reverb(waves: torch.Tensor, lengths: torch.Tensor, rirs: torch.Tensor) -> torch.Tensor:
    """Convolve each utterance with its RIR [B, R] by FFT, shifted left by the RIR's peak index (the direct path)
    so words stay where the transcript's alignment expects them, cut back to the utterance's length and
    rescaled to the dry signal's energy (reverb is not a gain). Batched: one rfft/irfft of size >= T + R - 1.
    The shift costs nothing extra: each RIR is placed in the FFT buffer rotated left by its peak (taps before
    the peak wrap to the end), so the circular convolution's first T samples are y[t + peak] (no wrap-around
    reaches them because the buffer holds T + R - 1 samples). Cost: O(B (T + R) log(T + R)).
    """
    bsz, width = waves.shape
    if bsz == 0:
        return waves
    rirs = rirs.to(waves.device, waves.dtype)
    taps = rirs.shape[1]
    n_fft = 1 << (width + taps - 2).bit_length()
    peak = rirs.abs().argmax(1)
    pos = (torch.arange(taps, device=waves.device)[None, :] - peak[:, None]) % n_fft
    rotated = waves.new_zeros(bsz, n_fft).scatter_(1, pos, rirs)
    spec = torch.fft.rfft(waves, n=n_fft) * torch.fft.rfft(rotated)
    wet = torch.fft.irfft(spec, n=n_fft)[:, :width] * valid_mask(lengths.to(waves.device), width)
    gain = torch.sqrt((waves * waves).sum(1) / (wet * wet).sum(1).clamp_min(1e-20))
    return wet * gain[:, None]


def synthetic_rirs(n: int, *, rt60_s: tuple[float, float], drr_db: tuple[float, float], max_seconds: float,
                   sample_rate_hz: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """[n, R] exponentially decaying noise RIRs: a direct-path impulse after a 0-5 ms pre-delay, then a Gaussian
    tail decaying 60 dB in rt60 (drawn per RIR), scaled to the drawn direct-to-reverberant ratio; unit energy.
    R = min(max rt60, max_seconds) in samples."""
    length = max(2, int(min(rt60_s[1], max_seconds) * sample_rate_hz))
    u = draw_uniform(generator, (n, 3), device)
    rt60 = rt60_s[0] + u[:, 0] * (rt60_s[1] - rt60_s[0])
    drr = drr_db[0] + u[:, 1] * (drr_db[1] - drr_db[0])
    delay = (u[:, 2] * min(0.005 * sample_rate_hz, length - 2)).long()
    tail = torch.randn((n, length), generator=generator, device=generator.device).to(device)
    t = torch.arange(length, device=device)[None, :] - delay[:, None]
    tail = torch.where(t > 0, tail * torch.exp(-6.9078 * t.clamp(min=0) / (rt60[:, None] * sample_rate_hz)), 0.0)
    tail = tail * torch.sqrt(torch.pow(10.0, -drr / 10.0) / (tail * tail).sum(1).clamp_min(1e-20))[:, None]
    rir = tail.scatter(1, delay[:, None], torch.ones(n, 1, device=device))
    return rir / rir.norm(dim=1, keepdim=True)


# ---- banks ---------------------------------------------------------------------------------------------------

class NoiseBank:
    """A bounded set of noise (or RIR) clips held on one device: `waves` [N, Lmax] zero-padded + `lengths` [N].

    Noise is drawn as random windows of the clips' concatenation (wrapping around, so a window may join two
    clips); RIRs are drawn as whole clips. Size is capped at construction (`max_seconds`), so memory is known.
    """

    def __init__(self, clips: Sequence[torch.Tensor], sample_rate_hz: int, names: Sequence[str] | None = None):
        if not clips:
            raise ValueError("NoiseBank needs at least one clip")
        self.sample_rate_hz = int(sample_rate_hz)
        self.names = list(names) if names is not None else [f"clip{i}" for i in range(len(clips))]
        self.lengths = torch.tensor([c.shape[-1] for c in clips], dtype=torch.long, device=clips[0].device)
        self.waves = torch.nn.utils.rnn.pad_sequence([c.float() for c in clips], batch_first=True)
        self._total = int(self.lengths.sum())  # host copy: no sync when drawing windows
        self._ring: torch.Tensor | None = None  # concatenation + wrap-around extension, built on first use

    @property
    def device(self) -> torch.device:
        return self.waves.device

    @property
    def seconds(self) -> float:
        return float(self.lengths.sum()) / self.sample_rate_hz

    def to(self, device: torch.device | str) -> "NoiseBank":
        clips = [self.waves[i, : int(n)].to(device) for i, n in enumerate(self.lengths.tolist())]
        return NoiseBank(clips, self.sample_rate_hz, self.names)

    def windows(self, n: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """[n, length] noise windows at offsets drawn from `generator` (an unfold view gathered, no index matrix)."""
        total = self._total
        if self._ring is None or self._ring.shape[0] < total + length:  # rebuilt only when a longer batch comes
            flat = torch.cat([self.waves[i, : int(k)] for i, k in enumerate(self.lengths.tolist())])
            reps = -(-(total + length) // total)
            self._ring = flat.repeat(reps)[: total + length]
        offsets = (draw_uniform(generator, (n,), self.device) * total).long().clamp(max=total - 1)
        return self._ring.unfold(0, length, 1)[offsets]

    def clips(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """[n, Lmax] whole clips chosen uniformly (with replacement) by `generator`."""
        idx = (draw_uniform(generator, (n,), self.device) * len(self.names)).long().clamp(max=len(self.names) - 1)
        return self.waves[idx]

    @classmethod
    def coloured(cls, *, colours: Sequence[str] = ("white", "pink", "brown"), clip_seconds: float = 20.0,
                 sample_rate_hz: int = 16000, seed: int = 0, device: torch.device | str = "cpu") -> "NoiseBank":
        """Generated noise, one unit-RMS clip per colour: spectrum shaped as f^0 (white), f^-1/2 amplitude (pink,
        -3 dB/octave) or f^-1 (brown, -6 dB/octave). Deterministic for a seed; built on the CPU then moved."""
        slopes = {"white": 0.0, "pink": 0.5, "brown": 1.0}
        gen = torch.Generator().manual_seed(seed)
        n = int(clip_seconds * sample_rate_hz)
        clips = []
        for colour in colours:
            if colour not in slopes:
                raise ValueError(f"augment.noise colour must be one of {sorted(slopes)}, got {colour!r}")
            spec = torch.complex(torch.randn(n // 2 + 1, generator=gen), torch.randn(n // 2 + 1, generator=gen))
            freq = torch.arange(n // 2 + 1, dtype=torch.float32).clamp(min=1.0)
            spec = spec * freq.pow(-slopes[colour])
            spec[0] = 0
            clip = torch.fft.irfft(spec, n=n)
            clips.append((clip / clip.pow(2).mean().sqrt()).to(device))
        return cls(clips, sample_rate_hz, list(colours))

    @classmethod
    def from_dataset(cls, url: str, *, max_seconds: float, sample_rate_hz: int, storage_options: dict | None = None,
                     max_clip_seconds: float | None = None, seed: int | None = None,
                     max_clips: int | None = None) -> "NoiseBank":
        """Load clips of a dataset packed by `shardtrain pack` until `max_seconds`: index rows in order (or in a
        random order when `seed` is given), read and decoded by the loader's own path (load.reader.read_members:
        ranged reads by index offsets, the reader's checks against the index, its decoder, channels averaged),
        resampled to `sample_rate_hz`, cut to `max_clip_seconds`; at most `max_clips` clips (the augment demo
        reads its examples this way). A member the loader would skip is skipped here too, with a warning. Loops
        over clips once at start-up; reads 16 rows at a time (one ranged read per run of neighbours). The index is
        read once (by read_members): the row count comes from the manifest, which that read is checked against.
        The bank is built on the CPU, where the clips are decoded; `.to(device)` moves it (DeviceAugment does on
        first use), one copy of at most `max_seconds` of audio."""
        from shardtrain.format.manifest import open_dataset
        from shardtrain.load.reader import read_members

        ds = open_dataset(url, storage_options)
        n = sum(s.samples for s in ds.shards)  # the manifest's rows: read_members's index read must match them
        order = (torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy() if seed is not None
                 else np.arange(n))[:max_clips]
        budget = int(max_seconds * sample_rate_hz)
        clips, names = [], []
        members = read_members(ds, order)
        try:
            for m in members:
                if budget <= 0:
                    break
                if m.samples is None:
                    log.warning("noise bank: skipped %s of %s: %s", m.key, url, m.error)
                    continue
                clip = torch.from_numpy(m.samples)
                if m.sample_rate_hz != sample_rate_hz:
                    clip = torchaudio.functional.resample(clip, m.sample_rate_hz, sample_rate_hz)
                cap = budget if max_clip_seconds is None else min(budget, int(max_clip_seconds * sample_rate_hz))
                clip = clip[:cap]
                if clip.numel() == 0:
                    continue
                clips.append(clip)
                names.append(m.key)
                budget -= clip.numel()
        finally:
            members.close()
        if not clips:
            raise ValueError(f"no audio in {url}: the noise/RIR dataset is empty")
        log.info("noise bank: %d clips, %.1f s from %s", len(clips), sum(c.numel() for c in clips) / sample_rate_hz,
                 url)
        return cls(clips, sample_rate_hz, names)


# ---- the chain -----------------------------------------------------------------------------------------------

class DeviceAugment(torch.nn.Module):
    """The configured chain as a module: `forward(waves, lengths, generator, train)` -> (feats, feat_lengths).

    Move it with `.to(device)` (its mel filterbank and window are buffers; `forward` moves it on a device mismatch).
    Banks: `noise_bank` (default: `NoiseBank.coloured`, or `aug.noise.noise_url` when set) and `rir_bank`
    (default: `aug.reverb.rir_url` when set, else synthetic RIRs per utterance). Banks must be at the model rate
    (`feats.sample_rate_hz`) since noise and reverb apply after speed perturbation and resampling; they are
    moved to the batch's device on first use.
    """

    def __init__(self, aug: AugmentConfig, feats: FeatureConfig, input_rate_hz: int,
                 noise_bank: NoiseBank | None = None, rir_bank: NoiseBank | None = None,
                 storage_options: dict | None = None):
        super().__init__()
        self.aug, self.feats, self.input_rate_hz = aug, feats, int(input_rate_hz)
        self.mel = feats.mel_module()
        rate = feats.sample_rate_hz
        if noise_bank is None and aug.noise.p > 0:
            noise_bank = (NoiseBank.from_dataset(aug.noise.noise_url, max_seconds=aug.noise.bank_seconds,
                                                 sample_rate_hz=rate, storage_options=storage_options,
                                                 seed=aug.noise.seed)
                          if aug.noise.noise_url else
                          NoiseBank.coloured(clip_seconds=min(20.0, aug.noise.bank_seconds / 3), sample_rate_hz=rate,
                                             seed=aug.noise.seed))
        if rir_bank is None and aug.reverb.p > 0 and aug.reverb.rir_url:
            rir_bank = NoiseBank.from_dataset(aug.reverb.rir_url, max_seconds=aug.reverb.bank_seconds,
                                              sample_rate_hz=rate, storage_options=storage_options,
                                              max_clip_seconds=aug.reverb.max_rir_seconds)
        for name, bank in (("noise_bank", noise_bank), ("rir_bank", rir_bank)):
            if bank is not None and bank.sample_rate_hz != rate:
                raise ValueError(f"{name} is at {bank.sample_rate_hz} Hz; it must be at features.sample_rate_hz={rate}")
        self.noise_bank, self.rir_bank = noise_bank, rir_bank

    def _bank_on(self, name: str, device: torch.device) -> NoiseBank:
        bank = getattr(self, name)
        if bank.device != device:
            bank = bank.to(device)
            setattr(self, name, bank)
        return bank

    def _draw(self, generator: torch.Generator, bsz: int, p: float, rng: tuple[float, float],
              device: torch.device) -> torch.Tensor:
        """Per-utterance value uniform in `rng` where a U(0,1) draw is < p, NaN elsewhere (= op not applied)."""
        u = draw_uniform(generator, (bsz, 2), device)
        value = rng[0] + u[:, 1] * (rng[1] - rng[0])
        return torch.where(u[:, 0] < p, value, torch.full_like(value, float("nan")))

    def augment_waves(self, waves: torch.Tensor, lengths: torch.Tensor,
                      generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Speed (+ resample to the model rate), reverb, noise, gain; each op draws only when its p > 0."""
        aug, rate, device = self.aug, self.feats.sample_rate_hz, waves.device
        bsz = waves.shape[0]
        lengths = lengths.to(device=device, dtype=torch.long)
        factors = torch.ones(bsz, dtype=torch.float64)
        if aug.speed.p > 0 and bsz > 0:
            u = torch.rand((bsz, 2), generator=generator, device=generator.device).cpu()  # host copy: see docstring
            choice = torch.tensor(aug.speed.factors, dtype=torch.float64)[
                (u[:, 1] * len(aug.speed.factors)).long().clamp(max=len(aug.speed.factors) - 1)]
            factors = torch.where(u[:, 0] < aug.speed.p, choice, factors)
        waves, lengths = speed_perturb(waves, lengths, factors, sample_rate_hz=self.input_rate_hz,
                                       target_rate_hz=rate)
        if bsz == 0:
            return waves, lengths
        if aug.reverb.p > 0:
            # only the chosen rows are convolved (p is often small); the row index is needed on the host to size
            # the work: free with a CPU generator, one sync with a CUDA one
            rows = torch.nonzero(torch.rand(bsz, generator=generator, device=generator.device) < aug.reverb.p)
            rows = rows.squeeze(1).to(device)
            if rows.numel() > 0:
                if self.rir_bank is not None:
                    rirs = self._bank_on("rir_bank", device).clips(rows.numel(), generator)
                else:
                    rirs = synthetic_rirs(rows.numel(), rt60_s=aug.reverb.rt60_s, drr_db=aug.reverb.drr_db,
                                          max_seconds=aug.reverb.max_rir_seconds, sample_rate_hz=rate,
                                          generator=generator, device=device)
                waves = waves.index_copy(0, rows, reverb(waves[rows], lengths[rows], rirs))
        if aug.noise.p > 0:
            snr = self._draw(generator, bsz, aug.noise.p, aug.noise.snr_db, device)
            noise = self._bank_on("noise_bank", device).windows(bsz, waves.shape[1], generator)
            waves = add_noise(waves, lengths, noise, torch.nan_to_num(snr, nan=float("inf")))
        if aug.gain.p > 0:
            gain = self._draw(generator, bsz, aug.gain.p, aug.gain.gain_db, device)
            waves = apply_gain(waves, torch.nan_to_num(gain, nan=0.0))
        return waves, lengths

    def forward(self, waves: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None,
                train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """waves [B, T] float32 at input_rate_hz, lengths [B] -> feats [B, frames, n_mels], feat_lengths [B].
        With train=False or no generator: resample + features only (validation)."""
        if self.mel.spectrogram.window.device != waves.device:
            self.to(waves.device)
        augment = train and generator is not None
        if augment and generator is not None:
            waves, lengths = self.augment_waves(waves, lengths, generator)
        else:
            waves, lengths = resample(waves, lengths.to(waves.device, torch.long), self.input_rate_hz,
                                      self.feats.sample_rate_hz)
        feats, feat_lengths = log_mel(self.mel, waves, lengths, self.feats)
        feats = normalize(feats, feat_lengths, self.feats)
        if augment and generator is not None and self.aug.spec_augment.p > 0:
            feats = spec_augment(feats, feat_lengths, self.aug.spec_augment, generator)
        return feats, feat_lengths
