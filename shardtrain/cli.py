"""`shardtrain` command line: thin argparse layer over the library.

Each subcommand has an `_add_<name>(sub)` that declares its flags and a `_cmd_<name>(args) -> int` that builds
the config, calls the library and prints the result. Only this module prints; the library logs.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping

from shardtrain.format.codecs import CODECS


def init_logging(rank: int = 0, verbose: bool = False) -> None:
    """One logging setup for every entry point; non-zero ranks log warnings only."""
    level = logging.DEBUG if verbose else (logging.INFO if rank == 0 else logging.WARNING)
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    from shardtrain.storage.redact import RedactingFilter

    for handler in logging.getLogger().handlers:  # -v shows botocore's request lines: never their credentials
        handler.addFilter(RedactingFilter())
    # third-party INFO lines ("Found credentials in environment variables", ...) drown ours
    for noisy in ("aiobotocore", "botocore", "s3fs", "fsspec", "urllib3", "matplotlib", "PIL", "onnx_ir", "onnxscript"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)


_CREDS_HELP = ("Credentials: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (+ AWS_ENDPOINT_URL) in the environment "
               "or use an AWS profile (AWS_PROFILE, profile=NAME), not key=/secret= here: a command line is "
               "visible to other users (ps) and kept in shell history; secret-looking values are masked in logs")


def _typed_option(key: str, typ: str, value: str):
    """A --storage-option value: a string (a secret "0123" must not become 123), unless it is a JSON object, array
    or quoted string, or true/false/null, or typed as `key:int=`, `key:float=`, `key:bool=`, `key:json=`."""
    import json

    try:
        if typ == "int":
            return int(value)
        if typ == "float":
            return float(value)
        if typ == "bool":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        looks_json = value.startswith(("{", "[", '"')) or value in ("true", "false", "null")
        if typ == "json" or (not typ and looks_json):
            return json.loads(value)
    except ValueError:
        raise SystemExit(f"--storage-option {key}:{typ or 'json'}={value!r}: not a valid {typ or 'JSON'} value") from None
    if typ not in ("", "str"):
        raise SystemExit(f"--storage-option {key}:{typ}: unknown type (use str, int, float, bool or json)")
    return value


def _parse_storage_options(pairs: list[str] | None, env: dict | None = None) -> dict:
    """`--storage-option key=value` pairs to an fsspec storage_options dict (values are strings unless typed:
    see `_typed_option`).

    When no key is given but the environment holds AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL
    (a MinIO/SeaweedFS/on-prem endpoint), they are copied in explicitly: the same values botocore would read, but
    explicit keys let the loader sign S3 URLs itself and skip starting s3fs (~0.3 s per process; shardtrain.s3http).
    """
    import os

    from shardtrain.storage.redact import SECRET_NAME_RE

    out: dict = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise SystemExit(f"--storage-option expects key=value, got {pair!r}")
        k, v = pair.split("=", 1)
        k, _, typ = k.partition(":")
        if SECRET_NAME_RE.search(k) and k != "profile":
            print(f"warning: --storage-option {k}=... puts a credential on the command line (visible in ps and "
                  "shell history); prefer AWS_* environment variables or a profile", file=sys.stderr)
        out[k] = _typed_option(k, typ, v)
    env = dict(os.environ) if env is None else env
    if "key" not in out and all(env.get(v) for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")):
        out["key"], out["secret"] = env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
        if env.get("AWS_SESSION_TOKEN"):
            out["token"] = env["AWS_SESSION_TOKEN"]
        ck = dict(out.get("client_kwargs") or {})
        ck.setdefault("endpoint_url", env["AWS_ENDPOINT_URL"])
        region = env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION")
        if region:
            ck.setdefault("region_name", region)
        out["client_kwargs"] = ck
    from shardtrain.storage.redact import register_options, register_secret

    register_options(out)  # masked in every log line from now on
    register_secret(env.get("AWS_SECRET_ACCESS_KEY"))
    register_secret(env.get("AWS_SESSION_TOKEN"))
    register_secret(env.get("AWS_ACCESS_KEY_ID"), 12)
    return out


def _one_line(e: BaseException) -> str:
    """An error as one line: a DataLoader worker's re-raised error carries the worker's traceback in its
    message; its last line is the error itself."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()] or [type(e).__name__]
    last = lines[-1]
    if len(lines) > 1 and ": " in last and "." in last.split(": ", 1)[0]:  # "pkg.mod.StreamError: message"
        last = last.split(": ", 1)[1]
    return last


