"""`shardtrain tune`: the largest batch of every duration bucket that fits the memory target, measured.

    index durations -> the plan's duration buckets (estimated bins, or bins_s) -> per bucket its longest (L) and
    shortest utterance
      -> probe(n): n synthetic waves of L seconds through the real pipeline (augmentation, features padded to
         the longest speed-perturbed length, model, CTC loss, backward, AdamW step, the AMP setting) -> peak bytes
      -> n = 1, 2, 4, ... until a probe exceeds the target, then bisection between the last fit and the first miss
      -> budget = cost(L) + (n - 1) x cost(shortest in the bucket) (summed budgets: the worst batch, one
         utterance of L and the rest as short as the bucket allows, all padded to L, holds n) or n x cost(L) (padded
         budgets) -> budget.json (train/budget.py) + step time at that n

Memory is measured, not modelled: on CUDA torch.cuda.max_memory_allocated against total x --memory-fraction (an
OOM during a probe counts as a miss); on the CPU the figure of train/memory.py (parameters, gradients, optimiser
state and the activations held for backward) against --memory-limit-mb (default: --memory-fraction of the memory
available). Synthetic waves are enough: memory depends on shapes, not on content. Cost: ~2 log2(n) + 1 steps
per bucket, each one real training step (seconds on a GPU). The search stops at a small multiple of the
preset's budget (`default_search_s`: 2x on the CPU, where a step grows with the batch and free RAM is rarely the
limit, and the search starts there: one probe a bucket; 8x on CUDA, where device memory stops it first).
Progress: one INFO line per probe (bucket, utterances tried, peak, seconds) and a tqdm bar per bucket. When one
utterance of the longest bucket does not fit, `NothingFits` before any search (nothing to write).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from shardtrain.load.plan import cost_s, estimate_bins
from shardtrain.train.memory import MemoryMeter, free_after_oom, is_oom, state_bytes, total_bytes
from shardtrain.train.model import build_model
from shardtrain.train.schedule import make_optimizer
from shardtrain.train.step import Augmenters, autocast
from shardtrain.train.config import RunConfig

log = logging.getLogger(__name__)

CPU_SEARCH_MULTIPLE = 2.0
"""Default search bound on the CPU, in the preset's max_batch_seconds: a CPU step grows linearly with the batch
and its memory target (a share of free RAM) is rarely what stops the search, so without a bound every bucket
climbs to it (8x the preset: ~7 minutes for 5 of 8 buckets on 2 cores). 2x keeps tune to ~2 log2 probes a bucket
of at most twice a normal step."""
GPU_SEARCH_MULTIPLE = 8.0
"""Default search bound on CUDA, in the preset's max_batch_seconds: device memory decides well before it."""


class NothingFits(ValueError):
    """One utterance of the dataset's longest bucket does not fit the memory target: no budget can be written."""


def default_search_s(cfg: RunConfig, device: torch.device) -> float:
    """The largest budget tune tries unless told (--max-batch-seconds): a small multiple of the preset's."""
    mult = GPU_SEARCH_MULTIPLE if device.type == "cuda" else CPU_SEARCH_MULTIPLE
    return mult * cfg.stream.bucket.max_batch_seconds


CHARS_PER_S = 15.0
"""Target tokens per second of audio in a probe (English speech: ~14 characters a second)."""


@dataclass(frozen=True, slots=True)
class Bucket:
    shortest_s: float
    longest_s: float
    rows: int


def choose_buckets(duration_s: np.ndarray, cfg: RunConfig, num_buckets: int | None = None) -> list[Bucket]:
    """The duration buckets the loader would cut (bins_s, or equal-audio bins), with their extreme lengths."""
    b = cfg.stream.bucket
    d = np.sort(np.asarray(duration_s, float))
    if len(d) == 0:
        raise ValueError("tune: the dataset's index has no rows")
    edges = np.asarray(b.bins_s, float) if b.bins_s is not None else estimate_bins(d, num_buckets or b.num_buckets)
    ids = np.searchsorted(edges, d, side="right")
    out = []
    for i in np.unique(ids):
        sel = d[ids == i]
        out.append(Bucket(float(sel[0]), float(sel[-1]), int(len(sel))))
    return out


