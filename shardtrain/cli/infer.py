"""`shardtrain transcribe`, `evaluate` and `export`: using a trained checkpoint (shardtrain.infer).
"""
from __future__ import annotations

import sys
from shardtrain.cli.common import _parse_storage_options



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
