"""The limits of shard format v1: one set, imported by the writer (pack) and by every reader.

    per value   key, text, speaker, language, source (UTF-8 bytes)    index strings   (indexread, pack)
    per member  audio bytes, `<key>.json` bytes                          tar members     (validate, reader, pack)
    per row     duration_s, sample_rate_hz, channels                     index numbers   (validate, pack)
    row_problem(...) -> (reason, detail) | None                          pack's per-item check before writing

Why one module: a reader refuses a whole dataset when one row breaks a limit (it cannot tell a hostile index from
a careless one), so the packer must refuse that one item instead, per item, with a reason in rejects.jsonl. Both
sides import these names; no second copy of a number exists to drift. Every bound is far above real speech data
and is there to bound what a reader allocates for untrusted metadata (format/validate.py, format/indexread.py).
Only per-value bounds exist: an aggregate bound (e.g. a mean per row) would refuse datasets the writer could only
have avoided by rejecting items for what *other* items hold; a column's memory is bounded by rows x its per-value
bound, the same bound the index footer check puts on its stored size.
"""
from __future__ import annotations

MAX_STRING_BYTES = {"key": 80, "codec": 16, "text": 64 << 10, "speaker": 1024, "language": 64, "source": 4096}
"""Longest value (UTF-8 bytes) of each string column of the index; a longer one refuses the index (reader) or
the item (pack: `text_too_long`, `field_too_long`). 64 KiB of transcript is ~70 minutes of speech at 15
characters a second: a longer utterance is a whole recording that should be segmented first."""
OTHER_STRING_BYTES = 4096
"""Per value, for a string column outside the schema (an extra column some tool added)."""
MAX_AUDIO_BYTES = 1 << 30
"""One audio member. A reader allocates row sizes, so a hostile index cannot make it allocate more than this;
pack rejects a larger stored member (`audio_too_large`: ~9 h of 16 kHz 16-bit FLAC)."""
MAX_JSON_BYTES = 1 << 20
"""One `<key>.json` member (text + metadata; real ones are a few hundred bytes)."""
MAX_DURATION_S = 86_400.0
MAX_SAMPLE_RATE_HZ = 768_000
MAX_CHANNELS = 64


def string_bound(name: str) -> int:
    """The per-value bound of an index string column (OTHER_STRING_BYTES for a column outside the schema)."""
    return MAX_STRING_BYTES.get(name, OTHER_STRING_BYTES)


def row_problem(strings: dict[str, str | None], duration_s: float, sample_rate_hz: int, channels: int,
                audio_bytes: int | None = None, json_bytes: int | None = None) -> tuple[str, str] | None:
    """(reason, detail) for the first limit one sample breaks, or None: what pack checks per item so the reader
    never refuses the dataset it wrote. `strings`: index column -> value (None: absent). Costs one UTF-8 encode
    per string (~1 us for a sentence)."""
    for name, value in strings.items():
        if value is None:
            continue
        n = len(value.encode("utf-8", "surrogatepass"))
        if n > string_bound(name):
            reason = "text_too_long" if name == "text" else "field_too_long"
            return reason, (f"{name} of {n} bytes, more than the {string_bound(name)} a reader accepts "
                            "(format/limits.MAX_STRING_BYTES)" + ("; segment the recording" if name == "text" else ""))
    if not 0 <= duration_s <= MAX_DURATION_S:
        return "too_long", f"{duration_s:.1f} s, more than the {MAX_DURATION_S:.0f} s a reader accepts"
    if not 1 <= sample_rate_hz <= MAX_SAMPLE_RATE_HZ:
        return "unsupported_rate", f"{sample_rate_hz} Hz, outside [1, {MAX_SAMPLE_RATE_HZ}] a reader accepts"
    if not 1 <= channels <= MAX_CHANNELS:
        return "unsupported_channels", f"{channels} channels, outside [1, {MAX_CHANNELS}] a reader accepts"
    if audio_bytes is not None and audio_bytes > MAX_AUDIO_BYTES:
        return "audio_too_large", f"{audio_bytes} bytes of stored audio, more than the {MAX_AUDIO_BYTES} a reader accepts"
    if json_bytes is not None and json_bytes > MAX_JSON_BYTES:
        return "field_too_long", f"<key>.json of {json_bytes} bytes, more than the {MAX_JSON_BYTES} a reader accepts"
    return None
