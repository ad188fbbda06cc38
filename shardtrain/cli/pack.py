"""`shardtrain synth`, `pack` and `inspect [--verify]`: corpora in, shards out, and checks of what was written.
"""
from __future__ import annotations

import argparse
import sys

from shardtrain.format.codecs import CODECS
from shardtrain.cli.common import _CREDS_HELP, _parse_storage_options, missing_local_path, one_blas_thread, report_error
from shardtrain.format.safe import printable, printable_lines


# ---- pack (owner: pack) -------------------------------------------------------------------------
def _add_pack(sub) -> None:
    p = sub.add_parser("pack", help="pack a corpus into length-sorted WebDataset shards + index")
    _add_input_args(p)
    _add_audio_args(p)
    _add_run_args(p)
    p.set_defaults(func=_cmd_pack)


def _add_input_args(p) -> None:
    """Where the corpus is and how to read it."""
    p.add_argument("input", metavar="INPUT",
                   help="corpus: folder (x.flac + x.txt, or a metadata.csv), TSV/CSV/JSONL manifest, LibriSpeech or "
                        "LJSpeech folder, Lhotse CutSet "
                        "(.jsonl/.jsonl.gz), Kaldi data dir, Hugging Face dataset (.arrow/.parquet) or Common Voice "
                        "release; any fsspec URL")
    p.add_argument("output", metavar="OUTPUT", help="dataset folder or URL (path, file://, s3://bucket/prefix)")
    p.add_argument("--source-format", default="auto",
                   help="input format: auto (detect), dir, tsv, csv, jsonl, librispeech, lhotse, kaldi, hf, "
                        "commonvoice, ljspeech, vtt (default: auto; a folder with metadata.csv is read through it)")
    p.add_argument("--split", default=None, metavar="NAME",
                   help="split of a Hugging Face DatasetDict folder (one with dataset_dict.json), e.g. train; "
                        "required for such a folder (the error lists its splits)")
    p.add_argument("--text-column", default=None,
                   help="transcript column of a Hugging Face dataset or a CSV/TSV/JSONL manifest (default: text, "
                        "transcript, sentence, transcription, ... whichever exists)")
    p.add_argument("--audio-column", default=None,
                   help="audio path column of a CSV/TSV/JSONL manifest, relative paths against its folder (default: "
                        "path, audio, audio_filepath, file_name, wav_filename, whichever exists)")
    p.add_argument("--delimiter", default=None, type=_delimiter,
                   help="field separator of a CSV/TSV manifest, one character or 'tab' (default: ',' for .csv, tab "
                        "for .tsv)")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                   help="fsspec storage option for INPUT and OUTPUT, repeatable (e.g. "
                        "client_kwargs='{\"endpoint_url\": \"http://127.0.0.1:8333\"}' or profile=NAME). " + _CREDS_HELP)


def _add_audio_args(p) -> None:
    """What is stored, and what is rejected."""
    from shardtrain.pack.config import DEFAULT_MAX_CHARS_PER_S, DEFAULT_MIN_DURATION_S

    p.add_argument("--codec", default="flac", choices=CODECS,
                   help="stored audio codec (default: flac)")
    p.add_argument("--sample-rate", type=int, default=16000, help="stored sample rate in Hz (default: 16000)")
    p.add_argument("--channels", type=int, default=1, help="stored channel count (default: 1)")
    p.add_argument("--channels-policy", default="mix", metavar="mix|first|INDEX",
                   help="how multi-channel input becomes mono (with --channels 1): mix averages the channels (a "
                        "one-sided stereo recording loses 6 dB), first keeps channel 0, INDEX keeps that channel "
                        "(files with fewer channels are rejected: missing_channel) (default: mix)")
    p.add_argument("--keep-original", action="store_true",
                   help="store input audio bytes unchanged (no transcoding, whatever codec/rate/channels)")
    p.add_argument("--no-decode-check", action="store_true",
                   help="do not fully decode audio kept byte for byte, only its last samples (faster; a header "
                        "that lies about the length is still rejected, but damage inside a file is then caught "
                        "only by `inspect --verify` or the loader)")
    p.add_argument("--target-shard-mb", type=float, default=256.0,
                   help="target shard size in MiB, estimated from headers (default: 256)")
    p.add_argument("--max-samples-per-shard", type=int, default=None,
                   help="also cut a shard after this many samples (default: no limit)")
    p.add_argument("--min-duration-s", "--min-duration", dest="min_duration", type=float,
                   default=DEFAULT_MIN_DURATION_S,
                   help="reject utterances shorter than this, reason too_short in rejects.jsonl (seconds; 0 keeps "
                        f"all; default: {DEFAULT_MIN_DURATION_S})")
    p.add_argument("--max-duration-s", "--max-duration", dest="max_duration", type=float, default=None,
                   help="reject utterances longer than this, reason too_long (seconds; default: no limit)")
    p.add_argument("--max-chars-per-s", dest="max_chars_per_s", type=float, default=DEFAULT_MAX_CHARS_PER_S,
                   help="reject transcripts with more characters than this x duration + 20, reason "
                        "impossible_target: no CTC model can align them (read speech is ~15 a second; 0 turns the "
                        f"check off; default: {DEFAULT_MAX_CHARS_PER_S:g})")