def _run_errors() -> tuple[type[BaseException], ...]:
    """Errors a run reports in one line with their fix (not a traceback): unreadable or refused storage, a
    broken dataset, too much bad data. Programming errors keep their tracebacks."""
    from shardtrain.format.manifest import DatasetError
    from shardtrain.load.reader import StreamError

    return (StreamError, DatasetError, OSError)


def _bound_malloc_heap(env: Mapping[str, str] | None = None) -> bool:
    """Fix glibc's mmap threshold at 1 MB for a training process; returns True when set.

    glibc raises the threshold each time a large block is freed (up to 32 MB); from then on the variable-sized
    batch tensors of training (every batch has its own length) come from the heap, which fragments and never
    shrinks: the demo's trainer grew to ~3.9 GB RSS. With a fixed threshold big tensors stay in mmap and go back
    to the OS when freed (40 tiny_cpu steps on 60 s batches: 1.8 GB and growing -> ~1.2 GB flat, same speed;
    benchmarks/bench_train_rss.py). Skipped when MALLOC_MMAP_THRESHOLD_ is set (the user chose) or off glibc."""
    import os

    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in (os.environ if env is None else env):
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


# ---- pack (owner: pack) -------------------------------------------------------------------------
def _add_pack(sub) -> None:
    import os

    p = sub.add_parser("pack", help="pack a corpus into length-sorted WebDataset shards + index")
    p.add_argument("input", metavar="INPUT",
                   help="corpus: folder (x.flac + x.txt), TSV/CSV/JSONL manifest, LibriSpeech folder, Lhotse CutSet "
                        "(.jsonl/.jsonl.gz), Kaldi data dir, Hugging Face dataset (.arrow/.parquet) or Common Voice "
                        "release; any fsspec URL")
    p.add_argument("output", metavar="OUTPUT", help="dataset folder or URL (path, file://, s3://bucket/prefix)")
    p.add_argument("--source-format", default="auto",
                   help="input format: auto (detect), dir, tsv, csv, jsonl, librispeech, lhotse, kaldi, hf, "
                        "commonvoice (default: auto)")
    p.add_argument("--text-column", default=None,
                   help="transcript column of a Hugging Face dataset input (default: text, sentence, transcription, "
                        "... whichever exists)")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                   help="fsspec storage option for INPUT and OUTPUT, repeatable (e.g. "
                        "client_kwargs='{\"endpoint_url\": \"http://127.0.0.1:8333\"}' or profile=NAME). " + _CREDS_HELP)
    p.add_argument("--codec", default="flac", choices=CODECS,
                   help="stored audio codec (default: flac)")
    p.add_argument("--sample-rate", type=int, default=16000, help="stored sample rate in Hz (default: 16000)")
    p.add_argument("--channels", type=int, default=1, help="stored channel count (default: 1)")
    p.add_argument("--keep-original", action="store_true",
                   help="store input audio bytes unchanged (no transcoding, whatever codec/rate/channels)")
    p.add_argument("--no-decode-check", action="store_true",
                   help="do not fully decode audio kept byte for byte (faster; a truncated input file is then "
                        "caught only by `inspect --verify` or the loader)")
    p.add_argument("--target-shard-mb", type=float, default=256.0,
                   help="target shard size in MiB, estimated from headers (default: 256)")
    p.add_argument("--max-samples-per-shard", type=int, default=None,
                   help="also cut a shard after this many samples (default: no limit)")
    p.add_argument("--min-duration", type=float, default=None, help="reject utterances shorter than this (seconds)")
    p.add_argument("--max-duration", type=float, default=None, help="reject utterances longer than this (seconds)")
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
    p.set_defaults(func=_cmd_pack)


