"""Corpus layouts other toolkits write -> `Item`s: Kaldi data dirs, Hugging Face datasets, Common Voice releases.

    kaldi        data dir: wav.scp + text [+ segments, utt2spk, utt2lang]  -> one Item per utterance (segment)
    hf           save_to_disk folder (*.arrow + dataset_info.json), .arrow / .parquet files or a folder of them,
                 with an Audio column (bytes or paths) and a text column  -> one Item per row
    commonvoice  release folder (clips/ + validated.tsv) or any of its split TSVs (path, sentence, client_id, locale)

Reads listings only, like sources.py (which dispatches here and owns Item/Reject). Audio stored inside a larger
file is referenced as `<file>#bytes=START-END` (probe.open_audio reads that range), so nothing is copied: Kaldi
ark entries holding a RIFF/WAV (what `wav-copy ... ark:` writes) and audio bytes inside Arrow files (located by
their buffer offsets in the memory-mapped file). Parquet pages are compressed, so a .parquet input is first
rewritten once as an Arrow file under `arrow_cache_dir` (~ the audio's size on local disk; reused while the
Parquet file's size and mtime are unchanged).

wav.scp commands (lines ending in `|`) are never run: the common decode-only forms `flac -c -d -s F |`,
`sox F -t wav - |` (optionally -r/-b) and `sph2pipe -f wav [-p] F |` are read as the file F they decode (the packer
decodes and resamples it itself); any other command is rejected (`unsupported_pipe`) with what to do instead.
Relative wav.scp paths are taken relative to the working directory, as Kaldi and lhotse do.
"""
from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import posixpath
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardtrain import storage
from shardtrain.format.audioref import byte_range_ref
from shardtrain.pack.inputfs import audio_ref, open_text
from shardtrain.pack.item import Item, Reject, opt_str, table_lines, table_rows
from shardtrain.pack.safeio import MAX_TABLE_BYTES, InputFileError, read_bounded

log = logging.getLogger(__name__)

HF_TEXT_COLUMNS = ("text", "sentence", "transcription", "transcript", "normalized_text", "raw_text")
"""Text columns tried in order when `text_column` is not given."""
_HF_ID = ("id", "utt_id", "key", "segment_id", "audio_id")
_HF_SPEAKER = ("speaker", "speaker_id", "client_id")
_HF_LANGUAGE = ("language", "lang", "locale")
_CV_EXTRA = ("age", "gender", "accents", "variant", "segment", "sentence_id", "sentence_domain", "up_votes",
             "down_votes")
_ARK_OFFSET = re.compile(r"^(?P<path>.+):(?P<offset>\d+)$")


# ---- detection ------------------------------------------------------------------------------------------------
def detect(fs: storage.FileSystem, path: str) -> str | None:
    """"kaldi", "hf" or "commonvoice" when `path` has that layout, else None (a few small reads at most)."""
    if fs.isfile(path):
        low = path.lower()
        if low.endswith((".arrow", ".parquet")):
            return "hf"
        if low.endswith(".tsv"):
            cols = _tsv_header(fs, path)
            if {"path", "sentence", "client_id"} <= set(cols) and fs.isdir(posixpath.join(posixpath.dirname(path),
                                                                                           "clips")):
                return "commonvoice"
        return None
    # names only: fsspec's local ls normalises every entry (~14 us each, 0.08 s of a 3,000-file folder's pack)
    names = set(os.listdir(path)) if storage.fs_is_local(fs) else {p.rstrip("/").rsplit("/", 1)[-1]
                                                            for p in fs.ls(path, detail=False)}
    has = lambda n: n in names  # noqa: E731
    if has("wav.scp") and has("text"):
        return "kaldi"
    if has("clips") and has("validated.tsv"):
        return "commonvoice"
    if has("dataset_info.json") or has("dataset_dict.json") or any(n.endswith((".arrow", ".parquet"))
                                                                   for n in names):
        return "hf"
    return None