def _add_run_args(p) -> None:
    """How the pack runs: workers, engine, strictness, output."""
    import os

    p.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                   help="processes writing shards (default: CPU count, at most 8); output does not depend on it")
    p.add_argument("--engine", default="local", choices=("local", "ray"),
                   help="where tasks run: local (this machine, --workers processes) or ray (Ray tasks on a cluster; "
                        "pip install 'shardtrain[ray]'); the output is the same (default: local)")
    p.add_argument("--ray-address", default=None,
                   help="with --engine ray: cluster to join (auto, or ray://HEAD:10001); default: start a local one")
    p.add_argument("--strict", action="store_true", help="fail at the first bad item instead of rejecting it")
    p.add_argument("--overwrite", action="store_true", help="replace a different dataset already at OUTPUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")


def _delimiter(value: str) -> str:
    value = "\t" if value in ("tab", "\\t") else value
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"--delimiter must be one character or 'tab', got {value!r}")
    return value


def _cmd_pack(args) -> int:
    import json

    one_blas_thread()  # before anything imports numpy

    from shardtrain.pack.item import missing_input_message

    if missing_local_path(args.input):  # before the readers' imports: a typo answers at once
        return report_error("pack", ValueError(missing_input_message(args.input)))
    from shardtrain.pack.packer import AudioTarget, PackConfig, pack
    from shardtrain.pack.nothing import NothingAccepted
    from shardtrain.pack.shard_task import PackError

    try:
        cfg = PackConfig(
            input=args.input, output=args.output, source_format=args.source_format, text_column=args.text_column,
            audio_column=args.audio_column, delimiter=args.delimiter,
            split=args.split, storage_options=_parse_storage_options(args.storage_option) or None,
            audio=AudioTarget(codec=args.codec, sample_rate_hz=args.sample_rate, channels=args.channels,
                              keep_original=args.keep_original, verify_decode=not args.no_decode_check,
                              channel_policy=args.channels_policy),
            target_shard_mb=args.target_shard_mb, max_samples_per_shard=args.max_samples_per_shard,
            min_duration_s=args.min_duration or None, max_duration_s=args.max_duration, workers=args.workers,
            max_chars_per_s=args.max_chars_per_s or None,
            strict=args.strict, overwrite=args.overwrite, progress=not args.no_progress,
            engine=args.engine, ray_address=args.ray_address,
        )
        r = pack(cfg)
    except NothingAccepted as e:  # a runtime outcome of the input, like inputs skipped: exit status 1
        report_error("pack", e)
        return 1
    except (ValueError, PackError) as e:
        return report_error("pack", e)
    empty = r.samples == 0  # a dataset with nothing in it is a failed pack, not a success to find out about later
    if args.json:
        print(json.dumps(r.to_dict(), sort_keys=True))
        return 1 if empty else 0
    rejects = ", ".join(f"{k} {v}" for k, v in r.rejects_by_reason.items()) or "none"
    state = " (already complete; nothing written)" if r.already_complete else \
        f" ({r.shards_written} written by this run)" if r.shards_written != r.shards else ""
    print(f"packed    {r.samples} samples, {r.hours:.3f} h, {r.shards} shards{state}, {r.bytes / 1e6:.1f} MB "
          f"-> {printable(r.output)}")
    print(printable(f"rejects   {r.rejects} ({rejects})" + (f"; see {r.output}/rejects.jsonl" if r.rejects else "")))
    if r.clipped:
        print(f"clipped   {r.clipped} float files had samples past full scale, clipped at full scale (warnings above)")
    print(f"speed     {r.wall_s:.1f} s wall (scan {r.scan_s:.1f} s, layout {r.layout_s:.1f} s, write {r.write_s:.1f} s, "
          f"commit {r.commit_s:.1f} s): "
          f"{r.files_per_s:.0f} files/s, {r.audio_hours_per_s * 3600:.0f} audio s/s, {r.mb_per_s:.1f} MB/s")
    if empty:
        print(printable(f"pack: error: no utterance of {args.input} was accepted ({r.rejects} rejected: {rejects}); see "
              f"{r.output}/rejects.jsonl for each reason"), file=sys.stderr)
        return 1
    return 0


