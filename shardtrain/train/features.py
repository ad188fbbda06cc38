"""Log-mel features, normalisation and SpecAugment on a padded batch, on any device.

    waves [B, T] float32 (zero-padded) + lengths [B] int64 (samples)
      -> log_mel      -> feats [B, frames, n_mels] float32, feat_lengths [B] = 1 + lengths // hop
      -> normalize    ("utterance": per-utterance, per-bin mean/variance over true frames; "global": given stats)
      -> spec_augment (time and frequency masks inside each true length)

Why the log-mel is computed the way it is: torchaudio's `MelSpectrogram(center=True)` reflect-pads each signal at
*its own* end. Run on a zero-padded batch it would see zeros there instead, so the last frames of every
utterance but the longest would differ from the single-utterance result. `log_mel` therefore builds the
reflect padding per utterance (one small scatter of B x n_fft/2 samples) and runs the same MelSpectrogram with
`center=False`: each utterance's frames equal torchaudio's single-utterance frames (tests check it). Frames
past `feat_lengths` are zero, as is the padding of every tensor in this package.

Randomness (SpecAugment) comes only from the `torch.Generator` passed in. Draws are B-sized vectors made on the
generator's device and moved to the features' device, so a CPU generator and a CUDA generator both work
(a CPU generator gives the same masks on every device).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torchaudio

log = logging.getLogger(__name__)

NORMALIZE_MODES = ("utterance", "global", "none")


@dataclass(frozen=True, kw_only=True, slots=True)
class FeatureConfig:
    sample_rate_hz: int = 16000
    """Model (feature) sample rate; waves at another rate are resampled first."""
    n_mels: int = 80
    """Mel bins."""
    win_ms: float = 25.0
    """Analysis window length in milliseconds (400 samples at 16 kHz)."""
    hop_ms: float = 10.0
    """Frame shift in milliseconds (160 samples at 16 kHz)."""
    n_fft: int | None = None
    """FFT size in samples; None = the next power of two >= the window (512 at 16 kHz)."""
    normalize: str = "utterance"
    """"utterance": per-utterance, per-bin mean/variance over its true frames (CMVN); "global": subtract
    `global_mean` and divide by `global_std` (fixed per-bin stats of the corpus);
    "none": raw log-mel."""
    global_mean: tuple[float, ...] | None = None
    """Global mean per mel bin (n_mels values) or one value for all bins; required when normalize="global"."""
    global_std: tuple[float, ...] | None = None
    """Global standard deviation per mel bin (n_mels values) or one value; required when normalize="global"."""
    log_floor: float = 1e-10
    """Mel power is clamped to at least this before the log (log(1e-10) = -23)."""

    def __post_init__(self) -> None:
        if self.sample_rate_hz <= 0:
            raise ValueError("features.sample_rate_hz must be > 0")
        if self.n_mels < 1:
            raise ValueError("features.n_mels must be >= 1")
        if self.hop_length < 1 or self.win_length < 1:
            raise ValueError("features.hop_ms and features.win_ms must give at least one sample")
        if self.n_fft_samples < self.win_length:
            raise ValueError("features.n_fft must be >= the window length in samples (features.win_ms)")
        if self.normalize not in NORMALIZE_MODES:
            raise ValueError(f"features.normalize must be one of {NORMALIZE_MODES}, got {self.normalize!r}")
        if self.normalize == "global":
            if self.global_mean is None or self.global_std is None:
                raise ValueError('features.normalize="global" needs features.global_mean and features.global_std')
            for name in ("global_mean", "global_std"):
                n = len(getattr(self, name))
                if n not in (1, self.n_mels):
                    raise ValueError(f"features.{name} must have 1 or n_mels={self.n_mels} values, got {n}")
            if min(self.global_std) <= 0:
                raise ValueError("features.global_std values must be > 0")
        if self.log_floor <= 0:
            raise ValueError("features.log_floor must be > 0")

    @property
    def hop_length(self) -> int:
        return int(round(self.sample_rate_hz * self.hop_ms / 1000.0))

    @property
    def win_length(self) -> int:
        return int(round(self.sample_rate_hz * self.win_ms / 1000.0))

    @property
    def n_fft_samples(self) -> int:
        if self.n_fft is not None:
            return self.n_fft
        return 1 << (self.win_length - 1).bit_length()

    def feature_lengths(self, wave_lengths: torch.Tensor) -> torch.Tensor:
        """Frames torchaudio's MelSpectrogram(center=True) gives a signal of that many samples: 1 + len // hop."""
        return 1 + wave_lengths.long() // self.hop_length

    def mel_module(self) -> torchaudio.transforms.MelSpectrogram:
        """The torchaudio MelSpectrogram these features reproduce (center=False: `log_mel` pads itself)."""
        return torchaudio.transforms.MelSpectrogram(
            sample_rate=self.sample_rate_hz, n_fft=self.n_fft_samples, win_length=self.win_length,
            hop_length=self.hop_length, n_mels=self.n_mels, power=2.0, center=False,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SpecAugmentConfig:
    p: float = 1.0
    """Probability that an utterance gets masks at all."""
    n_time_masks: int = 2
    """Time masks per utterance."""
    max_time_frames: int = 100
    """Upper bound on one time mask's width in frames."""
    max_time_fraction: float = 0.05
    """One time mask covers at most this fraction of the utterance's true frames (SpecAugment's p; LibriSpeech
    policies use 0.05), so short utterances are never blanked out."""
    n_freq_masks: int = 2
    """Frequency masks per utterance."""
    max_freq_bins: int = 27
    """Upper bound on one frequency mask's width in mel bins."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ValueError("augment.spec_augment.p must be in [0, 1]")
        if min(self.n_time_masks, self.max_time_frames, self.n_freq_masks, self.max_freq_bins) < 0:
            raise ValueError("augment.spec_augment mask counts and widths must be >= 0")
        if not 0.0 <= self.max_time_fraction <= 1.0:
            raise ValueError("augment.spec_augment.max_time_fraction must be in [0, 1]")


def valid_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] bool: True where position < length."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


def draw_uniform(generator: torch.Generator, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """U[0, 1) float32 of `shape`, drawn on the generator's device, returned on `device`."""
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


def log_mel(mel: torchaudio.transforms.MelSpectrogram, waves: torch.Tensor, lengths: torch.Tensor,
            cfg: FeatureConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-mel [B, frames, n_mels] of zero-padded waves, per utterance equal to torchaudio's
    `log(MelSpectrogram(center=True)(wave[:len]).clamp_min(log_floor))`; frames past `feat_lengths` are zero.

    `mel` is `cfg.mel_module()` on the waves' device. Utterances shorter than n_fft/2 + 1 samples (17 ms at
    16 kHz; torchaudio refuses them) get a clamped reflection instead of raising. Cost: one STFT of the batch.
    """
    lengths = lengths.to(device=waves.device, dtype=torch.long)
    bsz, width = waves.shape
    half = cfg.n_fft_samples // 2
    frames = 1 + width // cfg.hop_length
    if bsz == 0:
        return waves.new_zeros(0, frames, cfg.n_mels), lengths.clone()
    padded = torch.nn.functional.pad(waves, (half, half))
    k = torch.arange(1, half + 1, device=waves.device)
    # left edge: x[-k] -> x[k], the same for every utterance
    padded[:, :half] = waves[:, k.flip(0).clamp(max=width - 1)] if width > 1 else 0.0
    # right edge, per utterance: position len-1+k reflects to len-1-k (padding there is zero, so scatter is enough)
    src_idx = (lengths[:, None] - 1 - k[None, :]).clamp(min=0, max=max(width - 1, 0))
    dst_idx = lengths[:, None] - 1 + k[None, :] + half
    padded.scatter_(1, dst_idx, torch.gather(waves, 1, src_idx) * (lengths[:, None] > 0))
    spec = mel(padded)  # [B, n_mels, frames]
    feats = spec.clamp_min(cfg.log_floor).log().transpose(1, 2)
    feat_lengths = cfg.feature_lengths(lengths)
    return feats * valid_mask(feat_lengths, feats.shape[1])[:, :, None], feat_lengths


def normalize(feats: torch.Tensor, feat_lengths: torch.Tensor, cfg: FeatureConfig) -> torch.Tensor:
    """Mean/variance normalisation per `cfg.normalize`; padding frames stay zero."""
    if cfg.normalize == "none":
        return feats
    valid = valid_mask(feat_lengths, feats.shape[1])[:, :, None]
    if cfg.normalize == "global":
        mean = torch.tensor(cfg.global_mean, dtype=feats.dtype, device=feats.device)
        std = torch.tensor(cfg.global_std, dtype=feats.dtype, device=feats.device)
        return (feats - mean) / std * valid
    n = feat_lengths.clamp(min=1).to(feats.dtype)[:, None, None]
    mean = (feats * valid).sum(1, keepdim=True) / n
    var = (((feats - mean) * valid) ** 2).sum(1, keepdim=True) / n
    return (feats - mean) / var.sqrt().clamp_min(1e-5) * valid


def _mask_spans(generator: torch.Generator, n_masks: int, max_width: torch.Tensor, extent: torch.Tensor,
                axis_len: int, apply: torch.Tensor) -> torch.Tensor:
    """[B, axis_len] bool union of `n_masks` spans per row: width ~ U{0..max_width}, start ~ U{0..extent-width}."""
    bsz = max_width.shape[0]
    device = max_width.device
    width = (draw_uniform(generator, (bsz, n_masks), device) * (max_width[:, None] + 1)).floor().long()
    width = torch.minimum(width, max_width[:, None]) * apply[:, None]
    start = (draw_uniform(generator, (bsz, n_masks), device) * (extent[:, None] - width + 1)).floor().long()
    start = torch.minimum(start, (extent[:, None] - width).clamp(min=0))
    pos = torch.arange(axis_len, device=device)[None, None, :]
    return ((pos >= start[:, :, None]) & (pos < (start + width)[:, :, None])).any(1)


def spec_augment(feats: torch.Tensor, feat_lengths: torch.Tensor, cfg: SpecAugmentConfig,
                 generator: torch.Generator) -> torch.Tensor:
    """SpecAugment on [B, frames, n_mels]: per utterance (with probability p) up to `n_time_masks` time masks of
    at most min(max_time_frames, floor(max_time_fraction * true frames)) frames inside the true frames, and
    `n_freq_masks` frequency masks of at most `max_freq_bins` bins; the widths are also capped so that the
    masks together never cover all frames or all bins of an utterance. Masked cells take the utterance's mean over
    its true frames (0 after normalisation); padding stays zero. Batched: masks are broadcast comparisons,
    no loop over utterances.
    """
    bsz, frames, n_mels = feats.shape
    if bsz == 0 or cfg.p == 0.0:
        return feats
    device = feats.device
    lengths = feat_lengths.to(device=device, dtype=torch.long)
    apply = draw_uniform(generator, (bsz,), device) < cfg.p
    # widths capped so that the masks together leave at least one frame and one bin of every utterance (two
    # masks of 27 bins could blank all of 40 mels: the whole utterance would be its fill value)
    max_t = torch.clamp((lengths.double() * cfg.max_time_fraction).floor().long(), max=cfg.max_time_frames)
    max_t = torch.minimum(max_t, (lengths - 1).clamp(min=0) // max(cfg.n_time_masks, 1))
    time_mask = _mask_spans(generator, cfg.n_time_masks, max_t, lengths, frames, apply)
    max_f = torch.full((bsz,), min(cfg.max_freq_bins, (n_mels - 1) // max(cfg.n_freq_masks, 1)), device=device,
                       dtype=torch.long)
    freq_mask = _mask_spans(generator, cfg.n_freq_masks, max_f, torch.full_like(max_f, n_mels), n_mels, apply)
    valid = valid_mask(lengths, frames)
    fill = (feats * valid[:, :, None]).sum((1, 2)) / (lengths.clamp(min=1) * n_mels).to(feats.dtype)
    masked = (time_mask[:, :, None] | freq_mask[:, None, :]) & valid[:, :, None]
    return torch.where(masked, fill[:, None, None], feats)
