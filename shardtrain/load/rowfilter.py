"""Load-time row filters (StreamConfig.min_duration_s, max_duration_s, speakers, exclude_speakers): one boolean
mask over a dataset's index, computed once when the planner opens it, that every row planner (rows, and the
mixture by rows) leaves out before planning. Filtered rows are counted (`filtered`, logged once), so the epoch's
exactly-once guarantee holds over the kept rows and `shardtrain plan`/`ledger` see the same selection.

Costs one pass over the duration column; the speaker column (~20 B a row while the mask is made, not kept) is read
only when a speaker filter is set. The block planner does not implement filters: a filter set there is refused.
"""
from __future__ import annotations

import json
import logging

import numpy as np

from shardtrain.load.config import StreamConfig

log = logging.getLogger(__name__)


def active(cfg: StreamConfig) -> bool:
    """Whether any load-time filter is set."""
    return (cfg.min_duration_s is not None or cfg.max_duration_s is not None or bool(cfg.speakers)
            or bool(cfg.exclude_speakers))


def needs_speaker(cfg: StreamConfig) -> bool:
    return bool(cfg.speakers) or bool(cfg.exclude_speakers)


def fingerprint(cfg: StreamConfig) -> dict | None:
    """The filter's identity for the loader state (None when no filter is set, so old states still match)."""
    if not active(cfg):
        return None
    return {"min_duration_s": cfg.min_duration_s, "max_duration_s": cfg.max_duration_s,
            "speakers": sorted(cfg.speakers), "exclude_speakers": sorted(cfg.exclude_speakers)}


def describe(cfg: StreamConfig) -> str:
    return json.dumps({k: v for k, v in (fingerprint(cfg) or {}).items() if v not in (None, [])})


def drop_mask(cfg: StreamConfig, duration_s: np.ndarray, speaker=None) -> np.ndarray:
    """True for every row the filters leave out. `speaker`: the index's speaker column (a pyarrow array or list),
    required when a speaker filter is set."""
    dur = np.asarray(duration_s)
    drop = np.zeros(len(dur), bool)
    if cfg.min_duration_s is not None:
        drop |= dur < cfg.min_duration_s
    if cfg.max_duration_s is not None:
        drop |= dur > cfg.max_duration_s
    if needs_speaker(cfg):
        import pyarrow as pa
        import pyarrow.compute as pc

        spk = speaker if isinstance(speaker, (pa.Array, pa.ChunkedArray)) else pa.array(speaker, pa.string())
        if cfg.speakers:
            drop |= ~np.asarray(pc.fill_null(pc.is_in(spk, pa.array(list(cfg.speakers))), False), bool)
        if cfg.exclude_speakers:
            drop |= np.asarray(pc.fill_null(pc.is_in(spk, pa.array(list(cfg.exclude_speakers))), False), bool)
    return drop


def log_filtered(what: str, cfg: StreamConfig, filtered: int, rows: int) -> None:
    if active(cfg):
        log.warning("%s: %d of %d utterances left out of every epoch by the load-time filters %s", what, filtered,
                    rows, describe(cfg))


def refuse_blocks(cfg: StreamConfig, why: str) -> None:
    """The block planner plans from a per-node block table without a row mask: refuse filters there by name."""
    if active(cfg):
        raise ValueError(f"{why}, which does not implement load-time filters ({describe(cfg)}); set "
                         "stream.planner=rows or leave out stream.min_duration_s/max_duration_s/speakers/"
                         "exclude_speakers")
