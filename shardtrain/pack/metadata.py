"""Folders of audio described by one metadata table: LJSpeech and Hugging Face audiofolder layouts.

    ljspeech     folder with metadata.csv (no header, `id|text|normalized text`) and wavs/<id>.wav;
                 text = the normalized column when not empty, else the raw one
    audiofolder  folder with metadata.csv / metadata.tsv / metadata.jsonl (`file_name` + `transcription`/`text`
                 columns, paths relative to the folder): read as that csv/tsv/jsonl manifest

Costs one small read (the first line of metadata.csv) and one existence check when a folder is detected; the table
is then streamed line by line. Other column names are mapped with `--audio-column` / `--text-column` /
`--delimiter` (sources.Columns).
"""
from __future__ import annotations

import posixpath
from collections.abc import Iterator

from shardtrain import storage
from shardtrain.pack.inputfs import audio_ref, open_text
from shardtrain.pack.item import Item, Reject, split_lines
from shardtrain.pack.safeio import MAX_TABLE_BYTES, InputFileError, read_bounded

METADATA_FILES = (("metadata.csv", "csv"), ("metadata.tsv", "tsv"), ("metadata.jsonl", "jsonl"))
"""A folder holding one of these (first wins) is read through it, with this manifest format."""


def metadata_file(fs: storage.FileSystem, folder: str) -> tuple[str, str] | None:
    """(path, format) of the folder's metadata table: format "ljspeech" for an LJSpeech metadata.csv (its first
    line's id names a wavs/<id>.wav), else the table's own csv/tsv/jsonl; None without one."""
    for name, fmt in METADATA_FILES:
        path = posixpath.join(folder, name)
        if fs.isfile(path):
            return path, "ljspeech" if fmt == "csv" and _is_ljspeech(fs, folder, path) else fmt
    return None


def _is_ljspeech(fs: storage.FileSystem, folder: str, path: str) -> bool:
    with open_text(fs, path) as f:
        first = f.readline().rstrip("\r\n")
    fields = first.split("|")
    return len(fields) in (2, 3) and fs.isfile(posixpath.join(folder, "wavs", fields[0] + ".wav"))


def iter_ljspeech(fs: storage.FileSystem, folder: str, path: str) -> Iterator[Item | Reject]:
    """One Item per `id|text[|normalized]` line of LJSpeech's metadata.csv (no header, no quoting: transcripts
    hold `"`), audio wavs/<id>.wav. A line with another field count is a `bad_row` Reject; a wav that is not there
    becomes a missing_audio reject when the packer probes it."""
    try:
        text = read_bounded(fs, path, MAX_TABLE_BYTES).decode("utf-8-sig")
    except (InputFileError, UnicodeDecodeError) as e:  # the whole corpus is this table: refuse it in one line
        raise ValueError(f"LJSpeech metadata {path}: {e}") from None
    for n, line in enumerate(split_lines(text), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        fields = line.split("|")
        if len(fields) not in (2, 3) or not fields[0].strip():
            yield Reject(where, where, f"bad_row: line {n} has {len(fields)} '|' fields, LJSpeech has id|text|normalized")
            continue
        utt = fields[0].strip()
        said = fields[2] if len(fields) == 3 and fields[2].strip() else fields[1]
        yield Item(id=utt, audio=audio_ref(fs, posixpath.join(folder, "wavs", utt + ".wav")), text=said.strip())
