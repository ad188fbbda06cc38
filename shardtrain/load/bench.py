"""Loader benchmark: the real loader, timed per stage, in audio seconds per second.

    build_loader(...) -> (Batch, state) -> [H2D copy] -> [device augmentation] -> simulated step (sleep step_ms)

Reports throughput (audio-s/s, samples/s), padding efficiency (real samples / padded samples), time to first
batch, peak RSS of the whole process tree, skipped samples, the share of step time spent
waiting for data when a step time is simulated, the data wait of the first steps of every epoch against the
median step's (epoch boundaries should not stall a trainer), and per-stage seconds (read, parse, decode, batch,
collate, and h2d / augment when they ran) with each stage's own rate (audio seconds / stage seconds, summed over
threads: what one core would do if that stage ran alone). A steady rate is given only from enough batches
(`steady_batches_needed`); otherwise `steady_refused` says how many it needs.
"""
from __future__ import annotations

from collections.abc import Callable

import os
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np
import psutil
import torch
from tqdm import tqdm

from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.batch import pcm_to_float
from shardtrain.world import World


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    epochs: int | None = 1
    """Epochs to run (None: until max_batches)."""
    progress: bool = False
    """Show a progress bar (batches) on stderr."""
    max_batches: int | None = None
    """Stop after this many batches."""
    step_ms: float = 0.0
    """Simulated trainer compute per batch; > 0 reports data_wait_pct."""
    device: str = "cpu"
    """Copy batches to this device ("cuda" measures host-to-device)."""

    def __post_init__(self) -> None:
        if self.epochs is None and self.max_batches is None:
            raise ValueError("bench: set --epochs or --max-batches")


class RssSampler:
    """Peak resident memory of this process plus its children (other tools' DataLoader workers, decode pools).

    Own RSS is read every `interval_s` (one small /proc read); children are listed only every `children_every`
    samples, because listing them scans all of /proc while holding the GIL: at 20 Hz that cost a threaded loader
    ~10% of its throughput on 2 cores (measured). `ru_maxrss` is not used: Linux carries it across fork and
    exec, so a bench started from a big parent would report the parent's peak.
    """

    def __init__(self, interval_s: float = 0.05, children_every: int = 10):
        self.interval_s, self.children_every, self.peak_bytes = interval_s, children_every, 0
        self._me = psutil.Process(os.getpid())
        self._children_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _children(self) -> int:
        total = 0
        for child in self._me.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _sample(self, i: int) -> None:
        if i % self.children_every == 0:
            self._children_bytes = self._children()
        self.peak_bytes = max(self.peak_bytes, self._me.memory_info().rss + self._children_bytes)

    def _run(self) -> None:
        i = 1
        while not self._stop.wait(self.interval_s):
            self._sample(i)
            i += 1

    def __enter__(self) -> "RssSampler":
        self._sample(0)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(0)


def steady_rate(audio_s: float, first_audio_s: float, wall_s: float, first_batch_s: float | None) -> float | None:
    """Audio-s/s after the first batch: the rate a long run converges to, without start-up (imports excluded,
    index read, first chunk). None when there is no second batch."""
    if first_batch_s is None or wall_s <= first_batch_s or audio_s <= first_audio_s:
        return None
    return round((audio_s - first_audio_s) / (wall_s - first_batch_s), 1)


def steady_batches_needed(stream: StreamConfig) -> int:
    """Batches after the first that a steady figure needs: the read-ahead (prefetch_chunks chunks of
    batches_per_chunk batches) must drain and refill twice, or the figure is the read-ahead's, not the loader's
    (2 batches of a tiny set once gave 213,530 audio-s/s)."""
    return 2 * stream.prefetch_chunks * stream.bucket.batches_per_chunk + 4


EPOCH_START_STEPS = 5
"""Steps at the start of every epoch whose data wait is reported against the median step's."""


def epoch_start_waits(waits: list[tuple[int, int, float]]) -> dict:
    """Data wait of the first EPOCH_START_STEPS steps of each epoch against the median step's: the epoch boundary
    (planning the next epoch, its first reads) should cost the trainer no more than a steady step. Epoch 0's
    step 0 is the start-up (first_batch_s), so its mean starts at step 1. Milliseconds."""
    if not waits:
        return {}
    median = float(np.median([w for _, _, w in waits]))
    per_epoch: dict[int, list[float]] = {}
    for epoch, step, w in waits:
        if step < EPOCH_START_STEPS and (epoch, step) != (waits[0][0], waits[0][1]):
            per_epoch.setdefault(epoch, []).append(w)
    starts = {e: float(np.mean(v)) for e, v in sorted(per_epoch.items())}
    out = {"median_wait_ms": round(1e3 * median, 3),
           "epoch_start_wait_ms": {str(e): round(1e3 * v, 3) for e, v in starts.items()}}
    worst = max(starts.values(), default=None)
    # a ratio to a near-zero median (the loader ahead of the trainer) says nothing: the excess in ms then does
    out["epoch_start_wait_x_median"] = round(worst / median, 2) if worst is not None and median >= 1e-3 else None
    out["epoch_start_excess_ms"] = round(1e3 * (worst - median), 3) if worst is not None else None
    return out


Augmenter = Callable[[torch.Tensor, torch.Tensor, torch.Generator], object]
"""(waves [B, T] float32 on `device`, lengths [B], generator) -> anything; timed as stage "augment"."""