def _cmd_pack(args) -> int:
    import json

    from shardtrain.pack.packer import PackConfig, pack
    from shardtrain.pack.shard_task import PackError

    try:
        cfg = PackConfig(
            input=args.input, output=args.output, source_format=args.source_format, text_column=args.text_column,
            storage_options=_parse_storage_options(args.storage_option) or None, codec=args.codec,
            sample_rate_hz=args.sample_rate, channels=args.channels, keep_original=args.keep_original,
            decode_check=not args.no_decode_check,
            target_shard_mb=args.target_shard_mb, max_samples_per_shard=args.max_samples_per_shard,
            min_duration_s=args.min_duration, max_duration_s=args.max_duration, workers=args.workers,
            strict=args.strict, overwrite=args.overwrite, progress=not args.no_progress,
            engine=args.engine, ray_address=args.ray_address,
        )
        r = pack(cfg)
    except (ValueError, PackError) as e:
        print(f"pack: error: {e}", file=sys.stderr)
        return 2
    empty = r.samples == 0  # a dataset with nothing in it is a failed pack, not a success to find out about later
    if args.json:
        print(json.dumps(r.to_dict(), sort_keys=True))
        return 1 if empty else 0
    rejects = ", ".join(f"{k} {v}" for k, v in r.rejects_by_reason.items()) or "none"
    state = " (already complete; nothing written)" if r.already_complete else \
        f" ({r.shards_written} written by this run)" if r.shards_written != r.shards else ""
    print(f"packed    {r.samples} samples, {r.hours:.3f} h, {r.shards} shards{state}, {r.bytes / 1e6:.1f} MB "
          f"-> {r.output}")
    print(f"rejects   {r.rejects} ({rejects})" + (f"; see {r.output}/rejects.jsonl" if r.rejects else ""))
    print(f"speed     {r.wall_s:.1f} s wall (probe {r.probe_s:.1f} s, write {r.write_s:.1f} s): "
          f"{r.files_per_s:.0f} files/s, {r.audio_hours_per_s * 3600:.0f} audio s/s, {r.mb_per_s:.1f} MB/s")
    if empty:
        print(f"pack: error: no utterance of {args.input} was accepted ({r.rejects} rejected: {rejects}); see "
              f"{r.output}/rejects.jsonl for each reason", file=sys.stderr)
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

    from shardtrain.format.manifest import DatasetError, open_dataset
    from shardtrain.pack.verify import format_inspect, inspect, problems_to_dicts, verify

    try:
        ds = open_dataset(args.dataset, _parse_storage_options(args.storage_option) or None)
        summary = inspect(ds)
    except DatasetError as e:
        print(f"inspect: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # storage refused or unreachable: one line naming the URL
        print(f"inspect: error: {_one_line(e)}", file=sys.stderr)
        return 1
    problems = verify(ds, progress=not args.no_progress) if args.verify else None
    if args.json:
        if problems is not None:
            summary["problems"] = problems_to_dicts(problems)
        print(json.dumps(summary, sort_keys=True))
    else:
        print(format_inspect(summary))
        if problems is not None:
            print()
            print(f"verify    {len(ds.shards)} shards, {summary['totals']['samples']} samples: "
                  + ("OK" if not problems else f"{len(problems)} problems"))
            for p in problems:
                print(f"  {p}")
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


# ---- bench (owner: stream) ----------------------------------------------------------------------
def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="measure loader throughput on a dataset",
                       description="Run the shardtrain loader over DATASET and report audio seconds/s, samples/s, "
                                   "padding efficiency, first-batch latency, peak RSS and per-stage times.")
    p.add_argument("dataset", metavar="DATASET", help="dataset folder or URL (s3://bucket/prefix)")
    p.add_argument("--epochs", type=int, default=1, help="epochs to run (default 1; 0 = until --max-batches)")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes (default 0: threads only)")
    p.add_argument("--decode-threads", type=int, default=3,
                   help="decode threads per process (default 3: one more than 2 cores; decoding runs without the GIL)")
    p.add_argument("--pcm-dtype", choices=("float32", "int16"), default="float32",
                   help="batch dtype; int16 halves host memory traffic and converts on the device")
    p.add_argument("--max-batch-seconds", type=float, default=300.0, help="audio seconds per batch (default 300)")
    p.add_argument("--max-batch-size", type=int, default=None, help="utterances per batch cap")
    p.add_argument("--batches-per-chunk", type=int, default=1,
                   help="batches per planned read; more mixes utterances across batches (default 1)")
    p.add_argument("--prefetch-chunks", type=int, default=2, help="chunks read and decoded ahead (default 2)")
    p.add_argument("--world-size", type=int, default=1, help="simulated world size (default 1)")
    p.add_argument("--rank", type=int, default=0, help="simulated rank (default 0)")
    p.add_argument("--seed", type=int, default=0, help="plan seed (default 0)")
    p.add_argument("--step-ms", type=float, default=0.0, help="simulated trainer step time; reports data wait %%")
    p.add_argument("--device", default="cpu", help="copy batches to this device, e.g. cuda (default cpu)")
    p.add_argument("--augment", action="store_true", help="also run the augmentation + log-mel chain per batch")
    p.add_argument("--cache-dir", default=None, help="local shard cache for remote datasets")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                   help="fsspec storage option, repeatable. " + _CREDS_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args) -> int:
    import json

    from shardtrain.load.bench import BenchConfig, bench_loader
    from shardtrain.load.plan import BucketConfig
    from shardtrain.load.config import StreamConfig
    from shardtrain.world import World

    stream = StreamConfig(
        bucket=BucketConfig(max_batch_seconds=args.max_batch_seconds, max_batch_size=args.max_batch_size,
                            batches_per_chunk=args.batches_per_chunk),
        prefetch_chunks=args.prefetch_chunks,
        num_workers=args.workers, decode_threads=args.decode_threads, cache_dir=args.cache_dir,
        pcm_dtype=args.pcm_dtype)
    bench = BenchConfig(epochs=args.epochs or None, max_batches=args.max_batches, step_ms=args.step_ms,
                        device=args.device, progress=not args.no_progress)
    try:
        out = bench_loader(args.dataset, world=World(rank=args.rank, world_size=args.world_size), seed=args.seed,
                           stream=stream, bench=bench, storage_options=_parse_storage_options(args.storage_option),
                           make_augment=_bench_augmenter(args.device) if args.augment else None)
    except _run_errors() as e:
        print(f"bench: error: {_one_line(e)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        width = max(map(len, out))
        for k, v in out.items():
            print(f"{k:<{width}}  {v}")
    return 0


def _bench_augmenter(device: str):
    """`bench --augment`: the trainer's default augmentation + log-mel chain, built at the dataset's rate."""
    def make(sample_rate_hz: int):
        from shardtrain.train.augment import AugmentConfig, DeviceAugment
        from shardtrain.train.features import FeatureConfig

        aug = DeviceAugment(AugmentConfig(), FeatureConfig(), sample_rate_hz).to(device)
        return lambda waves, lengths, gen: aug(waves, lengths, gen, train=True)
    return make


# ---- train (owner: train) -----------------------------------------------------------------------
def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model (one process or under torchrun)",
                       description="Train a CTC recogniser on streamed shards. Under torchrun, rank and world size "
                                   "come from its environment; on a torchrun restart the run resumes by itself.")
    p.add_argument("--data", required=True, action="append",
                   help="training dataset URL (path, file://, s3://); repeat it to train on a weighted mixture")
    p.add_argument("--weight", type=float, action="append", default=[],
                   help="weight of each --data, in order (once per --data; default equal): per epoch a dataset gives "
                        "weight / sum of weights of the audio, every sample once before any repeats")
    p.add_argument("--val-data", default="", help="validation dataset URL (omit to skip validation)")
    p.add_argument("--pipeline", default="tiny_cpu", help="preset: a name in pipelines/ (tiny_cpu, librispeech_base), module:function, or path/file.py:function")
    p.add_argument("--max-steps", type=int, default=None, help="optimiser steps (overrides the preset)")
    p.add_argument("--out", required=True, help="run directory: config.json, metrics.jsonl, checkpoints/")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set stream.bucket.max_batch_seconds=30 (repeatable)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option for s3:// URLs (repeatable; values are strings unless typed, e.g. "
                        "KEY:int=5, or a JSON object/true/false). " + _CREDS_HELP)
    p.set_defaults(func=_cmd_train)


