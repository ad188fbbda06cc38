"""Parts: the unit of listing work for a pack engine (local pool or Ray), cut from an input in input order.

    input -> iter_parts -> SourcePart(index, entries | items) ... -> part_items(part) -> Item | Reject (input order)

Folder and LibriSpeech inputs are listed on the driver (paths only) and their transcripts are read where the part
runs; manifest-style inputs are one stream, parsed on the driver and cut into parts of parsed items. The
concatenation of all parts' items is exactly `sources.iter_items(input)`.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

from shardtrain.pack.inputfs import input_fs
from shardtrain.pack.item import Item, Reject
from shardtrain.pack.sources import (_dir_entries, _dir_items, _iter_librispeech, _librispeech_transcripts,
                                     iter_items, resolve_format)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SourcePart:
    """A contiguous run of the input, in input order; the concatenation of all parts is `iter_items`.

    "dir" and "librispeech" parts carry what is still to be read (dir entries; chapter `.trans.txt` files), so the
    per-file reads happen where the part runs (a worker); manifest parts carry items the driver already parsed
    (a manifest is one stream: it cannot be split without reading it)."""

    index: int
    input: str
    source_format: str
    """Resolved format (never "auto")."""
    entries: tuple = ()
    items: tuple = ()


def iter_parts(input: str, source_format: str = "auto", storage_options: dict | None = None,
               part_items: int = 1024, *, text_column: str | None = None, split: str | None = None,
               audio_column: str | None = None, delimiter: str | None = None) -> Iterator[SourcePart]:
    """Split `input` into SourceParts of about `part_items` utterances (LibriSpeech: whole chapters); the other
    formats (manifests, Kaldi, Hugging Face, Common Voice) are read here by iter_items and cut into parts."""
    source_format = resolve_format(input, source_format, storage_options)
    if split is not None and source_format != "hf":
        raise ValueError(f"--split {split} applies to a Hugging Face DatasetDict; {input!r} is {source_format!r}")
    fs, path = input_fs(input, storage_options)
    if source_format in ("dir", "librispeech"):
        todo: list = _dir_entries(fs, path) if source_format == "dir" else _librispeech_transcripts(fs, path)
        step = part_items if source_format == "dir" else max(1, part_items // 64)  # ~100 utterances a chapter
        for n, i in enumerate(range(0, len(todo), step)):
            yield SourcePart(index=n, input=input, source_format=source_format, entries=tuple(todo[i: i + step]))
        return
    chunk: list = []
    n = 0
    for x in iter_items(input, source_format, storage_options, text_column=text_column, split=split,
                        audio_column=audio_column, delimiter=delimiter):
        chunk.append(x)
        if len(chunk) >= part_items:
            yield SourcePart(index=n, input=input, source_format=source_format, items=tuple(chunk))
            chunk, n = [], n + 1
    if chunk:
        yield SourcePart(index=n, input=input, source_format=source_format, items=tuple(chunk))


def part_items(part: SourcePart, storage_options: dict | None = None) -> Iterator[Item | Reject]:
    """The Items and Rejects of one part, in input order (reads transcripts for dir/LibriSpeech parts)."""
    if part.source_format not in ("dir", "librispeech"):
        return iter(part.items)
    fs, path = input_fs(part.input, storage_options)
    if part.source_format == "dir":
        return _dir_items(fs, part.entries)
    return _iter_librispeech(fs, path, list(part.entries))