def _tsv_header(fs: storage.FileSystem, path: str) -> list[str]:
    with open_text(fs, path) as f:
        return [c.strip() for c in f.readline().rstrip("\r\n").split("\t")]


# ---- Kaldi ----------------------------------------------------------------------------------------------------
def _kaldi_table(fs: storage.FileSystem, path: str, rejects: list[Reject]) -> dict[str, str]:
    """`<id> <value>` lines -> {id: value} (value may be empty or hold spaces); undecodable lines -> rejects.

    An id on a second line is a `duplicate_id` reject naming both lines, and the first line is kept (as
    layout.lay_out keeps the first of two items with one id). Why: a dict update kept the last one silently, so a
    repeated `segments` line dropped a segment without a word and a repeated `text` line paired the utterance
    with the other transcript (Kaldi's validate_data_dir.sh refuses such tables; they come from concatenating
    two data dirs by hand). A leading UTF-8 BOM is dropped (Windows editors write one)."""
    out: dict[str, str] = {}
    if not fs.exists(path):
        return out
    try:
        data = read_bounded(fs, path, MAX_TABLE_BYTES)
    except InputFileError as e:  # the whole corpus depends on this table: refuse the input, in one line
        raise ValueError(f"Kaldi table {e}") from None
    first: dict[str, int] = {}
    for n, raw in enumerate(data.split(b"\n"), 1):  # never splitlines(): a lone \r is text
        try:
            line = raw.decode("utf-8-sig" if n == 1 else "utf-8").strip()
        except UnicodeDecodeError as e:
            rejects.append(Reject(f"{path}:{n}", path, f"bad_transcript_encoding: line {n} is not UTF-8 ({e.reason})"))
            continue
        if line:
            key, _, value = line.partition(" ")
            if key in out:
                rejects.append(Reject(key, path, f"duplicate_id: {posixpath.basename(path)} line {n} repeats {key!r} "
                                                 f"of line {first[key]}; the first one is kept"))
                continue
            out[key], first[key] = value.strip(), n
    return out


def _sox_rate_checked(path: str, rate: str | None, cmd: str) -> str | Reject:
    """`path` when what `sox path -r RATE` produces is what packing `path` itself gives, else a Reject.

    The pipe is not run, so its output rate must be derived: the file's own rate comes from its header (one small
    read per recording). A pipe that resamples up (or to the same rate) adds no information and packing the file
    gives the same content; one that resamples down band-limits the audio (`-r 8000`: telephone band), which
    packing the file at its own rate would silently undo, so it is rejected with the fix.
    """
    if rate is None:
        return path
    try:
        want = round(float(rate[:-1]) * 1000) if rate.lower().endswith("k") else round(float(rate))
    except ValueError:
        return Reject("", cmd, f"unsupported_pipe: sox -r {rate!r} is not a sample rate in {cmd!r}")
    from shardtrain.pack.probe import probe  # noqa: PLC0415 - only wav.scp pipes with -r pay for the header read

    try:
        have = probe(path).sample_rate_hz
    except FileNotFoundError:
        return Reject("", path, f"missing_file: {path} does not exist")
    except Exception as e:  # noqa: BLE001 - an unreadable header: this recording is rejected, the pack goes on
        return Reject("", path, f"unreadable_audio: {path}: {type(e).__name__}: {e}")
    if want >= have:
        return path
    return Reject("", path, f"unsupported_pipe: wav.scp resamples {path} from {have} Hz to {want} Hz (sox -r {rate}), "
                            "which shardtrain does not run; resample those recordings to files first (e.g. "
                            f"`sox in.wav -r {want} out.wav`) and point wav.scp at them")