def _cmd_train(args) -> int:
    import dataclasses
    import json
    import os

    from pipelines import load_pipeline
    from shardtrain.train.overrides import apply_overrides
    from shardtrain.train.loop import train
    from shardtrain.world import World

    world = World.from_env()
    init_logging(world.rank, args.verbose)
    _bound_malloc_heap()
    try:
        cfg = apply_overrides(load_pipeline(args.pipeline), args.overrides)
        paths = {"data_url": args.data[0], "val_data_url": args.val_data, "out_dir": args.out}
        if len(args.data) > 1 or args.weight:
            paths.update(mix_urls=tuple(args.data[1:]), mix_weights=tuple(args.weight))
        if args.max_steps is not None:
            paths["max_steps"] = args.max_steps
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **paths))
    except ValueError as e:
        raise SystemExit(f"train: {e}") from None
    # torchrun sets TORCHELASTIC_RESTART_COUNT; after a failure, continue from the last checkpoint on our own
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    try:
        result = train(cfg, world, resume=args.resume or attempt > 0, attempt=attempt,
                       storage_options=_parse_storage_options(args.storage_option) or None)
    except ValueError as e:  # configuration problems: one line naming the flag, not a traceback per rank
        raise SystemExit(f"train: {e}") from None
    except _run_errors() as e:  # storage refused/unreachable, bad dataset or resume state: one line per rank
        where = f" (rank {world.rank})" if world.world_size > 1 else ""
        print(f"train: error{where}: {_one_line(e)}", file=sys.stderr)
        return 1
    if world.is_main:
        print(json.dumps(result, sort_keys=True))
    return 0


