"""The loader over a weighted mixture of datasets (local and s3:// mixed): `build_mixture([(url, weight), ...])`.

    every dataset: manifest + index (numeric columns), rows over the batch budget left out (counted)
      -> MixIndex(epoch): mixture.select_epoch (each dataset's weight share of the epoch's audio, from its stream
         of random passes) -> gather_index (one PlanIndex; shard ids offset per dataset)        cached per epoch
      -> the ordinary Loader machinery: plan_epoch per epoch, chunks, ChunkReader over MixedDataset (shard id ->
         that dataset's shard URL), resume and elastic re-stripe from (seed, epoch, step, chain)
      -> counters["dataset_seconds"]: planned audio seconds delivered per dataset (in the state, so exact
         across resumes; the trainer logs them to metrics.jsonl)

All datasets must share one sample rate, and remote ones one set of storage options (one endpoint and keys).
Memory: every dataset's PlanIndex (~70 B/row) plus one gathered epoch index (~70 B per selected row).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Generator, Sequence

import numpy as np

from shardtrain import storage
from shardtrain.format.manifest import Dataset, ShardInfo, open_dataset
from shardtrain.load.batch import Batch
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import Loader, _cfg_fingerprint, _chunk_schedule, _Cursor, epoch_plan
from shardtrain.load.mixture import gather_index, select_epoch
from shardtrain.load.plan import PLAN_COLUMNS, PlanIndex, cost_s
from shardtrain.load.reader import CHECK_COLUMNS, StreamError
from shardtrain.world import World

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MixedDataset:
    """What the reader needs of a dataset, over several: shard id -> (dataset, its shard)."""

    url: str
    """The first remote dataset's URL (so caching and presigning treat the mixture as remote), else the first."""
    parts: tuple[Dataset, ...]
    shards: list[ShardInfo]
    """Every dataset's shards in order, named `d<i>/<name>` (names are only unique inside one dataset)."""
    base: np.ndarray
    storage_options: dict | None = None

    def shard_url(self, i: int) -> str:
        d = int(np.searchsorted(self.base, i, side="right")) - 1
        return self.parts[d].shard_url(int(i - self.base[d]))


def parse_sources(sources: Sequence) -> list[tuple[str, float]]:
    """[url | (url, weight)] -> [(url, weight)]; weight 1 when left out."""
    out = []
    for s in sources:
        url, w = (s, 1.0) if isinstance(s, str) else (str(s[0]), float(s[1]))
        if not w > 0:
            raise ValueError(f"weight of {url} must be > 0, got {w}")
        out.append((url, w))
    if not out:
        raise ValueError("a mixture needs at least one dataset")
    return out


class MixIndex:
    """epoch -> the mixture's gathered PlanIndex (pure; the last two epochs cached)."""

    def __init__(self, indexes: list[PlanIndex], eligible: list[np.ndarray], weights: list[float], seed: int,
                 epoch_s: float | None, shard_base: np.ndarray):
        self.indexes, self.eligible, self.weights, self.seed = indexes, eligible, weights, seed
        self.epoch_s, self.shard_base = epoch_s, shard_base
        self._cache: dict[int, tuple[PlanIndex, np.ndarray]] = {}

    def select(self, epoch: int) -> tuple[PlanIndex, np.ndarray]:
        """(gathered index, dataset of every virtual row) of `epoch`."""
        if epoch not in self._cache:
            durs = [ix.duration_s[e] for ix, e in zip(self.indexes, self.eligible)]
            mix = select_epoch(durs, self.weights, seed=self.seed, epoch=epoch, epoch_s=self.epoch_s)
            rows = np.empty(len(mix.row), np.int64)
            for i, e in enumerate(self.eligible):  # back from eligible positions to index rows
                m = mix.source == i
                rows[m] = e[mix.row[m]]
            mix = dataclasses.replace(mix, row=rows)
            self._cache = {k: v for k, v in self._cache.items() if k == epoch - 1}
            self._cache[epoch] = (gather_index(self.indexes, mix, self.shard_base), mix.source)
        return self._cache[epoch]

    def __call__(self, epoch: int) -> PlanIndex:
        return self.select(epoch)[0]