def _pipe_input(cmd: str) -> str | Reject:
    """The input file of a decode-only wav.scp command, or a Reject; the command itself is never run."""
    try:
        argv = shlex.split(cmd)
    except ValueError as e:
        return Reject("", cmd, f"unsupported_pipe: cannot parse {cmd!r} ({e})")
    prog = posixpath.basename(argv[0]) if argv else ""
    files = [a for a in argv[1:] if not a.startswith("-")]
    flags = [a for a in argv[1:] if a.startswith("-") and a != "-"]
    if prog == "flac" and len(files) == 1 and all(re.fullmatch(r"-[cdsf]+|--(decode|stdout|silent)", f)
                                                  for f in flags) and any("d" in f for f in flags):
        return files[0]
    if prog == "sox" and len(argv) >= 5 and argv[-1] == "-":
        rest = argv[2:-1]
        opts = dict(zip(rest[::2], rest[1::2])) if len(rest) % 2 == 0 else {}
        if opts.get("-t") in ("wav", "wavpcm") and set(opts) <= {"-t", "-r", "-b"} and not argv[1].startswith("-"):
            return _sox_rate_checked(argv[1], opts.get("-r"), cmd)
    if prog == "sph2pipe" and len(files) == 2 and files[0] == "wav" and set(flags) <= {"-f", "-p"}:
        return files[1]
    return Reject("", cmd, f"unsupported_pipe: wav.scp command {cmd!r} is not run (shardtrain executes nothing "
                           "from a manifest); decode those recordings to files first, e.g. "
                           "`wav-copy scp:wav.scp ark,scp:wav.ark,wav_files.scp`, and point wav.scp at them")


def _ark_ref(fs: storage.FileSystem, value: str) -> str | Reject | None:
    """`x.ark:OFFSET` holding a Kaldi RIFF/WAV entry -> a byte-range reference; None when not an ark entry."""
    m = _ARK_OFFSET.match(value)
    if m is None or not m["path"].endswith(".ark"):
        return None
    ark, offset = m["path"], int(m["offset"])
    try:
        with fs.open(ark, "rb") as f:
            f.seek(offset)
            head = f.read(8)
    except FileNotFoundError:
        return Reject("", ark, f"missing_file: {ark} does not exist")
    if head[:4] != b"RIFF" or len(head) < 8:
        kind = "features (a matrix)" if head[:2] == b"\0B" else f"{head[:4]!r}"
        return Reject("", ark, f"unsupported_ark: {value} holds {kind}, not a RIFF/WAV recording")
    ref = audio_ref(fs, ark)
    ref = ref if "://" in ref else os.path.abspath(ref)  # relative to the working directory, like plain paths
    return byte_range_ref(ref, offset, offset + 8 + int.from_bytes(head[4:8], "little"))


def _wav_ref(fs: storage.FileSystem, value: str) -> str | Reject:
    if value.startswith(("ark:", "scp:")):
        return Reject("", value, f"unsupported_ark: {value!r} (a table specifier, not one recording)")
    if value.endswith("|"):
        got = _pipe_input(value[:-1].strip())
        if isinstance(got, Reject):
            return got
        value = got
    ark = _ark_ref(fs, value)
    if ark is not None:
        return ark
    return value if "://" in value or value.startswith("/") else os.path.abspath(value)