# ---- augment-demo (owner: augment) --------------------------------------------------------------
def _add_augment_demo(sub) -> None:
    p = sub.add_parser("augment-demo", help="write augmented examples as WAV files and spectrogram PNGs",
                       description="Run the device augmentation chain on a few utterances and write, per example, "
                                   "the original and augmented audio (WAV) and a PNG with three panels: original "
                                   "log-mel, augmented log-mel, and the model's input (normalised + SpecAugment).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", metavar="DATASET_URL",
                     help="dataset packed by `shardtrain pack` (path or s3:// URL); its first --n utterances are used")
    src.add_argument("--tone", action="store_true",
                     help="use generated speech-like waves (shardtrain.testing.synth_wave); the default without --data")
    p.add_argument("--out", required=True, help="output folder for the WAV and PNG files (created if missing)")
    p.add_argument("--n", type=int, default=4, help="number of examples (one batch)")
    p.add_argument("--seed", type=int, default=0, help="seed of the augmentation generator (and of the tones)")
    p.add_argument("--duration-s", type=float, default=4.0, help="with --tone: length of the longest example in seconds")
    p.add_argument("--noise-data", metavar="DATASET_URL", default=None,
                   help="packed noise dataset for additive noise (default: generated white/pink/brown noise)")
    p.add_argument("--rir-data", metavar="DATASET_URL", default=None,
                   help="packed room-impulse-response dataset for reverb (default: synthetic RIRs)")
    p.add_argument("--p", type=float, default=1.0,
                   help="probability of every wave op (speed, reverb, noise, gain) per example; 1.0 shows them all")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                   help="fsspec storage option for s3:// URLs (repeatable), e.g. client_kwargs='{\"endpoint_url\": ...}'. "
                        + _CREDS_HELP)
    p.set_defaults(func=_cmd_augment_demo)


