"""Per-item checks that keep a pack from writing what its readers or a CTC model cannot use.

    target_problem(text, duration_s, max_chars_per_s) -> (reason, detail) | None     CTC-impossible transcripts
    item_problem(cfg, item, duration_s)  -> (reason, detail) | None      in scan, before any audio is decoded
    stored_problem(item, stored, audio_bytes, json_bytes) -> ...         in the shard task, after encoding

Each failure is one reject row with its reason (rejects.jsonl), never a dataset the reader refuses as a whole
(format/limits.py holds the limits both sides import) and never a sample that trains nothing.

CTC needs at least one output frame per label (two for a repeated label), and pack does not know the model's frame
rate, so the bound is on characters per second of audio, set far above any real speech: read speech runs ~15
characters a second (LibriSpeech, spaces included), fast conversational speech and auctioneers ~25-30. The
default 50 characters a second + 20 characters rejects only transcripts that cannot belong to their audio (a
0.3 s clip with a 200-character transcript: 667 a second), a mis-segmented or mis-paired item; a model whose frame
rate is below what real speech needs is the trainer's check (it knows the frame rate). Costs a `len` per item.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from shardtrain.format.limits import row_problem

if TYPE_CHECKING:
    from shardtrain.format.audio import AudioInfo
    from shardtrain.pack.config import PackConfig
    from shardtrain.pack.item import Item

TARGET_SLACK_CHARS = 20
"""Characters allowed on top of rate x duration: clips are often cut tight around a short phrase ("thank you very
much"), so below ~0.5 s the per-second rate alone would judge the cut, not the transcript."""


class ItemError(ValueError):
    """An item that breaks a format limit, found after encoding; `reason` is its reject code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def target_problem(text: str, duration_s: float, max_chars_per_s: float | None) -> tuple[str, str] | None:
    """("impossible_target", detail) when `text` has more characters than `max_chars_per_s` x duration +
    TARGET_SLACK_CHARS; None when it fits or the bound is off (None or 0)."""
    if not max_chars_per_s:
        return None
    limit = max_chars_per_s * duration_s + TARGET_SLACK_CHARS
    if len(text) <= limit:
        return None
    return "impossible_target", (f"{len(text)} characters in {duration_s:.2f} s ({len(text) / max(duration_s, 1e-9):.0f}"
                                 f" a second), more than --max-chars-per-s {max_chars_per_s:g} x duration + "
                                 f"{TARGET_SLACK_CHARS}: no CTC model can align it; check the transcript and the "
                                 "segment (--max-chars-per-s 0 turns the check off)")


def _strings(item: Item) -> dict[str, str | None]:
    """The index's string columns of an item, as pack will write them."""
    return {"text": item.text, "speaker": None if item.speaker is None else str(item.speaker),
            "language": None if item.language is None else str(item.language), "source": str(item.audio)}


def item_problem(cfg: PackConfig, item: Item, duration_s: float) -> tuple[str, str] | None:
    """The first limit (format/limits) or CTC bound an accepted item breaks, from its metadata alone."""
    return (row_problem(_strings(item), duration_s, 1, 1)
            or target_problem(item.text or "", duration_s, cfg.max_chars_per_s))


def stored_problem(item: Item, stored: AudioInfo, audio_bytes: int, json_bytes: int) -> tuple[str, str] | None:
    """The first limit the encoded sample breaks (stored rate, channels, member sizes), or None."""
    return row_problem(_strings(item), stored.duration_s, stored.sample_rate_hz, stored.channels,
                       audio_bytes=audio_bytes, json_bytes=json_bytes)
