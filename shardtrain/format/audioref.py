"""Audio references: `<path or URL>#bytes=START-END` names audio stored as bytes [START, END) of a larger file (an
Arrow file of a Hugging Face dataset, a Kaldi ark), so nothing is copied out before packing or transcribing.

One parser and one bound for everything that opens such a reference (pack's probe and transcode, infer's inputs):
a range past MAX_RANGE_BYTES is refused before anything is read or allocated, and a local file must be a regular
file (a FIFO would block the open).
"""
from __future__ import annotations

import os
import re
import stat

from shardtrain import storage
from shardtrain.format.audio import AudioError

MAX_RANGE_BYTES = 1 << 30
"""Largest `#bytes=` range read into memory (1 GiB: ~9 h of 16 kHz 16-bit audio); larger is `range_too_large`."""
_BYTE_RANGE = re.compile(r"^(?P<url>.+)#bytes=(?P<start>\d+)-(?P<end>\d+)$")


def byte_range_ref(url: str, start: int, end: int) -> str:
    return f"{url}#bytes={start}-{end}"


def parse_byte_range(ref: str) -> tuple[str, int, int] | None:
    """(url, start, end) of a `#bytes=` reference, None for a plain path or URL; AudioError for an empty, reversed
    or too large range."""
    m = _BYTE_RANGE.match(ref)
    if m is None:
        return None
    url, start, end = m["url"], int(m["start"]), int(m["end"])
    if end <= start:
        raise AudioError("empty_audio", f"{ref}: empty byte range")
    if end - start > MAX_RANGE_BYTES:
        raise AudioError("range_too_large", f"{ref}: {end - start} bytes > {MAX_RANGE_BYTES}")
    return url, start, end


def local_path(ref: str) -> str | None:
    """The local path of a plain path or file:// URL; None for another scheme."""
    if ref.startswith("file://"):
        return ref[len("file://"):]
    return None if "://" in ref else ref


def read_byte_range(ref: str, storage_options: dict | None = None) -> bytes | None:
    """The bytes a `#bytes=` reference names (one ranged read), or None when `ref` is not one. AudioError:
    missing_file, not_a_file, truncated_audio (the file ends before END), range_too_large."""
    parsed = parse_byte_range(ref)
    if parsed is None:
        return None
    url, start, end = parsed
    local = local_path(url)
    try:
        if local is not None:
            if not stat.S_ISREG(os.stat(local).st_mode):  # a FIFO would block open() below
                raise AudioError("not_regular_file", f"{local} is not a regular file")
            with open(local, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
        else:
            data = storage.read_range(url, start, end, storage_options)
    except FileNotFoundError as e:
        raise AudioError("missing_file", f"{url} does not exist") from e
    if len(data) != end - start:
        raise AudioError("truncated_audio" if data else "empty_audio", f"{ref}: read {len(data)} of {end - start} bytes")
    return data