def _cmd_augment_demo(args) -> int:
    import torch

    from shardtrain.train.augment import AugmentConfig, GainConfig, NoiseBank, NoiseConfig, ReverbConfig, SpeedConfig
    from shardtrain.train.features import FeatureConfig
    from shardtrain.train.showcase import write_examples

    if args.n < 1:
        raise SystemExit("--n must be >= 1")
    so = _parse_storage_options(args.storage_option) or None
    rate = FeatureConfig().sample_rate_hz
    if args.data:
        bank = NoiseBank.from_dataset(args.data, max_seconds=1e9, sample_rate_hz=rate, storage_options=so,
                                      max_clips=args.n)
        names, waves, lengths = bank.names, bank.waves, bank.lengths
    else:
        from shardtrain.testing.corpus import synth_wave

        clips = [torch.from_numpy(synth_wave(args.duration_s * (1.0 - 0.15 * i), rate, seed=args.seed + i))
                 for i in range(args.n)]
        names = [f"tone{i}" for i in range(args.n)]
        lengths = torch.tensor([c.shape[0] for c in clips])
        waves = torch.nn.utils.rnn.pad_sequence(clips, batch_first=True)
    aug = AugmentConfig(speed=SpeedConfig(p=args.p, factors=(0.9, 1.1)),
                        reverb=ReverbConfig(p=args.p, rir_url=args.rir_data),
                        noise=NoiseConfig(p=args.p, snr_db=(5.0, 20.0), noise_url=args.noise_data),
                        gain=GainConfig(p=args.p))
    for w in write_examples(waves, lengths, names, aug, args.out, args.seed, so):
        print(f"{w['orig']}  {w['aug']}  {w['png']}  ({w['samples_in']} -> {w['samples_out']} samples"
              f"{', peak-normalised' if w['peak_normalised'] else ''})")
    return 0


# ---- transcribe / evaluate / export (owner: infer) ----------------------------------------------
def _add_checkpoint_args(p) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="run directory (the --out of `shardtrain train`) or one checkpoints/step_NNNNNN directory")
    p.add_argument("--which", choices=("latest", "best"), default="latest",
                   help="with a run directory: the newest checkpoint or the one with the lowest val_loss")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1, ...")


def _add_transcribe(sub) -> None:
    p = sub.add_parser("transcribe", help="transcribe audio files, folders or datasets with a trained model",
                       description="Greedy CTC transcripts, batched by duration; one JSON line per utterance "
                                   "{key, text, duration_s, source, and reference + cer when a transcript is known}.")
    _add_checkpoint_args(p)
    p.add_argument("inputs", metavar="INPUT", nargs="+",
                   help="audio file, folder (searched recursively; <name>.txt or LibriSpeech *.trans.txt are "
                        "references), or dataset folder / s3:// URL packed by `shardtrain pack`")
    p.add_argument("--out", metavar="FILE.jsonl", default=None, help="write the JSON lines here (default: stdout)")
    p.add_argument("--max-batch-seconds", type=float, default=120.0,
                   help="padded audio seconds per batch (default 120)")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help="fsspec storage option for s3://")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_transcribe)


def _trained_model(args):
    """(TrainedModel, TranscribeConfig) from the flags `transcribe` and `evaluate` share."""
    from shardtrain.infer.checkpoint_model import load_trained
    from shardtrain.infer.transcribe import TranscribeConfig

    tm = load_trained(args.checkpoint, device=args.device, which=args.which)
    cfg = TranscribeConfig(max_batch_seconds=args.max_batch_seconds, progress=not args.no_progress,
                           storage_options=_parse_storage_options(args.storage_option) or None)
    return tm, cfg


def _cmd_transcribe(args) -> int:
    import json
    import time

    from shardtrain.infer.checkpoint_model import CheckpointError
    from shardtrain.infer.transcribe import Transcriber

    try:
        tm, cfg = _trained_model(args)
    except (CheckpointError, ValueError) as e:
        print(f"transcribe: error: {e}", file=sys.stderr)
        return 2
    t = Transcriber(tm, cfg)
    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    n, audio_s, cers, t0 = 0, 0.0, [], time.perf_counter()
    try:
        for row in t.rows(args.inputs):
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            n, audio_s = n + 1, audio_s + row["duration_s"]
            if "cer" in row:
                cers.append(row["cer"])
    except FileNotFoundError as e:
        print(f"transcribe: error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.out:
            out.close()
    wall = time.perf_counter() - t0
    cer = f", mean utterance CER {sum(cers) / len(cers):.3f} over {len(cers)} with references" if cers else ""
    print(f"transcribe: {n} utterances, {audio_s:.1f} audio s in {wall:.1f} s (real-time factor "
          f"{wall / max(audio_s, 1e-9):.3f}){cer}" + (f" -> {args.out}" if args.out else ""), file=sys.stderr)
    if t.errors:
        print(f"transcribe: {len(t.errors)} inputs skipped: " + "; ".join(f"{e['input']} ({e['reason']}: "
              f"{e['detail'][:80]})" for e in t.errors[:5]), file=sys.stderr)
    return 1 if t.errors else 0


def _add_evaluate(sub) -> None:
    p = sub.add_parser("evaluate", help="CER/WER of a trained model on datasets, with the edit split and worst utterances",
                       description="Transcribe every utterance of each --data and score it against its reference; "
                                   "prints a Markdown table (or JSON with --json).")
    _add_checkpoint_args(p)
    p.add_argument("--data", action="append", required=True, metavar="URL",
                   help="dataset folder or s3:// URL (or a folder of audio with references); repeatable")
    p.add_argument("--worst", type=int, default=5, help="worst utterances listed per dataset (default 5)")
    p.add_argument("--out", metavar="FILE.json", default=None, help="also write the JSON results here")
    p.add_argument("--json", action="store_true", help="print JSON instead of the Markdown table")
    p.add_argument("--max-batch-seconds", type=float, default=120.0, help="padded audio seconds per batch")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help="fsspec storage option for s3://")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_evaluate)


