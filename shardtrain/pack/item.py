"""What every input reader yields (sources, corpora, metadata): `Item` (one utterance to pack) or `Reject` (an
entry that cannot become one, with a reason code), and the small line/row helpers the readers share.

Plain frozen dataclasses and pure functions: no I/O, no imports from the rest of pack (so every reader can import
this module without an import circle).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Item:
    """One utterance to pack: where its audio is and what is known about it without decoding."""

    id: str
    """Stable original id: relative path without extension, utterance id or supervision id."""
    audio: str
    """Local path or fsspec URL of the audio file."""
    text: str | None
    """Transcript; None when the source has none (an empty string is kept: the packer decides)."""
    start_s: float = 0.0
    """Segment start within the audio file."""
    duration_s: float | None = None
    """Segment length when the source says so (Lhotse supervision, manifest duration), else None."""
    speaker: str | None = None
    language: str | None = None
    extra: tuple[tuple[str, Any], ...] = ()
    """Extra manifest fields, JSON-able values, sorted by name."""

    def __reduce__(self):  # see format/audio.py AudioInfo.__reduce__
        return (Item, (self.id, self.audio, self.text, self.start_s, self.duration_s, self.speaker, self.language,
                       self.extra))


@dataclass(frozen=True, slots=True)
class Reject:
    """An input entry that cannot become an Item; `reason` is `code: details`, e.g. `missing_transcript: no x.txt`."""

    id: str
    path: str
    reason: str


AUDIO_EXTENSIONS = (".flac", ".wav", ".opus", ".ogg", ".mp3")
"""Audio file suffixes an input folder is searched for."""

INPUT_KINDS = ("a .tsv/.csv/.jsonl/.jsonl.gz manifest file, a LibriSpeech folder (<spk>/<chapter>/*.trans.txt), "
               f"a folder of audio files ({'/'.join(AUDIO_EXTENSIONS)}) with same-stem .txt transcripts or a "
               "metadata.csv (Hugging Face audiofolder, LJSpeech), recordings with same-stem .vtt subtitles, a Kaldi "
               "data dir (wav.scp + text), a Hugging Face dataset (.arrow/.parquet, a save_to_disk folder, or a "
               "DatasetDict folder with dataset_dict.json and --split) or a Common Voice release "
               "(clips/ + validated.tsv)")
"""What `pack` reads, for the error on an input it cannot find or recognise."""


def missing_input_message(input: str) -> str:
    """The line for an INPUT where nothing exists (pure: the CLI says it before importing any reader)."""
    return f"input {input!r} does not exist; expected {INPUT_KINDS}"


def split_lines(text: str) -> list[str]:
    """Lines of a line-oriented manifest: split at "\\n" only (a "\\r\\n" ending loses its "\\r"). Never
    `str.splitlines()`, which also splits at U+2028, U+0085, form feeds and lone "\\r" that are part of a
    transcript: the tail would become a bogus line and the transcript would be packed cut short."""
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def table_lines(f: Iterable[str]) -> Iterator[str]:
    """The lines of a csv/tsv table opened with newline="" (inputfs.open_text), ended at "\n" only, each lone
    "\r" inside a line turned into a space, for `csv.reader`. Why: the csv module ends a record at a lone "\r",
    so a transcript holding one was packed cut short ("LONE\rRETURN" as "LONE") and its tail became a bad_row
    (split_lines says the same of line manifests). A space is what the packer folds any whitespace run to anyway
    (scan.collapse_whitespace), so the stored text is the one a "\n"-only reading gives. A table whose first line
    ends in a lone "\r" (classic Mac line ends) keeps "\r" as its line break."""
    it = iter(f)
    first = next(it, "")
    if first.endswith("\r"):
        yield first
        yield from it
        return
    buf = first
    for piece in it:  # newline="" splits at "\r" too, keeping it: join the pieces up to the next "\n"
        if buf.endswith("\n"):
            yield _lone_cr_to_space(buf)
            buf = ""
        buf += piece
    if buf:
        yield _lone_cr_to_space(buf)


def _lone_cr_to_space(line: str) -> str:
    if "\r" not in line:
        return line
    body, end = (line[:-2], "\r\n") if line.endswith("\r\n") else (line, "")
    return body.replace("\r", " ") + end


def opt_str(v: Any) -> str | None:
    """An optional text field: None for a missing or empty value, else its str()."""
    return None if v is None or v == "" else str(v)


def table_rows(reader: Any, path: str, header: list[str]) -> Iterator[tuple[str, dict] | Reject]:
    """(where, {column: value}) per non-blank row of a `csv.reader`; a row with the wrong field count is a Reject
    (the reader's line_num names it).

    A record the reader cannot parse (a `strict` reader: a quote that opens a field and never closes, text after a
    closing quote) is a `bad_row` Reject for every line it took. Why: a lenient reader lets one stray opening quote
    swallow every following line, up to the next quote or the end of the file, into that row's transcript, and the
    rows it swallowed were never counted (a CSV of 4 rows packed 1, under a 3-row transcript)."""
    import csv  # noqa: PLC0415 (this module is imported by every reader; only tables need csv)

    last = reader.line_num
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            if reader.line_num == last:  # nothing consumed: the reader cannot go on
                raise ValueError(f"{path}: line {last + 1}: {e}") from None
            for k in range(last + 1, reader.line_num + 1):
                where = f"{path}:{k}"
                yield Reject(where, where, f"bad_row: line {k} is in a record from line {last + 1} that does not "
                                           f"parse ({e}): a field opened with a quote must close with one, quotes "
                                           "inside it doubled")
            last = reader.line_num
            continue
        last = reader.line_num
        where = f"{path}:{last}"
        if not any(c.strip() for c in row):
            continue
        if len(row) != len(header):
            yield Reject(where, where, f"bad_row: line {last} has {len(row)} fields, header has {len(header)}")
            continue
        yield where, dict(zip(header, row))