@dataclass(slots=True)
class _Tally:
    samples: int = 0
    batches: int = 0
    audio_s: float = 0.0
    real: float = 0.0
    padded: float = 0.0
    wait_s: float = 0.0
    first_batch_s: float | None = None
    first_audio_s: float = 0.0
    waits: list[tuple[int, int, float]] = field(default_factory=list)
    """(epoch, step, seconds waited for the batch) per batch."""


def bench_loader(url: str, *, world: World, seed: int, stream: StreamConfig, bench: BenchConfig,
                 storage_options: dict | None = None,
                 make_augment: Callable[[int], Augmenter] | None = None) -> dict:
    """Run the loader and return one flat dict of figures (JSON-able).

    `make_augment(sample_rate_hz)` builds the device chain to time per batch (the CLI passes the trainer's
    DeviceAugment with `--augment`); it is called once the dataset's sample rate is known. The loader room
    does not import the trainer, so the chain comes in from above."""
    stream = replace(stream, epochs=bench.epochs)
    stages = {"h2d": 0.0} if bench.device != "cpu" else {}
    if make_augment is not None:
        stages["augment"] = 0.0
    tally = _Tally()
    with RssSampler() as rss:
        t_start = time.perf_counter()
        loader = build_loader(url, world=world, seed=seed, cfg=stream, storage_options=storage_options)
        aug = make_augment(loader.sample_rate_hz) if make_augment is not None else None
        _drain(loader, bench, aug, torch.Generator(device=bench.device).manual_seed(seed), tally, stages, t_start)
        wall = time.perf_counter() - t_start
        stats = loader.stats()
        stage_s = {**loader.stage_s, **stages}
    audio_s, samples = tally.audio_s, tally.samples
    out = {
        "samples": samples, "audio_seconds": round(audio_s, 3), "wall_seconds": round(wall, 3),
        "samples_per_s": round(samples / wall, 2), "audio_s_per_s": round(audio_s / wall, 1),
        "padding_efficiency": round(tally.real / tally.padded, 4) if tally.padded else None,
        "batches": tally.batches, "first_batch_s": round(tally.first_batch_s or 0.0, 3),
        "peak_rss_mb": round(rss.peak_bytes / 2**20, 1),
        "steady_audio_s_per_s": None,
        "skipped": stats["skipped"], "too_long": stats["too_long"],
        "data_wait_pct": round(100.0 * tally.wait_s / wall, 2) if bench.step_ms > 0 else None,
        "workers": stream.num_workers, "decode_threads": stream.decode_threads,
        "world_size": world.world_size, "rank": world.rank,
        "max_batch_seconds": stream.bucket.max_batch_seconds, "planner": loader.planner.name,
    }
    need = steady_batches_needed(stream)
    if tally.batches - 1 >= need:
        out["steady_audio_s_per_s"] = steady_rate(audio_s, tally.first_audio_s, wall, tally.first_batch_s)
    else:
        out["steady_refused"] = (f"no steady rate: it needs >= {need} batches after the first, this run had "
                                 f"{max(tally.batches - 1, 0)}; use a larger dataset or more --epochs")
    out.update(epoch_start_waits(tally.waits))
    for k, v in stage_s.items():
        out[f"stage_{k}_s"] = round(v, 3)
        out[f"stage_{k}_audio_s_per_s"] = round(audio_s / v, 1) if v > 0 else None
    return out


def _drain(loader, bench: BenchConfig, aug: Augmenter | None, gen: torch.Generator, tally: _Tally,
           stages: dict, t_start: float) -> None:
    """Pull batches as a trainer would: copy to the device, augment, 'compute' for step_ms; count everything."""
    it = iter(loader)
    total = bench.max_batches
    if bench.progress and bench.epochs is not None:  # one more plan of epoch 0: only for the bar's total
        per_epoch = bench.epochs * loader.steps_per_epoch()
        total = per_epoch if total is None else min(total, per_epoch)
    bar = tqdm(total=total, unit="batch", desc="bench", disable=not bench.progress, dynamic_ncols=True)
    try:
        while bench.max_batches is None or tally.batches < bench.max_batches:
            t0 = time.perf_counter()
            try:
                batch, _state = next(it)
            except StopIteration:
                break
            t1 = time.perf_counter()
            tally.wait_s += t1 - t0
            tally.waits.append((batch.epoch, batch.step, t1 - t0))
            if tally.first_batch_s is None:
                tally.first_batch_s = t1 - t_start
                tally.first_audio_s = float(batch.durations_s.sum())
            waves, lengths = batch.waves, batch.lengths
            if bench.device != "cpu":
                waves = waves.to(bench.device, non_blocking=True)
                lengths = lengths.to(bench.device, non_blocking=True)
            if bench.device != "cpu" or aug is not None:
                waves = pcm_to_float(waves)  # pcm_dtype="int16": on the device, as the trainer does
            if bench.device != "cpu":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            if "h2d" in stages:
                stages["h2d"] += t2 - t1
            if aug is not None:
                if len(batch):
                    aug(waves, lengths, gen)
                    if bench.device != "cpu":
                        torch.cuda.synchronize()
                stages["augment"] += time.perf_counter() - t2
            if bench.step_ms > 0:
                time.sleep(bench.step_ms / 1000.0)
            tally.batches += 1
            tally.samples += len(batch)
            tally.audio_s += float(batch.durations_s.sum())
            tally.real += float(batch.lengths.sum())
            tally.padded += float(batch.waves.numel())
            bar.update(1)
    finally:
        bar.close()
    close = getattr(it, "close", None)
    if close is not None:  # stop the prefetch threads now when max_batches ended the run early
        close()