class MixtureLoader(Loader):
    """A Loader whose index changes every epoch (the mixture's selection); everything else is the Loader's."""

    def __init__(self, sources: Sequence, *, world: World, seed: int, cfg: StreamConfig, state: dict | None = None,
                 storage_options: dict | None = None, epoch_hours: float | None = None):
        self.world, self.seed, self.cfg = world, seed, cfg
        self.sources = parse_sources(sources)
        parts, indexes, rates = [], [], set()
        for url, _ in self.sources:
            ds = open_dataset(url, storage_options, direct_http=cfg.s3_direct_http, budget_s=cfg.retry_budget_s)
            checks = [c for c in CHECK_COLUMNS if cfg.check_transcripts or c != "text"]
            table = ds.read_index(columns=list(PLAN_COLUMNS) + ["sample_rate_hz", *checks])
            rates.update(np.unique(table.column("sample_rate_hz").to_numpy()).tolist())
            parts.append(ds)
            indexes.append(PlanIndex.from_table(table))
        if len(rates) > 1:
            raise StreamError(f"the mixture {[u for u, _ in self.sources]} mixes sample rates {sorted(rates)}; "
                              "repack with one `shardtrain pack --sample-rate`")
        self.sample_rate_hz = int(rates.pop()) if rates else 16000
        counts = [len(d.shards) for d in parts]
        base = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        remote = [d.url for d in parts if not storage.is_local(d.url)]
        self.ds = MixedDataset(  # type: ignore[assignment]
            url=remote[0] if remote else parts[0].url, parts=tuple(parts), base=base, storage_options=storage_options,
            shards=[dataclasses.replace(sh, name=f"d{i}/{sh.name}") for i, d in enumerate(parts) for sh in d.shards])
        over = [cost_s(ix.duration_s, cfg.bucket) > cfg.bucket.max_batch_seconds for ix in indexes]
        for (url, _), o in zip(self.sources, over):
            if o.any():
                log.warning("%s: %d utterances are longer than max_batch_seconds=%g and are left out of every epoch",
                            url, int(o.sum()), cfg.bucket.max_batch_seconds)
        self.too_long_per_epoch = int(sum(o.sum() for o in over))
        self.mix = MixIndex(indexes, [np.flatnonzero(~o) for o in over], [w for _, w in self.sources], seed,
                            None if epoch_hours is None else epoch_hours * 3600.0, base)
        self.idx = self.mix  # type: ignore[assignment]  # an IndexSource: the ChunkStream plans per epoch
        h = hashlib.sha1(json.dumps([[ix.fingerprint(), w] for ix, (_, w) in zip(indexes, self.sources)]
                                    + [epoch_hours]).encode())
        self.fingerprint = "mix-" + h.hexdigest()[:16]
        self.counters: dict = {"samples": 0, "audio_seconds": 0.0, "batches": 0, "skipped": 0, "too_long": 0,
                         "dataset_seconds": [0.0] * len(self.sources)}
        self.stage_s = {"read": 0.0, "parse": 0.0, "decode": 0.0, "batch": 0.0, "collate": 0.0}
        self.skipped_keys: list[dict] = []
        self.cursor = _Cursor(0, 0)
        self._bucket_fingerprint = _cfg_fingerprint(cfg.bucket)
        self._rows_of: tuple[int, tuple, list[np.ndarray]] | None = None
        if state is not None:
            self._load_state(state)

    @property
    def dataset_names(self) -> list[str]:
        return [url for url, _ in self.sources]

    def steps_per_epoch(self, epoch: int = 0) -> int:
        return epoch_plan(self.mix(epoch), self.seed, epoch, self.world.world_size, self.cfg.bucket).steps

    def _shards_ahead(self, limit: int) -> list[int]:
        seen: dict[int, None] = {}
        for epoch, _, chunk, _ in _chunk_schedule(self.mix, self.seed, self.world, self.cfg, self.cursor):
            if epoch != self.cursor.epoch or len(seen) >= limit:
                break
            seen.update(dict.fromkeys(np.unique(self.mix(epoch).shard[chunk.rows]).tolist()))
        return list(seen)[:limit]

    def _batch_rows(self, epoch: int, step: int) -> np.ndarray:
        """Virtual rows of this rank's batch `step` of `epoch` (the plan, re-made once per epoch and chain)."""
        chain = self.cursor.chain if epoch == self.cursor.epoch else ()
        if self._rows_of is None or self._rows_of[:2] != (epoch, chain):
            plan = epoch_plan(self.mix(epoch), self.seed, epoch, self.world.world_size, self.cfg.bucket, chain)
            self._rows_of = (epoch, chain, [b for c in plan.rank_chunks(self.world.rank) for b in c.batches])
        return self._rows_of[2][step]

    def __iter__(self) -> Generator[tuple[Batch, dict], None, None]:
        for batch, _ in super().__iter__():
            idx, source = self.mix.select(batch.epoch)
            rows = self._batch_rows(batch.epoch, batch.step)
            sec = np.bincount(source[rows], weights=idx.duration_s[rows], minlength=len(self.sources))
            self.counters["dataset_seconds"] = [a + float(b) for a, b in zip(self.counters["dataset_seconds"], sec)]
            yield batch, self.state_dict()


def build_mixture(sources: Sequence, *, world: World, seed: int, cfg: StreamConfig, state: dict | None = None,
                  storage_options: dict | None = None, epoch_hours: float | None = None) -> MixtureLoader:
    """The loader for one rank over [(url, weight), ...]: per epoch each dataset contributes weight / sum(weights)
    of the audio (of all datasets together, or `epoch_hours`), every sample of a dataset once before any repeats."""
    return MixtureLoader(sources, world=world, seed=seed, cfg=cfg, state=state, storage_options=storage_options,
                         epoch_hours=epoch_hours)
