"""Input formats -> `Item`s: the first stage of `pack`. Reads listings and manifests only, never audio samples.

    input (folder | .tsv/.csv/.jsonl[.gz] manifest | LibriSpeech tree | Lhotse CutSet .jsonl[.gz], any fsspec URL;
           Kaldi data dir | Hugging Face dataset | Common Voice release: see corpora.py)
      -> iter_items(...) -> Item(id, audio, text, start_s, duration_s, speaker, language, extra) | Reject(id, path, reason)

Bad inputs become `Reject`s (reason = snake_case code + ": details") rather than exceptions, so one broken line
or missing transcript never stops a pack of millions of files; the packer counts and reports them. Only a bad
`input` or `source_format` raises (ValueError naming what to change).

Costs: "dir" lists the whole tree once (one `find`) and reads one small `.txt` per audio file (one request each on
object storage); "librispeech" reads one `.trans.txt` per chapter and lists each chapter folder; manifests are
streamed line by line. Order is deterministic (sorted listings, manifest order) so packing is reproducible.
"""
from __future__ import annotations

import csv
import json
import logging
import os
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from shardtrain import storage
from shardtrain.pack import corpora, metadata, vtt
from shardtrain.pack.inputfs import audio_ref, input_fs, open_text, resolve_audio
from shardtrain.pack.item import (AUDIO_EXTENSIONS, INPUT_KINDS, Item, Reject, missing_input_message, opt_str,
                                  split_lines, table_lines, table_rows)
from shardtrain.pack.safeio import MAX_CHAPTER_BYTES, MAX_TRANSCRIPT_BYTES, InputFileError, read_bounded

log = logging.getLogger(__name__)

SOURCE_FORMATS = ("auto", "dir", "tsv", "csv", "jsonl", "librispeech", "lhotse", "kaldi", "hf", "commonvoice",
                  "ljspeech", "vtt")
"""kaldi, hf and commonvoice are read by pack/corpora.py, ljspeech (and a folder's metadata.csv) by pack/metadata.py,
vtt (recordings cut by WebVTT cues) by pack/vtt.py."""
"""Audio files a "dir" source picks up (case-insensitive); anything else in the tree is ignored."""
TRANSCRIPT_EXTENSIONS = (".txt", ".lab")
"""Transcript of a "dir" source's `x.flac`: `x.txt` or `x.lab` (HTK/Festival label text), case-insensitive, in
this order of preference."""

# Manifest column/key aliases (first match wins). Everything not named here goes to Item.extra.
_PATH_KEYS = ("path", "audio", "audio_filepath", "file_name", "wav_filename")  # NeMo, HF audiofolder, DeepSpeech
_TEXT_KEYS = ("text", "transcript", "sentence", "transcription")
_SPEAKER_KEYS = ("speaker", "speaker_id")
_LANGUAGE_KEYS = ("language", "lang", "locale")
_ID_KEYS = ("id", "utt_id", "key")
_DURATION_KEYS = ("duration", "duration_s")
_OFFSET_KEYS = ("offset", "offset_s", "start", "start_s")
_KNOWN_KEYS = frozenset(_PATH_KEYS + _TEXT_KEYS + _SPEAKER_KEYS + _LANGUAGE_KEYS + _ID_KEYS + _DURATION_KEYS
                        + _OFFSET_KEYS)

WHOLE_RECORDING_TOLERANCE_S = 0.001
"""A Lhotse supervision within this of the whole recording is emitted as the whole file (no cut)."""