class Prober:
    """One model, optimiser and augmentation chain on the device; `probe(n, seconds)` runs one real step."""

    def __init__(self, cfg: RunConfig, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.cfg, self.device, self.vocab = cfg, device, vocab_size
        self.model = build_model(cfg.model, vocab_size, cfg.features.n_mels).to(device).train()
        self.optimizer = make_optimizer(self.model, cfg.train)
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
        self.augment = Augmenters(cfg, device)
        self.meter = MemoryMeter(device, self.model, self.optimizer)
        sp = cfg.augment.speed
        self.stretch = 1.0 / min(sp.factors) if cfg.train.augment and sp.p > 0 else 1.0
        self.gen = torch.Generator().manual_seed(seed)

    def _batch(self, n: int, seconds: float) -> tuple[torch.Tensor, ...]:
        rate = self.cfg.features.sample_rate_hz
        samples = max(1, int(round(seconds * rate)))
        waves = (0.1 * torch.randn(n, samples, generator=self.gen)).to(self.device)
        lengths = torch.full((n,), samples, dtype=torch.int64, device=self.device)
        with torch.no_grad():
            feats, feat_lengths = self.augment(waves, lengths, rate, self.gen, train=self.cfg.train.augment)
        # speed perturbation draws at random: pad to the longest it can make, so the probe is the worst case
        worst = int(self.cfg.features.feature_lengths(torch.tensor(int(samples * self.stretch))))
        if feats.shape[1] < worst:
            feats = torch.nn.functional.pad(feats, (0, 0, 0, worst - feats.shape[1]))
        feat_lengths = torch.full_like(feat_lengths, feats.shape[1])
        t = max(1, min(int(seconds * CHARS_PER_S), feats.shape[1] // 8))
        targets = torch.randint(1, self.vocab, (n * t,), generator=self.gen).to(self.device)
        return feats, feat_lengths, targets, torch.full((n,), t, dtype=torch.int64, device=self.device)

    def probe(self, n: int, seconds: float) -> tuple[float, float]:
        """(peak bytes, step seconds) of one training step on n utterances of `seconds`; inf bytes on an OOM."""
        self.meter.take()
        t0 = time.perf_counter()
        try:
            batch = self._batch(n, seconds)
            with self.meter.measure():
                with autocast(self.cfg.train, self.device):
                    loss, _, _ = self.model(*batch)
                self.scaler.scale(loss / max(1, int(batch[2].numel()))).backward()
            del batch, loss
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            peak = self.meter.take()
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_oom(e):
                raise
            peak = math.inf
        self.optimizer.zero_grad(set_to_none=True)
        if math.isinf(peak):
            free_after_oom(self.device)
        return peak, time.perf_counter() - t0


def largest_fit(fits, n_max: int, start: int = 1) -> tuple[int, int]:
    """(largest n in [1, n_max] with fits(n), probes), fits assumed monotone: from `start` (the previous bucket's
    answer scaled by length) doubling up after a fit or halving down after a miss until the other outcome, then
    bisection between the two; 0 when even 1 misses. ~log2(distance to the answer) + log2(bracket) probes."""
    probes, lo, hi = 0, 0, n_max + 1  # lo: largest known fit (0: none), hi: smallest known miss
    n = min(max(1, start), n_max)
    while True:
        probes += 1
        if fits(n):
            lo = n
            if hi <= n_max or n == n_max:
                break
            n = min(2 * n, n_max)
        else:
            hi = n
            if lo > 0 or n == 1:
                break
            n = max(1, n // 2)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        probes += 1
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


@dataclass(frozen=True, kw_only=True, slots=True)
class Search:
    """What bounds the search (the command's flags, resolved): the peak a step may reach, the largest budget tried
    and the buckets to cut. One value, so the search's bounds travel together from the CLI to `tune`."""

    target_bytes: float
    """Peak memory one step may reach (--memory-limit-mb, or --memory-fraction of the device: default_target)."""
    max_batch_seconds: float
    """The largest budget a bucket is searched up to (--max-batch-seconds, else default_search_s)."""
    num_buckets: int | None = None
    """Duration buckets to cut (--buckets); None: the preset's stream.bucket.num_buckets."""


def tune(cfg: RunConfig, duration_s: np.ndarray, vocab_size: int, device: torch.device, search: Search, *,
         progress: bool = False) -> dict:
    """The budget.json document (train/budget.py) for `cfg` on a dataset with these durations."""
    from tqdm import tqdm

    t_start = time.perf_counter()
    b, target_bytes = cfg.stream.bucket, search.target_bytes
    buckets = choose_buckets(duration_s, cfg, search.num_buckets)
    prober = Prober(cfg, vocab_size, device, cfg.train.seed)
    prober.probe(1, buckets[0].shortest_s)  # allocates the optimiser state, which every later step holds
    # the smallest batch of the most demanding bucket first: when it does not fit, say so in seconds, not after
    # the whole search (and write nothing: a table of one utterance a bucket would only OOM later)
    _longest_fits(prober, buckets[-1].longest_s, target_bytes)
    rows, table = [], []
    prev: tuple[int, float] | None = None
    bar = tqdm(buckets, desc="tune", unit="bucket", disable=not progress)
    for i, bk in enumerate(bar):
        longest, unit = _costs(b, bk)
        n_max = max(1, int((search.max_batch_seconds - longest) // unit) + 1)
        n_max = n_max if b.max_batch_size is None else min(n_max, b.max_batch_size)
        seen: dict[int, float] = {}
        times: dict[int, float] = {}

        def fits(n: int, i: int = i, bk: Bucket = bk) -> bool:
            seen[n], times[n] = prober.probe(n, bk.longest_s)
            bar.set_postfix_str(f"<= {bk.longest_s:.1f} s: {n} utts, {seen[n] / 2**20:.0f} MiB")
            log.info("tune bucket %d/%d (<= %.2f s): %d utterances, peak %.1f MiB of %.0f MiB, %.2f s", i + 1,
                     len(buckets), bk.longest_s, n, seen[n] / 2**20, target_bytes / 2**20, times[n])
            return seen[n] <= target_bytes

        # start where the answer likely is. CPU: at the search bound, which binds there (free RAM rarely does):
        # one probe a bucket instead of ~2 log2(n), each as long as a step of that batch. CUDA: the last bucket's
        # answer scaled by length, or the preset's own worst batch (one utterance of L, the rest the shortest)
        preset_n = max(1, int((b.max_batch_seconds - longest) // unit) + 1)
        start = n_max if device.type == "cpu" else int(prev[0] * prev[1] / bk.longest_s) if prev else preset_n
        n, probes = largest_fit(fits, n_max, start=start)
        prev = (max(n, 1), bk.longest_s)
        if n == 0:  # measured above for the longest bucket; a shorter one cannot need more, unless noise
            raise NothingFits(f"one utterance of {bk.longest_s:.2f} s does not fit the {target_bytes / 2**20:.0f} MiB "
                              "target: raise --memory-limit-mb or --memory-fraction")
        # the step time at the chosen size, warm (CUDA: the fit probe paid for allocator growth and autotuning;
        # on the CPU one more step would cost as much as the search, and its time is the fit probe's)
        if device.type == "cuda" or n not in times:
            times[n], probes = prober.probe(n, bk.longest_s)[1], probes + 1
        step_s = times[n]
        # summed budgets: the worst batch of the bucket under b is one utterance of L and the rest as short as the
        # bucket allows, all padded to L: (1 + (b - L) / shortest) x L <= n x L  <=>  b <= L + (n - 1) x shortest
        budget = round(longest + (max(n, 1) - 1) * unit, 3)
        table.append((round(bk.longest_s, 4), budget))
        rows.append({"edge_s": round(bk.longest_s, 4), "shortest_s": round(bk.shortest_s, 4), "rows": bk.rows,
                     "utterances": n, "batch_seconds": budget, "padded_seconds": round(max(n, 1) * bk.longest_s, 3),
                     "peak_bytes": seen.get(n), "step_s": round(step_s, 4), "probes": probes,
                     "audio_s_per_s": round(max(n, 1) * bk.longest_s / max(step_s, 1e-9), 2)})
        log.info("bucket %.2f-%.2f s (%d rows): %d utterances = %.1f s of budget, peak %.1f MB of %.0f MB, "
                 "step %.3f s (%d probes)", bk.shortest_s, bk.longest_s, bk.rows, n, budget,
                 (seen.get(n) or 0) / 2**20, target_bytes / 2**20, step_s, probes)
    # the last edge covers the whole range the loader may meet: a longer row takes the last budget
    return {"budget_table": [list(r) for r in table], "memory_target_bytes": int(target_bytes),
            **_measured_on(prober, cfg, device), "buckets": rows, "tune_s": round(time.perf_counter() - t_start, 2)}


def _costs(b, bk: Bucket) -> tuple[float, float]:
    """Budget seconds of the bucket's longest utterance, and of each further one (the shortest, or the longest
    again when budgets are padded)."""
    longest = float(cost_s(np.array([bk.longest_s]), _plain(b))[0])
    return longest, longest if b.padded_budget else float(cost_s(np.array([bk.shortest_s]), _plain(b))[0])


def _longest_fits(prober: Prober, longest_s: float, target_bytes: float) -> None:
    """NothingFits unless one utterance of `longest_s` fits the target (one probe)."""
    peak, _ = prober.probe(1, longest_s)
    if peak > target_bytes:
        need = "more than the device has" if math.isinf(peak) else f"{peak / 2**20:.0f} MiB"
        raise NothingFits(f"one utterance of {longest_s:.2f} s (the longest) needs {need}, over the "
                          f"{target_bytes / 2**20:.0f} MiB target: raise --memory-limit-mb or --memory-fraction, or "
                          "use a smaller model or precision")


def _measured_on(prober: Prober, cfg: RunConfig, device: torch.device) -> dict:
    """What the budgets were measured with: device, memory source, fixed bytes and the settings that move them."""
    b = cfg.stream.bucket
    return {"device": str(device), "memory_source": "cuda max_memory_allocated" if device.type == "cuda" else
            "params + grads + optimiser state + activations saved for backward (train/memory.py)",
            "fixed_bytes": state_bytes(prober.model, prober.optimizer), "precision": cfg.train.precision,
            "padded_budget": b.padded_budget, "quadratic_duration_s": b.quadratic_duration_s,
            "augment": cfg.train.augment}


def _plain(b):
    """The bucket config without a budget table: probe costs in plain seconds (+ the quadratic term)."""
    import dataclasses

    return dataclasses.replace(b, budget_table=None)


def default_target(device: torch.device, fraction: float, limit_mb: float | None) -> float:
    """--memory-limit-mb when given, else fraction x (CUDA total memory | memory available now)."""
    return limit_mb * 2**20 if limit_mb else fraction * total_bytes(device)
