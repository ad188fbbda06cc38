"""WebVTT input: a folder of `<name>.<audio ext>` + `<name>.vtt` -> one Item per cue (a long recording cut into
utterances the way Kaldi `segments` cut one: Item.start_s/duration_s, the recording read once per cue's range).

A cue is `[id]\\nSTART --> END [settings]\\npayload...`; times are `[HH:]MM:SS.mmm`. The payload's lines are joined
with spaces, tags (`<i>`, `<c.x>`, timestamps) dropped and entities (&amp; &lt; &gt; &nbsp; &lrm; &rlm;) decoded;
a `<v Name>` voice tag gives the speaker. NOTE, STYLE and REGION blocks are skipped. A cue with bad times (END not
after START) is a Reject (`bad_segment`) naming the file and line; an empty cue text a Reject (`empty_transcript`);
a .vtt without a same-stem audio file `missing_audio`, one that is not WebVTT `bad_file`; a cue past the
recording's end is the packer's `segment_out_of_range`. Item ids are
`<name>-<cue number, 5 digits>` (cue numbers count from 0 in file order), with extra `recording=<name>`.
Costs one bounded read per .vtt (safeio: at most MAX_TABLE_BYTES) and a folder listing.
"""
from __future__ import annotations

import html
import os
import posixpath
import re
from collections.abc import Iterator

from shardtrain.pack.safeio import MAX_TABLE_BYTES, InputFileError, read_bounded
from shardtrain import storage
from shardtrain.pack.inputfs import audio_ref
from shardtrain.pack.item import AUDIO_EXTENSIONS, Item, Reject

_TIME = r"(?:(\d+):)?([0-5]\d):([0-5]\d)\.(\d{3})"
_TIMING = re.compile(rf"^{_TIME}\s+-->\s+{_TIME}(?:\s+.*)?$")
_VOICE = re.compile(r"<v(?:\.[^\s>]*)?\s+([^>]+)>")
_TAG = re.compile(r"<[^>]*>")


def _seconds(h: str | None, m: str, s: str, ms: str) -> float:
    return int(h or 0) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000.0


def parse_cues(text: str) -> list[tuple[int, float | None, float | None, str, str | None]]:
    """(line number, start s, end s, text, speaker) per cue of a WebVTT document, in file order; start/end None
    for a cue whose timing line does not parse. ValueError when the document does not start with WEBVTT."""
    lines = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if not lines or not lines[0].startswith("WEBVTT"):
        raise ValueError("not a WebVTT file: the first line must start with WEBVTT")
    cues: list[tuple[int, float | None, float | None, str, str | None]] = []
    i = 1
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        block_start = i
        while i < len(lines) and lines[i].strip():
            i += 1
        block = lines[block_start:i]
        if block[0].startswith(("NOTE", "STYLE", "REGION")) and "-->" not in block[0]:
            continue
        t = 0 if "-->" in block[0] else 1
        if t >= len(block) or "-->" not in block[t]:
            cues.append((block_start + 1, None, None, "", None))
            continue
        m = _TIMING.match(block[t].strip())
        payload = " ".join(block[t + 1:])
        voice = _VOICE.search(payload)
        words = " ".join(html.unescape(_TAG.sub("", payload)).replace("\u200e", "").replace("\u200f", "").split())
        start, end = (_seconds(*m.groups()[:4]), _seconds(*m.groups()[4:])) if m else (None, None)
        cues.append((block_start + t + 1, start, end, words, voice.group(1).strip() if voice else None))
    return cues


def has_vtt(fs: storage.FileSystem, path: str) -> bool:
    """Whether the folder holds a `.vtt` beside a same-stem audio file (names only)."""
    names = _names(fs, path)
    stems = {n.rsplit(".", 1)[0] for n in names if n.lower().endswith(AUDIO_EXTENSIONS)}
    return any(n.lower().endswith(".vtt") and n[:-4] in stems for n in names)


def _names(fs: storage.FileSystem, path: str) -> list[str]:
    if storage.fs_is_local(fs):
        return sorted(os.listdir(path))
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def iter_vtt(fs: storage.FileSystem, root: str) -> Iterator[Item | Reject]:
    """One Item per cue of every `<name>.vtt` in `root`, cut from `<name>.<audio ext>`; by name, then cue order."""
    names = _names(fs, root)
    audio: dict[str, str] = {}
    for n in names:
        if n.lower().endswith(AUDIO_EXTENSIONS):
            audio.setdefault(n.rsplit(".", 1)[0], n)
    for n in names:
        if not n.lower().endswith(".vtt"):
            continue
        stem, vtt = n[:-4], posixpath.join(root, n)
        if stem not in audio:
            yield Reject(stem, vtt, f"missing_audio: no {stem}.<{'|'.join(e[1:] for e in AUDIO_EXTENSIONS)}> beside it")
            continue
        try:
            cues = parse_cues(read_bounded(fs, vtt, MAX_TABLE_BYTES).decode("utf-8"))
        except (InputFileError, UnicodeDecodeError, ValueError) as e:
            yield Reject(stem, vtt, f"bad_file: {e}")
            continue
        yield from _cue_items(stem, audio_ref(fs, posixpath.join(root, audio[stem])), vtt, cues)


def _cue_items(stem: str, ref: str, vtt: str, cues: list) -> Iterator[Item | Reject]:
    for k, (line, start, end, words, speaker) in enumerate(cues):
        uid = f"{stem}-{k:05d}"
        if start is None or end is None or end <= start:
            yield Reject(uid, vtt, f"bad_segment: cue at line {line} needs START --> END with END > START "
                                   "([HH:]MM:SS.mmm)")
            continue
        if not words:
            yield Reject(uid, vtt, f"empty_transcript: cue at line {line} has no text")
            continue
        yield Item(id=uid, audio=ref, text=words, start_s=start, duration_s=end - start, speaker=speaker,
                   extra=(("recording", stem),))
