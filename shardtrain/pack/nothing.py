"""The one line a pack that accepted no utterance stops with: how many rejects, the top reasons with an example,
and the hint that fixes the most common one (a folder of audio with a metadata table under other column names, a
manifest whose columns are not recognised, audio paths that do not resolve).

Costs one listing of the input folder's top level, only on this error path.
"""
from __future__ import annotations

import posixpath
from collections import Counter

from shardtrain import storage
from shardtrain.format.safe import printable
from shardtrain.pack.shard_task import PackError

TABLE_SUFFIXES = (".csv", ".tsv", ".txt", ".jsonl")


class NothingAccepted(PackError):
    """Every utterance was rejected: no dataset is written. A runtime outcome of the input (exit status 1, like
    inputs skipped), told apart from PackError's refusals of flags and OUTPUT."""


def _tables_beside(input: str, storage_options: dict | None) -> list[str]:
    """Manifest-like files at the top of the input folder (what a user meant to describe the audio with)."""
    try:
        fs, path = storage.fs_and_path(input, storage_options)
        if not fs.isdir(path):
            return []
        return sorted(n for n in (p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
                      if n.lower().endswith(TABLE_SUFFIXES))
    except OSError:
        return []


def _hint(top: str, input: str, source_format: str, storage_options: dict | None) -> str:
    if top == "missing_transcript" and source_format in ("auto", "dir"):
        tables = _tables_beside(input, storage_options)
        if tables:
            table = posixpath.join(input.rstrip("/"), tables[0])
            return (f"the folder holds {tables[0]}: pass it as INPUT, `shardtrain pack {table} OUTPUT "
                    "--audio-column COL --text-column COL [--delimiter CHAR]`")
        return ("a folder of audio needs x.txt beside x.wav, or a metadata.csv (file_name,transcription; or "
                "LJSpeech id|text|normalized with wavs/)")
    if top in ("missing_path", "missing_transcript", "empty_transcript"):
        return "name the manifest's columns with --audio-column COL --text-column COL (and --delimiter CHAR)"
    if top in ("missing_audio", "missing_file", "unreadable_audio"):
        return "relative audio paths are read against the manifest's folder; check the first reject's path"
    return "see each reason in the list above; --min-duration-s 0 / --max-chars-per-s 0 relax the length checks"


def nothing_accepted_message(input: str, source_format: str, rejects: list[dict],
                             storage_options: dict | None = None) -> str:
    """`no utterance accepted from INPUT (N rejects: reason x n (e.g. detail), ...); HINT; no dataset written`."""
    counts = Counter(r["reason"] for r in rejects)
    shown = []
    for reason, n in counts.most_common(3):
        first = next(r for r in rejects if r["reason"] == reason)
        example = printable(str(first.get("detail") or first.get("path") or first.get("id")), 120)
        shown.append(f"{reason} x{n} (e.g. {example})")
    what = "; ".join(shown) if shown else "the input listed no utterance"
    top = counts.most_common(1)[0][0] if counts else ""
    return (f"no utterance accepted from {printable(input, 200)} ({len(rejects)} rejects: {what}); "
            f"{_hint(top, input, source_format, storage_options)}; no dataset written")