@dataclass(frozen=True, slots=True)
class Columns:
    """How a csv/tsv/jsonl manifest names its fields when the aliases above do not fit (`--audio-column`,
    `--text-column`, `--delimiter`). A named column the table lacks is a ValueError listing the ones it has."""

    audio: str | None = None
    text: str | None = None
    delimiter: str | None = None
    """Field separator of a csv/tsv table (default: "," for .csv, tab for .tsv), e.g. "|"."""

    def keys(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(audio keys, text keys), lower-case, to try in order."""
        return ((self.audio.lower(),) if self.audio else _PATH_KEYS,
                (self.text.lower(),) if self.text else _TEXT_KEYS)

    def check(self, names: Iterable[str], where: str) -> None:
        low = {str(n).lower() for n in names}
        for flag, col in (("--audio-column", self.audio), ("--text-column", self.text)):
            if col and col.lower() not in low:
                raise ValueError(f"{where}: no column {col!r} ({flag}); it has {sorted(names)}")


def _first_json_record(fs: storage.FileSystem, path: str) -> dict | None:
    with open_text(fs, path) as f:
        for line in f:
            if line.strip():
                try:
                    rec = json.loads(line)
                except ValueError:
                    return None
                return rec if isinstance(rec, dict) else None
    return None


def _is_jsonl(path: str) -> bool:
    return path.endswith((".jsonl", ".jsonl.gz", ".json.gz", ".ndjson"))


# ---- format detection -----------------------------------------------------------------------------------------
def detect_format(input: str, storage_options: dict | None = None) -> str:
    """Guess the source format of `input` (one of SOURCE_FORMATS except "auto").

    Rules, in order: a Kaldi data dir (wav.scp + text), a Hugging Face dataset (.arrow/.parquet, dataset_info.json)
    or a Common Voice release (clips/ + TSVs; a TSV with path, sentence and client_id beside clips/); `.tsv` / `.csv`
    files; `.jsonl[.gz]` files are "lhotse" when the first record has a
    "supervisions" or "recording" key, else "jsonl"; a folder with `<a>/<b>/*.trans.txt` is "librispeech"; a folder
    with a metadata.csv/.tsv/.jsonl is "ljspeech" (metadata.py) or that table's format; a folder with a `<name>.vtt`
    beside `<name>.<audio ext>` is "vtt" (vtt.py: one utterance per cue); a folder holding at least
    one audio file is "dir". Costs one small read for jsonl, a depth-2 glob for folders, and (only
    for "dir") a walk that stops at the first audio file.
    """
    fs, path = input_fs(input, storage_options)
    if not fs.exists(path):
        raise ValueError(missing_input_message(input))
    other = corpora.detect(fs, path)  # Kaldi data dir, Hugging Face dataset, Common Voice release
    if other is not None:
        return other
    if fs.isfile(path):
        low = path.lower()
        if low.endswith(".tsv"):
            return "tsv"
        if low.endswith(".csv"):
            return "csv"
        if _is_jsonl(low):
            rec = _first_json_record(fs, path) or {}
            return "lhotse" if ("supervisions" in rec or "recording" in rec) else "jsonl"
        raise ValueError(f"input {input!r} is a file of unknown type; expected {INPUT_KINDS} "
                         "(or pass --source-format explicitly)")

    if _trans_files(fs, path):
        return "librispeech"
    table = metadata.metadata_file(fs, path)  # LJSpeech, Hugging Face audiofolder
    if table is not None:
        return table[1]
    if vtt.has_vtt(fs, path):
        return "vtt"
    for _root, _dirs, files in (os.walk(path, followlinks=True) if storage.fs_is_local(fs) else fs.walk(path)):
        if any(f.lower().endswith(AUDIO_EXTENSIONS) for f in files):
            return "dir"
    raise ValueError(f"input folder {input!r} holds no audio files; expected {INPUT_KINDS}")


def resolve_format(input: str, source_format: str, storage_options: dict | None) -> str:
    """`source_format` checked against SOURCE_FORMATS, with "auto" replaced by what detect_format finds."""
    if source_format not in SOURCE_FORMATS:
        raise ValueError(f"source_format must be one of {SOURCE_FORMATS}, got {source_format!r}")
    if source_format == "auto":
        source_format = detect_format(input, storage_options)
        log.info("detected source format %r for %s", source_format, input)
    return source_format


def iter_items(input: str, source_format: str = "auto", storage_options: dict | None = None, *,
               text_column: str | None = None, split: str | None = None, audio_column: str | None = None,
               delimiter: str | None = None) -> Iterator[Item | Reject]:
    """Yield one Item (or Reject) per utterance of `input`, in a deterministic order. `text_column` names the
    transcript column of a Hugging Face dataset (default: the first of corpora.HF_TEXT_COLUMNS present) or of a
    csv/tsv/jsonl manifest, `audio_column` a manifest's audio path column, `delimiter` a csv/tsv table's field
    separator (Columns); `split` picks the split of a Hugging Face DatasetDict folder (required for one: ValueError
    listing its splits). A folder with a metadata.csv/.tsv/.jsonl is read through that table (pack/metadata.py)."""

    source_format = resolve_format(input, source_format, storage_options)
    fs, path = input_fs(input, storage_options)
    if not fs.exists(path):
        raise ValueError(f"input {input!r} does not exist")
    columns = Columns(audio=audio_column, text=text_column, delimiter=delimiter)
    if source_format in ("tsv", "csv", "jsonl", "ljspeech") and fs.isdir(path):
        found = metadata.metadata_file(fs, path)
        if found is None:
            raise ValueError(f"input folder {input!r} has no {'/'.join(n for n, _ in metadata.METADATA_FILES)} "
                             f"to read as {source_format}; pass the manifest file itself as INPUT")
        if source_format == "ljspeech":
            return metadata.iter_ljspeech(fs, path, found[0])
        path = found[0]
    if source_format == "ljspeech":
        raise ValueError(f"--source-format ljspeech needs the LJSpeech folder (metadata.csv + wavs/), got {input!r}")
    if source_format == "dir":
        return _iter_dir(fs, path)
    if source_format in ("tsv", "csv"):
        return _iter_table(fs, path, columns.delimiter or ("\t" if source_format == "tsv" else ","), columns)
    if source_format == "jsonl":
        return _iter_jsonl(fs, path, columns)
    if source_format == "librispeech":
        return _iter_librispeech(fs, path)
    if source_format == "vtt":
        return vtt.iter_vtt(fs, path)
    if source_format in ("kaldi", "hf", "commonvoice"):

        if source_format == "kaldi":
            return corpora.iter_kaldi(fs, path)
        if source_format == "commonvoice":
            return corpora.iter_commonvoice(fs, path)
        return corpora.iter_hf(fs, path, text_column=text_column, split=split)
    return _iter_lhotse(fs, path)


# ---- dir ------------------------------------------------------------------------------------------------------
def _read_transcript(fs: storage.FileSystem, txt: str, item_id: str, audio: str) -> str | Reject:
    """The transcript in `txt`, read bounded (safeio: regular files of at most MAX_TRANSCRIPT_BYTES only, so a
    FIFO or an endless file is a reject, not a hang), UTF-8 with an optional BOM, stripped."""
    name = posixpath.basename(txt)
    try:
        raw = read_bounded(fs, txt, MAX_TRANSCRIPT_BYTES)
    except FileNotFoundError:
        return Reject(item_id, audio, f"missing_transcript: no {name}")
    except InputFileError as e:  # a FIFO, a device, a huge file: this utterance is rejected, the pack goes on
        return Reject(item_id, audio, f"{e.code}: transcript {name} {e.detail}")
    except OSError as e:  # permissions, I/O errors: this utterance is rejected, the pack goes on
        return Reject(item_id, audio, f"unreadable_transcript: {name}: {type(e).__name__}: {e}")
    try:
        return raw.decode("utf-8-sig").strip()
    except UnicodeDecodeError as e:
        return Reject(item_id, audio, f"bad_transcript_encoding: {name} is not UTF-8 ({e.reason} at byte {e.start})")


def _iter_dir(fs: storage.FileSystem, root: str) -> Iterator[Item | Reject]:
    """Audio files under `root` with same-stem `.txt` transcripts; id = relative path without extension.

    Hidden files (leading ".", e.g. macOS `._x.flac`) are skipped. When one folder holds two audio files with the
    same stem (x.wav and x.flac), both ids keep their extension so that ids stay unique.
    """
    return _dir_items(fs, _dir_entries(fs, root))


def _find(fs: storage.FileSystem, root: str) -> list[str]:
    """Every file below `root`, as `fs.find` lists it. On local disk through os.walk (names only): fsspec's local
    find stats every entry, ~0.1 ms each in Python (0.3 s of a 3,000-file pack's 2 s)."""
    if not storage.fs_is_local(fs):
        return list(fs.find(root))
    return [posixpath.join(d.replace(os.sep, "/"), f) for d, _, names in os.walk(root, followlinks=True) for f in names]


def _trans_files(fs: storage.FileSystem, root: str) -> list[str]:
    """LibriSpeech chapter transcripts `<root>/<speaker>/<chapter>/*.trans.txt`; on local disk by the standard
    library's glob (names only, as `_find`)."""
    if not storage.fs_is_local(fs):
        return list(fs.glob(posixpath.join(root, "*", "*", "*.trans.txt")))
    import glob  # noqa: PLC0415

    return [p.replace(os.sep, "/") for p in glob.glob(os.path.join(glob.escape(root), "*", "*", "*.trans.txt"))]


def _dir_entries(fs: storage.FileSystem, root: str) -> list[tuple[str, str, str | None]]:
    """The listing half of a "dir" source (one `find`): (audio path, id, transcript path or None) per file.

    The transcript of `x.flac` is `x` + one of TRANSCRIPT_EXTENSIONS matched case-insensitively (`x.txt`, `x.TXT`,
    `x.Txt`, `x.lab`); when several exist, the first extension of TRANSCRIPT_EXTENSIONS wins, and among spellings
    of one extension the sorted-first name (so the choice never depends on the listing order)."""
    files = sorted(p for p in _find(fs, root) if not posixpath.basename(p).startswith("."))
    audio = [p for p in files if p.lower().endswith(AUDIO_EXTENSIONS)]
    texts: dict[str, dict[str, str]] = {}
    for p in files:
        stem, ext = posixpath.splitext(p)
        if ext.lower() in TRANSCRIPT_EXTENSIONS:
            texts.setdefault(stem, {}).setdefault(ext.lower(), p)  # files are sorted: the first spelling stays
    stems: dict[str, int] = {}
    for p in audio:
        stem = posixpath.splitext(p)[0]
        stems[stem] = stems.get(stem, 0) + 1
    entries = []
    prefix = root.rstrip("/") + "/"
    for p in audio:
        stem = posixpath.splitext(p)[0]
        found = texts.get(stem, {})
        txt = next((found[e] for e in TRANSCRIPT_EXTENSIONS if e in found), None)
        named = p if stems[stem] > 1 else stem
        # slicing below the root (what find lists starts with it); relpath costs ~30 us a file (two getcwd calls)
        rel = named[len(prefix):] if named.startswith(prefix) else posixpath.relpath(named, root)
        entries.append((p, rel, txt))
    return entries


def _dir_items(fs: storage.FileSystem, entries: Iterable[tuple[str, str, str | None]]
               ) -> Iterator[Item | Reject]:
    """The reading half of a "dir" source: one transcript read per entry (a request each on object storage)."""
    for p, rel, txt in entries:
        ref = audio_ref(fs, p)
        if txt is None:
            yield Reject(rel, ref, f"missing_transcript: no {posixpath.basename(posixpath.splitext(p)[0])}"
                                   f"{'/'.join(TRANSCRIPT_EXTENSIONS)}")
            continue
        text = _read_transcript(fs, txt, rel, ref)
        yield text if isinstance(text, Reject) else Item(id=rel, audio=ref, text=text)


# ---- tsv / csv / jsonl manifests ------------------------------------------------------------------------------
def _pick(rec: dict[str, Any], keys: Iterable[str]) -> Any:
    for k in keys:
        if k in rec and rec[k] not in (None, ""):
            return rec[k]
    return None


def _bad_type(low: dict[str, Any], path_keys: Iterable[str], text_keys: Iterable[str]) -> str | None:
    """Why a JSON record's known field cannot be read as written, else None: a path, text, id, speaker or language
    must be a string or an integer, a duration or offset a number (or a numeric string); only the value `_pick`
    takes is checked. Why: `str()` of anything else was packed: a word list as the transcript "['hello', 'world']",
    true as "True", a duration of true as 1.0 s. CSV/TSV fields are strings and always pass."""
    for keys, ok, what in ((path_keys, (str, int), "a string"), (text_keys, (str, int), "a string"),
                           (_ID_KEYS, (str, int), "a string"), (_SPEAKER_KEYS, (str, int), "a string"),
                           (_LANGUAGE_KEYS, (str, int), "a string"), (_DURATION_KEYS, (str, int, float), "a number"),
                           (_OFFSET_KEYS, (str, int, float), "a number")):
        k = next((k for k in keys if low.get(k) not in (None, "")), None)  # the one _pick takes
        v = low.get(k) if k is not None else None
        if v is not None and (isinstance(v, bool) or not isinstance(v, ok)):
            return f"{k} is {type(v).__name__} {json.dumps(v)[:80]}, not {what}"
    return None


def _record_to_item(rec: dict[str, Any], where: str, base_dir: str, fs: storage.FileSystem,
                    has_offset_field: bool, columns: Columns = Columns()) -> Item | Reject:
    """One manifest record (TSV/CSV row or JSON object) -> Item. Known fields match case-insensitively; other
    fields go to `extra` under their original names.

    Without an id field the id is the audio path (relative to the manifest folder when it lies below it) without
    extension; when the manifest has offsets, `_<offset in ms>` is appended so segments of one file stay distinct.
    """
    low = {str(k).lower(): v for k, v in rec.items()}
    path_keys, text_keys = columns.keys()
    bad = _bad_type(low, path_keys, text_keys)
    if bad is not None:
        return Reject(where, where, f"bad_field: {bad}")
    audio = _pick(low, path_keys)
    if audio is None:
        return Reject(where, where, f"missing_path: no {'/'.join(path_keys)} field (name it with --audio-column)")
    audio = str(audio)
    ref = resolve_audio(base_dir, audio, fs)
    try:
        duration = _pick(low, _DURATION_KEYS)
        duration_s = None if duration is None else float(duration)
        offset = _pick(low, _OFFSET_KEYS)
        start_s = 0.0 if offset is None else float(offset)
    except (TypeError, ValueError) as e:
        return Reject(where, ref, f"bad_field: duration/offset not a number ({e})")
    if not start_s >= 0 or (duration_s is not None and not duration_s > 0):
        return Reject(where, ref, f"bad_field: offset {start_s} / duration {duration_s} out of range")
    item_id = _pick(low, _ID_KEYS)
    if item_id is None:
        if "://" in audio:
            rel = audio
        elif audio.startswith("/"):
            rel = posixpath.relpath(audio, base_dir) if audio.startswith(base_dir + "/") else audio.lstrip("/")
        else:
            rel = posixpath.normpath(audio)
        item_id = posixpath.splitext(rel)[0]
        if has_offset_field:
            item_id = f"{item_id}_{round(start_s * 1000):d}"
    text = _pick(low, text_keys)
    if text is None and any(k in low for k in text_keys):
        text = ""  # the field exists but is empty: an (allowed) empty transcript, not a missing one
    known = _KNOWN_KEYS.union(path_keys, text_keys)
    extra = tuple(sorted((str(k), v) for k, v in rec.items() if str(k).lower() not in known))
    return Item(id=str(item_id), audio=ref, text=None if text is None else str(text), start_s=start_s,
                duration_s=duration_s, speaker=opt_str(_pick(low, _SPEAKER_KEYS)),
                language=opt_str(_pick(low, _LANGUAGE_KEYS)), extra=extra)


def _iter_table(fs: storage.FileSystem, path: str, delimiter: str, columns: Columns = Columns()
                ) -> Iterator[Item | Reject]:
    """Header row + one row per utterance. TSV is read without quote handling (transcripts contain `"`), CSV with
    standard quoting. Column names are matched case-insensitively."""
    base = posixpath.dirname(path)
    quoting: Literal[0, 1, 2, 3] = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    with open_text(fs, path) as f:
        reader = csv.reader(table_lines(f), delimiter=delimiter, quoting=quoting, strict=True)  # table_rows says why
        header = next(reader, None)
        if header is None:
            return
        header = [h.strip() for h in header]
        columns.check(header, path)
        has_offset = any(k.lower() in _OFFSET_KEYS for k in header)
        for x in table_rows(reader, path, header):
            yield x if isinstance(x, Reject) else _record_to_item(x[1], x[0], base, fs, has_offset, columns)


def _json_lines(fs: storage.FileSystem, path: str) -> Iterator[tuple[str, dict] | Reject]:
    """(`path:line`, object) per non-blank line; a line that is not a JSON object becomes a Reject (a leading BOM
    is dropped by open_text)."""
    with open_text(fs, path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except ValueError as e:
                yield Reject(where, where, f"bad_json: line {lineno}: {e}")
                continue
            if not isinstance(rec, dict):
                yield Reject(where, where, f"bad_json: line {lineno} is a {type(rec).__name__}, not an object")
                continue
            yield where, rec


def _iter_jsonl(fs: storage.FileSystem, path: str, columns: Columns = Columns()) -> Iterator[Item | Reject]:
    """One JSON object per line (NeMo keys audio_filepath/text/duration/offset accepted); blank lines skipped."""
    base = posixpath.dirname(path)
    for got in _json_lines(fs, path):
        if isinstance(got, Reject):
            yield got
            continue
        where, rec = got
        has_offset = any(str(k).lower() in _OFFSET_KEYS for k in rec)
        yield _record_to_item(rec, where, base, fs, has_offset, columns)


# ---- LibriSpeech ----------------------------------------------------------------------------------------------
def _librispeech_transcripts(fs: storage.FileSystem, root: str) -> list[str]:
    """The listing half of a LibriSpeech source: its `.trans.txt` files (one per chapter), sorted."""
    return sorted(_trans_files(fs, root))


def _iter_librispeech(fs: storage.FileSystem, root: str, transcripts: list[str] | None = None
                      ) -> Iterator[Item | Reject]:
    """`<spk>/<chapter>/<spk>-<chapter>-<utt>.flac` + `<spk>-<chapter>.trans.txt` (lines `<utt-id> <TEXT>`).

    id = utterance id, speaker = the `<spk>` folder, language "en", extra = chapter. Transcript lines without audio
    give `missing_audio`, audio without a transcript line gives `missing_transcript`.
    """
    for trans in _librispeech_transcripts(fs, root) if transcripts is None else transcripts:
        chapter_dir = posixpath.dirname(trans)
        chapter = posixpath.basename(chapter_dir)
        speaker = posixpath.basename(posixpath.dirname(chapter_dir))
        audio = {posixpath.splitext(posixpath.basename(p))[0]: p for p in sorted(fs.ls(chapter_dir, detail=False))
                 if p.lower().endswith(AUDIO_EXTENSIONS)}
        try:
            lines = split_lines(read_bounded(fs, trans, MAX_CHAPTER_BYTES).decode("utf-8-sig"))
        except UnicodeDecodeError as e:
            yield Reject(posixpath.basename(trans), audio_ref(fs, trans), f"bad_transcript_encoding: {e}")
            continue
        except OSError as e:  # unreadable: every utterance of the chapter is rejected with the reason
            for utt in sorted(audio):
                yield Reject(utt, audio_ref(fs, audio[utt]), f"unreadable_transcript: {posixpath.basename(trans)}: "
                                                        f"{type(e).__name__}: {e}")
            continue
        seen: set[str] = set()
        for line in lines:
            if not line.strip():
                continue
            utt, _, text = line.strip().partition(" ")
            seen.add(utt)
            if utt not in audio:
                yield Reject(utt, audio_ref(fs, trans),
                             f"missing_audio: no {utt}.flac next to {posixpath.basename(trans)}")
                continue
            yield Item(id=utt, audio=audio_ref(fs, audio[utt]), text=text.strip(), speaker=speaker, language="en",
                       extra=(("chapter", chapter),))
        for utt in sorted(set(audio) - seen):
            yield Reject(utt, audio_ref(fs, audio[utt]),
                         f"missing_transcript: {utt} not in {posixpath.basename(trans)}")


# ---- Lhotse CutSet --------------------------------------------------------------------------------------------
def _lhotse_cut_items(cut: dict, where: str, seen: set[str]) -> Iterator[Item | Reject]:
    """One MonoCut dict -> one Item per supervision, cut to the supervision's segment of the recording.

    Supported: a recording inline in the cut with a single source of type "file" (path as stored, i.e. relative
    paths are relative to the working directory, as lhotse reads them) or "url" (any fsspec URL). Rejected with a
    reason, never silently mis-read: other source types (memory, command, shar), several sources, recording
    transforms (speed/resample perturbation), a channel subset of a multi-channel recording, MixedCut/PaddingCut,
    and segments outside the recording.
    """
    cut_id = str(cut.get("id", where))
    if cut.get("type", "MonoCut") != "MonoCut":
        yield Reject(cut_id, where, f"unsupported_cut: type {cut.get('type')!r} (only MonoCut)")
        return
    rec = cut.get("recording")
    if not isinstance(rec, dict):
        yield Reject(cut_id, where, "missing_recording: cut has no inline recording")
        return
    sources = rec.get("sources") or []
    if len(sources) != 1 or sources[0].get("type") not in ("file", "url"):
        kinds = [s.get("type") for s in sources]
        yield Reject(cut_id, where, f"unsupported_source: recording {rec.get('id')!r} sources {kinds} "
                                    "(need exactly one of type 'file' or 'url')")
        return
    audio = str(sources[0]["source"])
    if rec.get("transforms"):
        yield Reject(cut_id, audio, "unsupported_transform: recording has transforms "
                                    f"{[t.get('name') for t in rec['transforms']]}")
        return
    n_channels = len(rec.get("channel_ids") or sources[0].get("channels") or [0])
    channel = cut.get("channel", 0)
    if n_channels > 1 and (isinstance(channel, int) or len(channel) != n_channels):
        yield Reject(cut_id, audio, f"unsupported_channel_selection: cut picks channel {channel} of a "
                                    f"{n_channels}-channel recording")
        return
    supervisions = cut.get("supervisions") or []
    if not supervisions:
        yield Reject(cut_id, audio, "missing_transcript: cut has no supervisions")
        return
    rec_duration = float(rec.get("duration", 0.0))
    cut_start = float(cut.get("start", 0.0))
    for sup in supervisions:
        sup_id = str(sup.get("id", cut_id))
        item_id = sup_id if sup_id not in seen else f"{cut_id}/{sup_id}"  # a supervision repeated in several cuts
        seen.add(item_id)
        start_s = cut_start + float(sup.get("start", 0.0))
        duration_s = float(sup.get("duration", 0.0))
        tol = WHOLE_RECORDING_TOLERANCE_S
        if start_s < -tol or duration_s <= 0 or (rec_duration and start_s + duration_s > rec_duration + tol):
            yield Reject(item_id, audio, f"segment_out_of_range: [{start_s:.3f}, {start_s + duration_s:.3f}] s "
                                         f"of a {rec_duration:.3f} s recording")
            continue
        start_s = max(start_s, 0.0)
        whole = start_s <= tol and abs(duration_s - rec_duration) <= tol
        extra = dict(sup.get("custom") or {})
        if sup.get("gender") is not None:
            extra["gender"] = sup["gender"]
        yield Item(id=item_id, audio=audio, text=sup.get("text"), start_s=0.0 if whole else start_s,
                   duration_s=None if whole else duration_s, speaker=opt_str(sup.get("speaker")),
                   language=opt_str(sup.get("language")), extra=tuple(sorted(extra.items())))


def _iter_lhotse(fs: storage.FileSystem, path: str) -> Iterator[Item | Reject]:
    """Stream a CutSet `.jsonl[.gz]` with plain json (no lhotse import: faster, and never evaluates anything)."""
    seen: set[str] = set()
    for got in _json_lines(fs, path):
        if isinstance(got, Reject):
            yield got
        else:
            yield from _lhotse_cut_items(got[1], got[0], seen)