def _cmd_evaluate(args) -> int:
    import json

    from shardtrain.infer.checkpoint_model import CheckpointError
    from shardtrain.infer.score import evaluate, markdown_table

    try:
        tm, cfg = _trained_model(args)
        results, errors = evaluate(tm, args.data, cfg, worst_n=args.worst)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    doc = {"checkpoint": str(tm.path), "step": tm.step, "datasets": results, "skipped": errors}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, ensure_ascii=False)
    print(json.dumps(doc, ensure_ascii=False) if args.json else markdown_table(results))
    if errors:
        print(f"evaluate: {len(errors)} samples skipped (see 'skipped' in the JSON)", file=sys.stderr)
    unscored = [u for u, s in results.items() if s["utterances"] == 0]
    if unscored:
        print(f"evaluate: no references in {', '.join(unscored)}: nothing was scored", file=sys.stderr)
    return 1 if errors or unscored else 0


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a trained model to ONNX (optionally int8-quantized)",
                       description="ONNX graph from raw 16 kHz audio (feature front end inside) to CTC log-probs, "
                                   "dynamic batch and time axes; --quantize int8 adds OUT.int8.onnx (ONNX Runtime "
                                   "dynamic quantization).")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="run directory or checkpoints/step_NNNNNN directory")
    p.add_argument("out", metavar="OUT.onnx", help="output file")
    p.add_argument("--which", choices=("latest", "best"), default="latest", help="checkpoint of a run directory")
    p.add_argument("--quantize", choices=("int8",), default=None, help="also write an int8 model beside OUT")
    p.add_argument("--no-features", action="store_true",
                   help="export the encoder alone (input: log-mel feats + feat_lengths), without the front end")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args) -> int:
    from shardtrain.infer.checkpoint_model import CheckpointError, load_trained
    from shardtrain.infer.export import export_onnx

    try:
        tm = load_trained(args.checkpoint, device="cpu", which=args.which, qat=False)
        r = export_onnx(tm, args.out, with_features=not args.no_features, quantize=args.quantize)
    except (CheckpointError, ValueError) as e:
        print(f"export: error: {e}", file=sys.stderr)
        return 2
    print(f"export: {r.path} ({r.bytes / 1e6:.1f} MB, input {'waves' if r.with_features else 'feats'}, "
          f"step {tm.step}, {r.export_s:.1f} s)")
    if r.quantized_path and r.quantized_bytes:
        print(f"export: {r.quantized_path} ({r.quantized_bytes / 1e6:.1f} MB, int8 dynamic quantization)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardtrain",
        description="Pack speech corpora into shards, stream them, train, and benchmark the loader.",
    )
    from shardtrain._version import __version__

    parser.add_argument("--version", action="version", version=f"shardtrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_synth, _add_pack, _add_inspect, _add_bench, _add_train, _add_augment_demo, _add_transcribe,
                _add_evaluate, _add_export):
        add(sub)
    for p in sub.choices.values():  # `shardtrain pack -v ...` too; SUPPRESS keeps a -v given before the command
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    init_logging(0, args.verbose)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
