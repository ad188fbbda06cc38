"""Inference speed and accuracy: PyTorch vs ONNX Runtime float32 vs ONNX Runtime int8 (dynamic quantization),
batch 1 and batched, as real-time factor (wall seconds per audio second; lower is faster) and CER on the demo's
validation set (espeak-ng speech, seed 1, as scripts/demo.py synthesises it).

    python -m benchmarks.infer.bench_infer                              # trains a tiny model first (~5 min on 2 cores)
    python -m benchmarks.infer.bench_infer --checkpoint demo_out/run    # the demo's model
    python -m benchmarks.infer.bench_infer --checkpoint RUN --devices cpu,cuda   # adds PyTorch on the GPU (and ORT CUDA
                                                                           # when onnxruntime-gpu is installed)

Without --checkpoint: synthesises --train-utts utterances (seed 0), packs them and trains tiny_cpu (or --pipeline)
for --steps steps, once per work dir (cached). The model is exported once (feature front end inside the graph)
and quantized to int8. Every runner gets the same decoded float32 waves; timings include features, the encoder and
greedy decoding, and are the best of --repeats passes. Threads: --threads for torch and ONNX Runtime alike.
Batched: duration-sorted batches of at most --batch-seconds padded audio (what `shardtrain transcribe` does).
Prints one JSON line and a Markdown table; --out-dir writes bench_infer.json/.md there.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch


from benchmarks.common import DEFAULT_WORK_DIR, git_sha, machine, prepare_corpus
from shardtrain.infer.checkpoint_model import load_trained  # noqa: E402
from shardtrain.infer.export import OnnxRecognizer, export_onnx  # noqa: E402
from shardtrain.infer.score import Score  # noqa: E402

log = logging.getLogger("bench_infer")


def train_model(work: Path, args) -> Path:
    """tiny_cpu (or --pipeline) trained for --steps on --train-utts espeak utterances; cached in the work dir."""
    run = work / f"run-{args.pipeline}-{args.train_utts}-{args.steps}{'-qat' if args.qat else ''}"
    if (run / "checkpoints").is_dir() and any((run / "checkpoints").glob("step_*")):
        return run
    from pipelines import load_pipeline
    from shardtrain.pack.packer import PackConfig, pack
    from shardtrain.train.loop import train
    from shardtrain.train.overrides import apply_overrides
    from shardtrain.world import World

    corpus = prepare_corpus(work, args.train_utts, kind="speech", seed=0)
    data = work / f"ds-train-{args.train_utts}"
    if not (data / "manifest.json").exists():
        pack(PackConfig(input=str(corpus), output=str(data), target_shard_mb=16, progress=False))
    cfg = apply_overrides(load_pipeline(args.pipeline), [
        f"train.data_url={data}", f"train.out_dir={run}", f"train.max_steps={args.steps}", "train.val_every_steps=0",
        "train.progress=false", "train.tensorboard=false", "train.cpu_threads=1", f"train.qat={args.qat}",
        f"train.warmup_steps={min(100, args.steps // 4)}"])
    t0 = time.perf_counter()
    train(cfg, World())
    log.info("trained %s in %.0f s", run, time.perf_counter() - t0)
    return run


def load_val(folder: Path) -> list[tuple[str, np.ndarray, str]]:
    """(key, wave float32 16 kHz, reference) per audio file under `folder` with a reference (<id>.txt or
    LibriSpeech *.trans.txt, as `shardtrain transcribe` finds them)."""
    from shardtrain.infer.transcribe import audio_files, reference_for

    out, cache = [], {}
    for p in audio_files(folder):
        ref = reference_for(p, cache)
        if ref is None:
            continue
        wave, rate = sf.read(p, dtype="float32")
        if rate != 16000 or wave.ndim != 1:
            raise ValueError(f"{p}: {rate} Hz, {wave.ndim}-D; the benchmark feeds 16 kHz mono audio")
        out.append((p.stem, wave, ref))
    if not out:
        raise SystemExit(f"--val {folder}: no audio files with references")
    return out


def batches(utts, batch_seconds: float) -> list[list[int]]:
    order = sorted(range(len(utts)), key=lambda i: len(utts[i][1]))
    out, cur = [], []
    for i in order:
        if cur and len(utts[i][1]) / 16000 * (len(cur) + 1) > batch_seconds:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + ([cur] if cur else [])


def run_once(rec, utts, groups) -> tuple[float, list[str]]:
    hyps: list[str] = [""] * len(utts)
    t0 = time.perf_counter()
    for g in groups:
        waves = torch.nn.utils.rnn.pad_sequence([torch.from_numpy(utts[i][1]) for i in g], batch_first=True)
        lengths = torch.tensor([len(utts[i][1]) for i in g])
        for i, h in zip(g, rec.transcribe(waves, lengths, 16000)):
            hyps[i] = h
    return time.perf_counter() - t0, hyps


def measure(runners: list[tuple[str, object]], utts, args) -> list[dict]:
    """Best of --repeats per runner and mode, the passes interleaved (runner A, B, C, A, B, C, ...) so a burst of
    other load on a shared machine hits every runner alike instead of one."""
    audio_s = sum(len(w) for _, w, _ in utts) / 16000
    modes = {"batch1": [[i] for i in range(len(utts))], "batched": batches(utts, args.batch_seconds)}
    best = {(name, mode): float("inf") for name, _ in runners for mode in modes}
    hyps: dict[str, list[str]] = {}
    for _, rec in runners:
        run_once(rec, utts[:2], [[0], [1]])  # warm-up (allocators, ORT graph optimisation, CUDA context)
    for _ in range(args.repeats):
        for name, rec in runners:
            for mode, groups in modes.items():
                wall, h = run_once(rec, utts, groups)
                best[(name, mode)] = min(best[(name, mode)], wall)
                if mode == "batched":
                    hyps[name] = h
    rows = []
    for name, _ in runners:
        s = Score()
        for (key, _, ref), hyp in zip(utts, hyps[name]):
            s.add(key, ref, hyp)
        summary = s.summary()
        rows.append({"runner": name, "rtf_batch1": best[(name, "batch1")] / audio_s,
                     "rtf_batched": best[(name, "batched")] / audio_s, "cer": summary["cer"],
                     "wer": summary["wer"], "_hyps": hyps[name]})
        log.info("%s: %s", name, {k: v for k, v in rows[-1].items() if not k.startswith("_")})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="run dir or step dir; default: train a tiny model first")
    ap.add_argument("--val", default=None, help="flat folder of <id>.flac + <id>.txt (default: the demo's "
                                                "validation set, synthesised into the work dir)")
    ap.add_argument("--val-utts", type=int, default=150, help="validation utterances to synthesise (default 150)")
    ap.add_argument("--train-utts", type=int, default=1000, help="training utterances when training (default 1000)")
    ap.add_argument("--steps", type=int, default=300, help="training steps when training (default 300)")
    ap.add_argument("--pipeline", default="tiny_cpu", help="preset when training (default tiny_cpu)")
    ap.add_argument("--qat", action="store_true", help="train with train.qat=true")
    ap.add_argument("--devices", default="cpu", help="comma list: cpu, cuda (default cpu)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for torch and ORT (default 1)")
    ap.add_argument("--batch-seconds", type=float, default=60.0, help="padded seconds per batch (default 60)")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per runner and mode; best kept")
    ap.add_argument("--work-dir", default=str(DEFAULT_WORK_DIR / "infer"), help="cache of corpora, runs, models")
    ap.add_argument("--out-dir", default=None, help="also write bench_infer.json and bench_infer.md here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("onnx_ir", "onnxscript", "torch.onnx", "shardtrain.train.trainer", "shardtrain.train.runstate",
                  "shardtrain.load"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)

    run = Path(args.checkpoint) if args.checkpoint else train_model(work, args)
    val = Path(args.val) if args.val else prepare_corpus(work, args.val_utts, kind="speech", seed=1)
    utts = load_val(val)
    tm = load_trained(run, device="cpu")
    onnx_path = work / f"export-{tm.path.parent.parent.name}-{tm.step}.onnx"
    exp = export_onnx(tm, onnx_path, quantize="int8")
    runners: list[tuple[str, object]] = [
        ("pytorch cpu", tm), ("onnxruntime fp32 cpu", OnnxRecognizer(exp.path, threads=args.threads)),
        ("onnxruntime int8 cpu", OnnxRecognizer(exp.quantized_path, threads=args.threads))]
    if "cuda" in args.devices.split(","):
        runners += gpu_runners(run, exp)
    rows = measure(runners, utts, args)
    ref = rows[0]["_hyps"]
    for r in rows:
        r["same_transcripts_as_pytorch"] = sum(a == b for a, b in zip(r.pop("_hyps"), ref)) / len(ref)
    base = rows[0]
    for r in rows:
        r["speedup_batched"] = base["rtf_batched"] / r["rtf_batched"]
        r["speedup_batch1"] = base["rtf_batch1"] / r["rtf_batch1"]
    result = {"bench": "infer", "git_sha": git_sha(), "machine": machine(),
              "config": {**{k: v for k, v in vars(args).items() if k not in ("out_dir",)}, "checkpoint": str(tm.path),
                         "step": tm.step, "encoder": tm.config.model.encoder, "qat": tm.config.train.qat,
                         "val_utterances": len(utts), "val_audio_s": sum(len(w) for _, w, _ in utts) / 16000,
                         "onnx_mb": exp.bytes / 1e6, "int8_mb": (exp.quantized_bytes or 0) / 1e6,
                         "export_s": exp.export_s},
              "rows": rows}
    table = markdown(result)
    print(json.dumps(result, sort_keys=True))
    print(table)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_infer.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        (out / "bench_infer.md").write_text(table + "\n")
    return 0


def gpu_runners(run: Path, exp) -> list[tuple[str, object]]:
    if not torch.cuda.is_available():
        log.warning("--devices cuda: no CUDA device; GPU rows skipped")
        return []
    out: list[tuple[str, object]] = [("pytorch cuda", load_trained(run, device="cuda"))]
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        out.append(("onnxruntime fp32 cuda", OnnxRecognizer(exp.path, providers=["CUDAExecutionProvider"])))
    else:
        log.warning("onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu); ORT GPU rows skipped")
    return out


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"Inference on {c['val_utterances']} validation utterances ({c['val_audio_s']:.0f} s of audio), "
             f"{c['encoder']} model at step {c['step']}{' (QAT)' if c['qat'] else ''}, {c['threads']} thread(s); "
             f"ONNX {c['onnx_mb']:.1f} MB, int8 {c['int8_mb']:.1f} MB. RTF = wall s / audio s (lower is faster).",
             "", "| runner | RTF batch 1 | RTF batched | speed-up batched vs PyTorch | CER % | WER % | "
                 "transcripts equal to PyTorch |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['runner']} | {r['rtf_batch1']:.4f} | {r['rtf_batched']:.4f} | {r['speedup_batched']:.2f}x "
                     f"| {100 * r['cer']:.2f} | {100 * r['wer']:.2f} | {100 * r['same_transcripts_as_pytorch']:.0f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
