"""`shardtrain transcribe`, `evaluate` and `export`: using a trained checkpoint (shardtrain.infer).

Inputs are what `pack` reads: a packed dataset (manifest.json) goes to the loader; an audio file or a local folder
of audio (LibriSpeech trees included) to infer's own folder reader (it keeps files without transcripts); anything
else (a Kaldi data dir -- segments and text honoured --, a Common Voice release or TSV, a Hugging Face dataset, a
tsv/csv/jsonl/Lhotse manifest) is enumerated here with pack's source readers (the CLI may import pack; infer may
not) and handed to infer as plain utterances. What no reader understands, or a pack that has not finished, is
refused in one line (exit 2) before the model runs.
"""
from __future__ import annotations

import sys
from shardtrain.cli.common import _parse_storage_options



# ---- transcribe / evaluate / export (owner: infer) ----------------------------------------------
def _add_checkpoint_args(p) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="run directory or s3:// URL (the --out of `shardtrain train`) or one "
                        "checkpoints/step_NNNNNN directory")
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
    _add_input_args(p)
    p.set_defaults(func=_cmd_transcribe)


def _add_input_args(p) -> None:
    p.add_argument("--window-seconds", type=float, default=30.0,
                   help="audio longer than this is decoded and run window by window, bounding memory (default 30)")
    p.add_argument("--source-format", default="auto",
                   help="input layout when not a packed dataset, as for `shardtrain pack` (default auto)")
    p.add_argument("--text-column", default=None, help="transcript column of a Hugging Face dataset input")
    p.add_argument("--split", default=None, metavar="NAME",
                   help="split of a Hugging Face DatasetDict input (a folder with dataset_dict.json), e.g. test; "
                        "required for such a folder (the error lists its splits)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _resolve_inputs(urls: list[str], args, storage_options: dict | None) -> list:
    """Each input as infer takes it: a dataset URL, a local audio path, or an UtteranceSource built with pack's
    readers. Raises ValueError (one line naming the input and what it expected) for anything else."""
    from pathlib import Path

    from shardtrain import storage
    from shardtrain.format.manifest import shard_name
    from shardtrain.infer.audio_in import Utterance
    from shardtrain.infer.transcribe import AUDIO_EXTS, UtteranceSource, is_dataset
    from shardtrain.pack.sources import Reject, iter_items, resolve_format

    out: list = []
    for url in urls:
        if is_dataset(url, storage_options):
            out.append(url)
            continue
        local = storage.is_local(url)
        path = Path(url[len("file://"):] if url.startswith("file://") else url)
        if local and path.is_file() and path.suffix.lower() in AUDIO_EXTS:
            out.append(str(path))
            continue
        if local and path.is_dir() and any((path / n).exists() for n in ("index.parquet", shard_name(0))):
            raise ValueError(f"{url}: a dataset whose pack has not finished (shards but no manifest.json); "
                             "re-run the same `shardtrain pack` command to finish it (it resumes)")
        try:
            fmt = resolve_format(url, args.source_format, storage_options)
        except (ValueError, OSError) as e:
            raise ValueError(f"{url}: not a packed dataset (no manifest.json), nor an input `pack` reads: "
                             f"{' '.join(str(e).split())}") from None
        if local and fmt in ("dir", "librispeech"):
            out.append(str(path))
            continue
        items, rejects = [], []
        try:
            for x in iter_items(url, fmt, storage_options, text_column=args.text_column, split=args.split):
                if isinstance(x, Reject):
                    rejects.append((x.id or x.path, x.reason))
                else:
                    items.append(Utterance(key=x.id, audio=x.audio, reference=x.text, start_s=x.start_s,
                                           duration_s=x.duration_s))
        except (ValueError, OSError) as e:
            raise ValueError(f"{url} ({fmt}): {' '.join(str(e).split())}") from None
        out.append(UtteranceSource(name=url, items=items, rejects=rejects))
    return out


def _trained_model(args):
    """(TrainedModel, TranscribeConfig) from the flags `transcribe` and `evaluate` share."""
    from shardtrain.infer.checkpoint_model import load_trained
    from shardtrain.infer.transcribe import TranscribeConfig

    storage_options = _parse_storage_options(args.storage_option) or None
    tm = load_trained(args.checkpoint, device=args.device, which=args.which, storage_options=storage_options)
    cfg = TranscribeConfig(max_batch_seconds=args.max_batch_seconds, window_seconds=args.window_seconds,
                           progress=not args.no_progress, storage_options=storage_options)
    return tm, cfg


def _cmd_transcribe(args) -> int:
    import json
    import time

    from shardtrain.format.manifest import DatasetError
    from shardtrain.infer.checkpoint_model import CheckpointError
    from shardtrain.infer.score import escape_control
    from shardtrain.infer.transcribe import Transcriber

    try:
        tm, cfg = _trained_model(args)
        inputs = _resolve_inputs(args.inputs, args, cfg.storage_options)
    except (CheckpointError, ValueError) as e:
        print(f"transcribe: error: {escape_control(str(e))}", file=sys.stderr)
        return 2
    t = Transcriber(tm, cfg)
    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    n, failed, audio_s, cers, t0 = 0, 0, 0.0, [], time.perf_counter()
    try:
        for row in t.rows(inputs):
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            if "error" in row:
                failed += 1
                continue
            n, audio_s = n + 1, audio_s + row["duration_s"]
            if "cer" in row:
                cers.append(row["cer"])
    except (FileNotFoundError, DatasetError) as e:
        print(f"transcribe: error: {escape_control(str(e))}", file=sys.stderr)
        return 2
    finally:
        if args.out:
            out.close()
    wall = time.perf_counter() - t0
    cer = f", mean utterance CER {sum(cers) / len(cers):.3f} over {len(cers)} with references" if cers else ""
    print(f"transcribe: {n} utterances, {audio_s:.1f} audio s in {wall:.1f} s (real-time factor "
          f"{wall / max(audio_s, 1e-9):.3f}){cer}" + (f" -> {args.out}" if args.out else ""), file=sys.stderr)
    if t.errors:
        print(f"transcribe: {len(t.errors)} inputs skipped ({failed} rows with an \"error\" field): "
              + escape_control("; ".join(f"{e['input']} ({e['reason']}: {e['detail'][:80]})" for e in t.errors[:5])),
              file=sys.stderr)
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
    _add_input_args(p)
    p.set_defaults(func=_cmd_evaluate)


def _cmd_evaluate(args) -> int:
    import json

    from shardtrain.format.manifest import DatasetError
    from shardtrain.infer.checkpoint_model import CheckpointError
    from shardtrain.infer.score import escape_control, evaluate, markdown_table
    from shardtrain.train.normalize import describe_chars

    twice = sorted({d for d in args.data if args.data.count(d) > 1})
    if twice:  # results are keyed by input: the second would overwrite the first's row
        raise SystemExit(f"evaluate: error: --data {twice[0]} is given more than once")
    try:
        tm, cfg = _trained_model(args)
        results, errors = evaluate(tm, _resolve_inputs(args.data, args, cfg.storage_options), cfg,
                                   worst_n=args.worst)
    except (CheckpointError, ValueError, FileNotFoundError, DatasetError) as e:
        print(f"evaluate: error: {escape_control(str(e))}", file=sys.stderr)
        return 2
    doc = {"checkpoint": str(tm.path), "step": tm.step, "datasets": results, "skipped": errors}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, ensure_ascii=False)
    print(json.dumps(doc, ensure_ascii=False) if args.json else markdown_table(results))
    for name, s in results.items():
        if s["missing_chars"]:
            print(escape_control(f"evaluate: {name}: reference characters the model's vocabulary lacks (it can "
                                 f"never emit them): {describe_chars(s['missing_chars'])}"), file=sys.stderr)
        if s["unscored"]:
            print(escape_control(f"evaluate: {name}: {s['unscored']} utterances without a reference were not "
                                 "scored"), file=sys.stderr)
    if errors:
        print(f"evaluate: {len(errors)} samples failed and were not scored (see 'skipped' in the JSON)",
              file=sys.stderr)
    return 1 if errors else 0


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a trained model to ONNX (optionally int8-quantized)",
                       description="ONNX graph from raw 16 kHz audio (feature front end inside) to CTC log-probs, "
                                   "dynamic batch and time axes; --quantize int8 adds OUT.int8.onnx (ONNX Runtime "
                                   "dynamic quantization).")
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="run directory or s3:// URL, or one checkpoints/step_NNNNNN directory")
    p.add_argument("out", metavar="OUT.onnx", help="output file")
    p.add_argument("--which", choices=("latest", "best"), default="latest", help="checkpoint of a run directory")
    p.add_argument("--quantize", choices=("int8",), default=None, help="also write an int8 model beside OUT")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                   help="fsspec storage option for an s3:// checkpoint")
    p.add_argument("--no-features", action="store_true",
                   help="export the encoder alone (input: log-mel feats + feat_lengths), without the front end")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args) -> int:
    from shardtrain.infer.checkpoint_model import CheckpointError, load_trained
    from shardtrain.infer.export import export_onnx

    try:
        tm = load_trained(args.checkpoint, device="cpu", which=args.which, qat=False,
                          storage_options=_parse_storage_options(args.storage_option) or None)
        r = export_onnx(tm, args.out, with_features=not args.no_features, quantize=args.quantize)
    except (CheckpointError, ValueError) as e:
        print(f"export: error: {e}", file=sys.stderr)
        return 2
    print(f"export: {r.path} ({r.bytes / 1e6:.1f} MB, input {'waves' if r.with_features else 'feats'}, "
          f"step {tm.step}, {r.export_s:.1f} s)")
    if r.quantized_path and r.quantized_bytes:
        print(f"export: {r.quantized_path} ({r.quantized_bytes / 1e6:.1f} MB, int8 dynamic quantization)")
    return 0