def iter_kaldi(fs: storage.FileSystem, root: str) -> Iterator[Item | Reject]:
    """wav.scp + text [+ segments, utt2spk, utt2lang]: one Item per utterance, in segments (else wav.scp) order."""
    rejects: list[Reject] = []
    join = lambda n: posixpath.join(root, n)  # noqa: E731
    wavs, texts = _kaldi_table(fs, join("wav.scp"), rejects), _kaldi_table(fs, join("text"), rejects)
    spk, lang = _kaldi_table(fs, join("utt2spk"), rejects), _kaldi_table(fs, join("utt2lang"), rejects)
    has_segments = fs.exists(join("segments"))
    if has_segments:
        segments = _kaldi_table(fs, join("segments"), rejects)
    else:
        segments = {rec: f"{rec} 0 -1" for rec in wavs}
    yield from rejects
    refs: dict[str, str | Reject] = {}
    for utt, seg in segments.items():
        fields = seg.split()
        if len(fields) != 3:
            yield Reject(utt, join("segments"), f"bad_line: segments line for {utt} needs <recording> <start> <end>")
            continue
        rec = fields[0]
        if rec not in wavs:
            yield Reject(utt, join("wav.scp"), f"missing_audio: recording {rec} is not in wav.scp")
            continue
        if rec not in refs:
            refs[rec] = _wav_ref(fs, wavs[rec])
        ref = refs[rec]
        if isinstance(ref, Reject):
            yield Reject(utt, ref.path, ref.reason)
            continue
        try:
            start, end = float(fields[1]), float(fields[2])
        except ValueError:
            yield Reject(utt, ref, f"bad_segment: start/end {fields[1]!r} {fields[2]!r} are not numbers")
            continue
        if start < 0 or (end != -1 and end <= start):
            yield Reject(utt, ref, f"bad_segment: [{start}, {end}] s")
            continue
        if utt not in texts:
            yield Reject(utt, ref, "missing_transcript: not in text")
            continue
        whole = start == 0 and end == -1
        yield Item(id=utt, audio=ref, text=texts[utt], start_s=start,
                   duration_s=None if end == -1 else end - start, speaker=opt_str(spk.get(utt)),
                   language=opt_str(lang.get(utt)), extra=() if whole or not has_segments else (("recording", rec),))
    for utt in sorted(set(texts) - set(segments)):
        yield Reject(utt, join("text"), f"missing_audio: {utt} is in text but not in "
                                        f"{'segments' if has_segments else 'wav.scp'}")


# ---- Common Voice ---------------------------------------------------------------------------------------------
def iter_commonvoice(fs: storage.FileSystem, path: str) -> Iterator[Item | Reject]:
    """A Common Voice TSV (validated.tsv for a release folder): clip `clips/<path>`, text = sentence, speaker =
    client_id, language = locale; age, gender, accents, ... go to extra when not empty."""
    if fs.isdir(path):
        tsv = posixpath.join(path, "validated.tsv")
        if not fs.exists(tsv):
            raise ValueError(f"Common Voice folder {path!r} has no validated.tsv; pass one of its split TSVs "
                             "(train.tsv, dev.tsv, ...) as INPUT instead")
        path = tsv
    clips = posixpath.join(posixpath.dirname(path), "clips")
    with open_text(fs, path) as f:
        reader = csv.reader(table_lines(f), delimiter="\t", quoting=csv.QUOTE_NONE)
        header = [h.strip() for h in next(reader, [])]
        missing = {"path", "sentence"} - set(header)
        if missing:
            raise ValueError(f"{path}: not a Common Voice TSV (no {sorted(missing)} column; has {header})")
        for x in table_rows(reader, path, header):
            if isinstance(x, Reject):
                yield x
                continue
            where, rec = x
            clip = rec["path"].strip()
            if not clip or "/" in clip or clip.startswith("."):
                yield Reject(where, where, f"bad_field: path {clip!r} is not a file name in clips/")
                continue
            extra = tuple((k, rec[k]) for k in _CV_EXTRA if rec.get(k, "").strip())
            yield Item(id=posixpath.splitext(clip)[0], audio=audio_ref(fs, posixpath.join(clips, clip)),
                       text=rec["sentence"], speaker=opt_str(rec.get("client_id")),
                       language=opt_str(rec.get("locale")), extra=extra)


# ---- Hugging Face datasets ------------------------------------------------------------------------------------
def _hf_files(fs: storage.FileSystem, path: str) -> list[str]:
    if fs.isfile(path):
        return [path]
    state = posixpath.join(path, "state.json")
    if fs.exists(state):  # save_to_disk: the data files in their order
        return [posixpath.join(path, d["filename"]) for d in json.loads(fs.cat_file(state))["_data_files"]]
    files = sorted(p for p in fs.find(path) if p.endswith((".arrow", ".parquet")))
    if not files:
        raise ValueError(f"{path!r} holds no .arrow or .parquet files")
    return files


