"""Device augmentation throughput: the full chain (speed, reverb, noise, gain, log-mel, normalise, SpecAugment),
batched, versus a per-utterance loop through the same ops (what lhotse's cut transforms do: each cut alone),
in utterance-seconds of audio per second of wall time.

    python -m benchmarks.train.bench_augment                      # CPU: 16 x 15 s, batched vs per-utterance
    python -m benchmarks.train.bench_augment --batch 64 --devices cpu,cuda   # on a GPU machine

Prints one JSON line (git_sha, config, per device: batched and per-utterance audio_s_per_s, ratio) and a table.
Times are the best of --repeats, batched and per-utterance interleaved (robust to other load on a shared box).
Inputs: `shardtrain.testing.synth_wave` (speech-like), durations spread over [0.7, 1.0] x --duration-s, as a
duration-bucketed loader delivers them.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


from benchmarks import common

from shardtrain.train.augment import AugmentConfig, DeviceAugment, GainConfig, NoiseConfig, ReverbConfig
from shardtrain.train.features import FeatureConfig


def make_batch(batch: int, duration_s: float, rate: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        from shardtrain.testing.corpus import synth_wave
    except ImportError:  # testing helper not present: plain noise is as costly to augment
        synth_wave = None
    g = torch.Generator().manual_seed(seed)
    lengths = (duration_s * rate * (0.7 + 0.3 * torch.rand(batch, generator=g))).long()
    lengths[0] = int(duration_s * rate)
    waves = torch.zeros(batch, int(lengths.max()))
    for i, n in enumerate(lengths.tolist()):
        w = (torch.from_numpy(synth_wave(n / rate, rate, seed=seed + i))[:n] if synth_wave
             else 0.1 * torch.randn(n, generator=g))
        waves[i, : w.shape[0]] = w
    return waves, lengths


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_chain(chain: DeviceAugment, waves, lengths, device: str, repeats: int, seed: int) -> tuple[float, float]:
    """(batched seconds, per-utterance seconds), each the best of `repeats`, the two interleaved so that load from
    other processes on a shared machine hits both alike. Per-utterance = each utterance alone (B=1, unpadded)
    through the same chain: the per-cut transform pattern."""
    batch = waves.to(device), lengths.to(device)
    singles = [(waves[i : i + 1, : int(n)].to(device), lengths[i : i + 1].to(device))
               for i, n in enumerate(lengths.tolist())]
    chain(*batch, torch.Generator().manual_seed(seed))  # warm-up: kernels, noise bank moved to the device
    for w, n in singles[:2]:
        chain(w, n, torch.Generator().manual_seed(seed))
    best_batched = best_single = float("inf")
    for r in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        chain(*batch, torch.Generator().manual_seed(seed + r))
        _sync(device)
        t1 = time.perf_counter()
        gen = torch.Generator().manual_seed(seed + r)
        for w, n in singles:
            chain(w, n, gen)
        _sync(device)
        t2 = time.perf_counter()
        best_batched, best_single = min(best_batched, t1 - t0), min(best_single, t2 - t1)
    return best_batched, best_single


def main(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads) if args.threads else None
    rate = 16000
    aug = AugmentConfig(reverb=ReverbConfig(p=args.p), noise=NoiseConfig(p=args.p), gain=GainConfig(p=args.p))
    chain = DeviceAugment(aug, FeatureConfig(sample_rate_hz=rate), rate)
    waves, lengths = make_batch(args.batch, args.duration_s, rate, args.seed)
    audio_s = float(lengths.sum()) / rate
    devices = [d for d in args.devices.split(",") if d]
    results = {}
    for device in devices:
        if device.startswith("cuda") and not torch.cuda.is_available():
            results[device] = {"skipped": "no CUDA"}
            continue
        chain = chain.to(device)
        batched, single = time_chain(chain, waves, lengths, device, args.repeats, args.seed)
        results[device] = {"batched_audio_s_per_s": round(audio_s / batched, 1),
                           "per_utt_audio_s_per_s": round(audio_s / single, 1),
                           "batched_s": round(batched, 4), "per_utt_s": round(single, 4),
                           "ratio_batched_over_per_utt": round(single / batched, 2)}
    out = {"bench": "augment", "git_sha": common.git_sha(),
           "config": {"batch": args.batch, "duration_s": args.duration_s, "audio_s": round(audio_s, 1),
                      "p": args.p, "repeats": args.repeats, "threads": torch.get_num_threads(),
                      "torch": torch.__version__},
           "results": results}
    print(json.dumps(out))
    print(f"\n{'device':8} {'batched audio-s/s':>18} {'per-utt audio-s/s':>18} {'ratio':>7}")
    for device, r in results.items():
        if "skipped" in r:
            print(f"{device:8} {'skipped: ' + r['skipped']:>18}")
        else:
            print(f"{device:8} {r['batched_audio_s_per_s']:>18} {r['per_utt_audio_s_per_s']:>18} "
                  f"{r['ratio_batched_over_per_utt']:>7}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=None,
                   help="utterances per batch (default 16 on CPU-only runs, 64 when cuda is among --devices)")
    p.add_argument("--duration-s", type=float, default=15.0, help="longest utterance in seconds (others 70-100%%)")
    p.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu",
                   help="comma-separated devices to time (cuda is skipped, and reported, when absent)")
    p.add_argument("--p", type=float, default=1.0,
                   help="probability of reverb, noise and gain per utterance (1.0: every op on every utterance)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (after one warm-up); the best of them is reported")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and the augmentation generators")
    args = p.parse_args(argv)
    if args.batch is None:
        args.batch = 64 if "cuda" in args.devices and torch.cuda.is_available() else 16
    return args


if __name__ == "__main__":
    main(parse_args())
