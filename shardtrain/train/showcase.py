"""What augmentation does, made audible and visible: `shardtrain augment-demo` writes WAVs and spectrogram PNGs.

    waves [B, T] + lengths [B] -> DeviceAugment.augment_waves (speed, reverb, noise, gain) -> WAV before/after
                               -> log-mel of both + the model's input (normalised + SpecAugment) -> one PNG each

A debugging aid, not a training path: it costs one batch through the chain plus matplotlib (~1 s to import).
"""
from __future__ import annotations

import os

import soundfile
import torch

from shardtrain.train.augment import AugmentConfig, DeviceAugment
from shardtrain.train.features import FeatureConfig, log_mel


def write_examples(waves: torch.Tensor, lengths: torch.Tensor, names: list[str], aug: AugmentConfig, out_dir: str,
                   seed: int, storage_options: dict | None = None) -> list[dict]:
    """Augment one batch and write `<i>_<name>_orig.wav`, `_aug.wav` and `.png` per example; returns what was
    written: [{"orig", "aug", "png", "samples_in", "samples_out", "peak_normalised"}]."""
    feats_cfg = FeatureConfig()
    rate = feats_cfg.sample_rate_hz
    chain = DeviceAugment(aug, feats_cfg, rate, storage_options=storage_options)
    aug_waves, aug_lengths = chain.augment_waves(waves, lengths, torch.Generator().manual_seed(seed))
    final, final_lengths = chain(waves, lengths, torch.Generator().manual_seed(seed))  # same draws + masks
    raw_cfg = FeatureConfig(normalize="none")
    orig_feats, orig_flen = log_mel(chain.mel, waves, lengths, raw_cfg)
    aug_feats, aug_flen = log_mel(chain.mel, aug_waves, aug_lengths, raw_cfg)
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for i, name in enumerate(names):
        stem = os.path.join(out_dir, f"{i:02d}_{name}")
        n0, n1 = int(lengths[i]), int(aug_lengths[i])
        out = aug_waves[i, :n1]
        peak = float(out.abs().max()) if n1 else 0.0
        soundfile.write(stem + "_orig.wav", waves[i, :n0].numpy(), rate)
        soundfile.write(stem + "_aug.wav", (out / peak * 0.99 if peak > 0.99 else out).numpy(), rate)
        panels = [(orig_feats[i, : int(orig_flen[i])], f"original log-mel ({n0 / rate:.2f} s)"),
                  (aug_feats[i, : int(aug_flen[i])],
                   f"augmented log-mel ({n1 / rate:.2f} s, speed {n0 / max(n1, 1):.2f})"),
                  (final[i, : int(final_lengths[i])], "model input: normalised + SpecAugment")]
        _plot(panels, stem + ".png")
        written.append({"orig": stem + "_orig.wav", "aug": stem + "_aug.wav", "png": stem + ".png",
                        "samples_in": n0, "samples_out": n1, "peak_normalised": peak > 0.99})
    return written


def _plot(panels: list[tuple[torch.Tensor, str]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 8), constrained_layout=True)
    for ax, (x, title) in zip(axes, panels):
        im = ax.imshow(x.T.numpy(), origin="lower", aspect="auto", interpolation="nearest")
        ax.set_title(title)
        ax.set_ylabel("mel bin")
        fig.colorbar(im, ax=ax)
    axes[-1].set_xlabel("frame (10 ms)")
    fig.savefig(path, dpi=80)
    plt.close(fig)