def _audio_column(schema: Any, meta: dict | None) -> str:
    """The Audio feature named in the datasets metadata, else the first struct<bytes, path> column."""
    feats = (meta or {}).get("features") or (meta or {}).get("info", {}).get("features") or {}
    for name, f in feats.items():
        if isinstance(f, dict) and f.get("_type") == "Audio":
            return name
    for field in schema:
        t = field.type
        if hasattr(t, "get_field_index") and t.get_field_index("bytes") >= 0 and t.get_field_index("path") >= 0:
            return field.name
    raise ValueError(f"no Audio column (struct of bytes and path) among {schema.names}")


def _pick_column(names: list[str], wanted: str | None, aliases: tuple[str, ...]) -> str | None:
    if wanted:
        return wanted if wanted in names else None
    return next((a for a in aliases if a in names), None)


def _parquet_as_arrow(fs: storage.FileSystem, path: str, cache_dir: Path) -> str:
    """Rewrite a Parquet file once as an Arrow IPC stream (audio bytes become addressable byte ranges)."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    info = fs.info(path)
    tag = hashlib.sha1(f"{fs.unstrip_protocol(path)}|{info.get('size')}|{info.get('mtime', info.get('LastModified'))}"
                       .encode()).hexdigest()[:16]
    out = cache_dir / f"{posixpath.basename(path)}.{tag}.arrow"
    if out.exists():
        return str(out)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with fs.open(path, "rb") as src:
        pf = pq.ParquetFile(src)
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, pf.schema_arrow) as w:
            for rb in pf.iter_batches(batch_size=256):
                w.write_batch(rb)
    os.replace(tmp, out)
    log.info("rewrote %s as %s (Parquet audio is not byte-addressable)", path, out)
    return str(out)


def _hf_meta(fs: storage.FileSystem, root: str, schema: Any) -> dict | None:
    info = posixpath.join(root, "dataset_info.json")
    if fs.isdir(root) and fs.exists(info):
        return json.loads(fs.cat_file(info))
    raw = (schema.metadata or {}).get(b"huggingface")
    return json.loads(raw) if raw else None


def hf_splits(fs: storage.FileSystem, path: str) -> list[str] | None:
    """The splits of a DatasetDict `save_to_disk` folder (its dataset_dict.json), or None when `path` is not one."""
    meta = posixpath.join(path, "dataset_dict.json")
    if not fs.isdir(path) or not fs.exists(meta):
        return None
    try:
        splits = json.loads(read_bounded(fs, meta, MAX_TABLE_BYTES)).get("splits")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{meta}: not a DatasetDict description ({e})") from None
    if not isinstance(splits, list) or not all(isinstance(x, str) for x in splits):
        raise ValueError(f"{meta}: 'splits' is not a list of names")
    return splits


def _hf_split_path(fs: storage.FileSystem, path: str, split: str | None) -> str:
    """`path` itself, or its `split` folder when `path` is a DatasetDict (which then needs a valid `--split`)."""
    splits = hf_splits(fs, path)
    if splits is None:
        if split is not None:
            raise ValueError(f"--split {split} given, but {path!r} is not a DatasetDict folder (no dataset_dict.json)")
        return path
    if split is None or split not in splits:
        what = "needs --split NAME" if split is None else f"has no split {split!r}"
        raise ValueError(f"{path!r} is a Hugging Face DatasetDict and {what}; its splits: {', '.join(splits)}")
    return posixpath.join(path, split)


def iter_hf(fs: storage.FileSystem, path: str, text_column: str | None = None,
            arrow_cache_dir: str | os.PathLike | None = None, split: str | None = None) -> Iterator[Item | Reject]:
    """One Item per row of a Hugging Face dataset's Arrow/Parquet files (see the module docstring); a DatasetDict
    folder (dataset_dict.json) reads its `split` sub-folder."""
    import pyarrow as pa  # noqa: PLC0415

    path = _hf_split_path(fs, path, split)

    cache = Path(arrow_cache_dir) if arrow_cache_dir else Path.home() / ".cache" / "shardtrain" / "hf-arrow"
    n = 0
    for data_file in _hf_files(fs, path):
        local = data_file if data_file.endswith(".arrow") else _parquet_as_arrow(fs, data_file, cache)
        if local == data_file and "://" in audio_ref(fs, data_file):
            raise ValueError(f"{data_file}: Arrow inputs must be local files (copy them, or use the Parquet files)")
        with pa.memory_map(local, "r") as mm:
            base = mm.read_buffer(1).address
            mm.seek(0)
            try:
                reader = pa.ipc.open_stream(mm)
            except pa.ArrowInvalid:
                mm.seek(0)
                reader = pa.ipc.open_file(mm)
            batches = reader if isinstance(reader, pa.ipc.RecordBatchStreamReader) else (
                reader.get_batch(i) for i in range(reader.num_record_batches))
            schema = reader.schema
            audio_col = _audio_column(schema, _hf_meta(fs, path, schema))
            names = schema.names
            text_col = _pick_column(names, text_column, HF_TEXT_COLUMNS)
            if text_col is None:
                raise ValueError(f"{data_file}: no text column {text_column or HF_TEXT_COLUMNS} among {names}; "
                                 "name it with --text-column")
            _check_text_type(schema.field(text_col), data_file)
            for rb in batches:
                yield from _hf_rows(rb, audio_col, text_col, base, local, data_file, n)
                n += rb.num_rows


def _check_text_type(field: Any, data_file: str) -> None:
    """A text column must hold strings (or integers): str() of a list column packed every row's Python repr
    ("['hello', 'world']") as its transcript. ValueError naming the column, its type and the fix."""
    import pyarrow.types as pt  # noqa: PLC0415

    t = field.type
    if not (pt.is_string(t) or pt.is_large_string(t) or pt.is_string_view(t) or pt.is_integer(t)):
        raise ValueError(f"{data_file}: text column {field.name!r} holds {t}, not strings; join it into a string "
                         "column first (datasets' .map) or name another with --text-column")


def _column_or_none(rb: Any, aliases: tuple[str, ...]) -> list:
    name = _pick_column(rb.schema.names, None, aliases)
    return rb.column(name).to_pylist() if name else [None] * rb.num_rows


def _hf_rows(rb: Any, audio_col: str, text_col: str, base: int, local: str, data_file: str,
             first_row: int) -> Iterator[Item | Reject]:
    """Rows of one record batch: audio bytes -> `<arrow file>#bytes=...`, else the stored path."""
    import numpy as np  # noqa: PLC0415

    audio = rb.column(audio_col)
    parts = dict(zip([f.name for f in audio.type], audio.flatten()))
    data, paths = parts["bytes"], parts["path"].to_pylist()
    bufs = data.buffers()
    width = np.int64 if str(data.type) == "large_binary" else np.int32
    offs = np.frombuffer(bufs[1], dtype=width) if bufs[1] is not None else None
    start = (bufs[2].address - base) if bufs[2] is not None else 0
    ids, spk, lang = (_column_or_none(rb, aliases) for aliases in (_HF_ID, _HF_SPEAKER, _HF_LANGUAGE))
    texts = rb.column(text_col).to_pylist()
    valid = data.is_valid().to_pylist()
    for i in range(rb.num_rows):
        where = f"{data_file}:row {first_row + i}"
        item_id = ids[i] or (posixpath.splitext(posixpath.basename(paths[i]))[0] if paths[i] else None) \
            or f"row{first_row + i:09d}"
        if valid[i] and offs is not None:
            s, e = int(offs[data.offset + i]), int(offs[data.offset + i + 1])
            ref = byte_range_ref(local, start + s, start + e)
        elif paths[i]:
            ref = paths[i]
        else:
            yield Reject(str(item_id), where, "missing_audio: audio has neither bytes nor a path")
            continue
        text = texts[i]
        yield Item(id=str(item_id), audio=ref, text=None if text is None else str(text),
                   speaker=opt_str(spk[i]), language=opt_str(lang[i]))