# ---- inspect (owner: pack) ----------------------------------------------------------------------
def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="summarise (and with --verify, check) a packed dataset")
    p.add_argument("dataset", metavar="DATASET", help="dataset folder or URL (path, file://, s3://bucket/prefix)")
    p.add_argument("--verify", action="store_true",
                   help="re-read every shard: sha256, tar structure vs index, decode every audio member; "
                        "exit code 1 on any problem")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                   help="fsspec storage option, repeatable (e.g. profile=NAME). " + _CREDS_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar during --verify")
    p.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args) -> int:
    import json

    from shardtrain.format.locate import nothing_there

    if missing_local_path(args.dataset):  # before pyarrow's import: a typo answers at once
        return report_error("inspect", ValueError(nothing_there(args.dataset)))
    from shardtrain.format.manifest import open_dataset
    from shardtrain.pack.verify import format_inspect, inspect, problems_to_dicts, verify

    ds = open_dataset(args.dataset, _parse_storage_options(args.storage_option) or None)  # errors: cli.app.main
    summary = inspect(ds)
    problems = verify(ds, progress=not args.no_progress) if args.verify else None
    if args.json:
        if problems is not None:
            summary["problems"] = problems_to_dicts(problems)
        print(json.dumps(summary, sort_keys=True))
    else:
        print(printable_lines(format_inspect(summary)))
        if problems is not None:
            print()
            print(f"verify    {len(ds.shards)} shards, {summary['totals']['samples']} samples: "
                  + ("OK" if not problems else f"{len(problems)} problems"))
            for p in problems:
                print(f"  {printable(p)}")
    return 1 if problems else 0


# ---- synth (owner: testing) ---------------------------------------------------------------------
def _add_synth(sub) -> None:
    p = sub.add_parser("synth", help="generate a speech corpus (espeak-ng) with transcripts")
    p.add_argument("out", metavar="OUT", help="output folder (created; existing files are overwritten)")
    p.add_argument("--n", type=int, default=200, help="number of utterances (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed for speakers, sentences and speeds (default 0)")
    p.add_argument("--layout", choices=("librispeech", "flat"), default="librispeech",
                   help="librispeech: OUT/<spk>/<chapter>/<spk>-<chapter>-<utt>.flac + .trans.txt; "
                        "flat: OUT/<id>.flac + <id>.txt (both write OUT/manifest.tsv)")
    p.add_argument("--workers", type=int, default=2, help="parallel espeak-ng jobs (default 2)")
    p.add_argument("--text-source", choices=("auto", "fortunes", "builtin"), default="auto",
                   help="sentences: fortunes when installed (auto), or built-in templates (same on every machine)")
    p.add_argument("--tone", action="store_true",
                   help="speech-like tones instead of espeak-ng speech (no system tools needed; flat layout)")
    p.add_argument("--fmt", choices=CODECS, default="flac",
                   help="audio codec for --tone (speech is always 16 kHz FLAC)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_synth)


def _cmd_synth(args) -> int:
    import csv
    import time
    from pathlib import Path

    import numpy as np
    import soundfile as sf

    from shardtrain.testing.corpus import make_corpus
    from shardtrain.testing.speech import synth_speech_corpus

    if args.n < 1:
        raise SystemExit("--n must be >= 1")
    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    t0 = time.perf_counter()
    if args.tone:
        durations_s = np.round(np.random.default_rng(args.seed).uniform(0.5, 12.0, args.n), 2).tolist()
        root = make_corpus(Path(args.out), durations_s, fmt=args.fmt, seed=args.seed)
    else:
        try:
            root = synth_speech_corpus(Path(args.out), args.n, seed=args.seed, workers=args.workers,
                                       layout=args.layout, progress=not args.no_progress,
                                       text_source=args.text_source)
        except RuntimeError as e:
            raise SystemExit(f"synth: {e}")
    elapsed = time.perf_counter() - t0
    with open(root / "manifest.tsv", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    seconds = sum(sf.info(str(root / r["path"])).duration for r in rows)
    speakers = len({r["speaker"] for r in rows})
    print(f"synth: {len(rows)} files, {seconds / 3600:.3f} h of audio ({seconds:.0f} s), {speakers} speakers, "
          f"in {elapsed:.1f} s -> {root} (manifest: {root / 'manifest.tsv'})")
    return 0
