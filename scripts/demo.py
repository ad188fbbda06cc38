"""The whole mission end to end on a fresh machine, no arguments needed (README's first command runs this).

    espeak-ng speech corpus (train + validation, LibriSpeech layout)
      -> SeaweedFS S3 server on 127.0.0.1 -> shardtrain pack -> s3://demo/{train,val} (+ a local copy)
      -> shardtrain inspect --verify
      -> shardtrain train (tiny CTC model, streamed from S3, bounded steps) -> validation CER falling
      -> shardtrain bench on the same data (S3 and local)
      -> shardtrain transcribe the validation set (reference vs hypothesis) + evaluate, and export to ONNX (+ int8)
      -> stop the server, print where everything is

Every step calls the real `shardtrain` command line in a subprocess, exactly as a user would, with the S3
endpoint and keys passed through the standard AWS_* environment variables. Budget: under 20 minutes on
2 CPU cores (the defaults take about 13 minutes, set-up included).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shardtrain.testing.s3server import LocalS3
from shardtrain.testing.speech import synth_speech_corpus


def sh(args: list[str], env: dict, log: Path | None = None) -> str:
    """Run a shardtrain command, echo it, stream its output to the terminal (and a log), fail loudly."""
    print(f"\n$ {' '.join(args)}", flush=True)
    t0 = time.time()
    out_lines = []
    with subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            out_lines.append(line)
            sys.stdout.write(line)
    if log is not None:
        log.write_text("".join(out_lines))
    if p.returncode != 0:
        raise SystemExit(f"demo: command failed with exit code {p.returncode}: {' '.join(args)}")
    print(f"  ({time.time() - t0:.1f} s)", flush=True)
    return "".join(out_lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "demo_out"), help="work folder (default ./demo_out)")
    ap.add_argument("--train-utts", type=int, default=3000, help="training utterances to synthesise (default 3000)")
    ap.add_argument("--val-utts", type=int, default=150, help="validation utterances (default 150)")
    ap.add_argument("--max-steps", type=int, default=1200, help="training steps (default 1200)")
    ap.add_argument("--val-every", type=int, default=200, help="validate every N steps (default 200)")
    ap.add_argument("--workers", type=int, default=2, help="processes for synthesis and packing (default 2)")
    ap.add_argument("--fresh", action="store_true", help="delete the work folder first (corpus included)")
    args = ap.parse_args(argv)

    t_start = time.time()
    out = Path(args.out).resolve()
    if args.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    exe = [sys.executable, "-m", "shardtrain"]

    # 1. speech corpus (kept between runs: it is the slow part and deterministic)
    print(f"== 1/7 speech corpus with espeak-ng: {args.train_utts} train + {args.val_utts} validation utterances")
    corpora = {}
    for name, n, seed in (("train", args.train_utts, 0), ("val", args.val_utts, 1)):
        folder = out / "corpus" / name
        done = folder / ".complete"
        if not done.exists():
            if folder.exists():
                shutil.rmtree(folder)
            synth_speech_corpus(folder, n, seed=seed, workers=args.workers, progress=True)
            done.write_text(str(n))
        corpora[name] = folder

    # 2. S3 server on loopback
    print("== 2/7 SeaweedFS S3 server on 127.0.0.1")
    server = LocalS3(out / "s3-data", log_path=out / "s3.log").start()
    try:
        env = {**os.environ, **server.env, "PYTHONUNBUFFERED": "1"}
        server.make_bucket("demo")
        print(f"  S3 endpoint {server.endpoint_url} (started in {server.start_time_s:.1f} s)")

        # 3. pack to S3 and to a local folder
        print("== 3/7 pack")
        for name in ("train", "val"):
            sh(exe + ["pack", str(corpora[name]), f"s3://demo/{name}", "--workers", str(args.workers),
                      "--target-shard-mb", "16", "--overwrite", "--no-progress"], env)
        sh(exe + ["pack", str(corpora["train"]), str(out / "shards" / "train"), "--workers", str(args.workers),
                  "--target-shard-mb", "16", "--no-progress"], env)
        sh(exe + ["inspect", "s3://demo/train", "--verify"], env)

        # 4. train from S3
        print("== 4/7 train the tiny CTC model, streaming from S3")
        run_dir = out / "run"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        sh(exe + ["train", "--data", "s3://demo/train", "--val-data", "s3://demo/val", "--pipeline", "tiny_cpu",
                  "--max-steps", str(args.max_steps), "--out", str(run_dir),
                  "--set", f"train.val_every_steps={args.val_every}", "--set", "train.progress=false",
                  "--set", "train.cpu_threads=1"], env)
        vals = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
        vals = [v for v in vals if "cer" in v]

        # 5. benchmark the loader on the same data
        print("== 5/7 loader benchmark on the same data")
        bench = {}
        for where, url in (("s3", "s3://demo/train"), ("local", str(out / "shards" / "train"))):
            res = sh(exe + ["bench", url, "--json"], env)
            bench[where] = json.loads(res.strip().splitlines()[-1])

        # 6. use the model: transcribe the validation set from S3, score it, export it
        print("== 6/7 transcribe the validation set, evaluate, export to ONNX")
        transcripts = run_dir / "val_transcripts.jsonl"
        sh(exe + ["transcribe", str(run_dir), "s3://demo/val", "--out", str(transcripts), "--no-progress"], env)
        sh(exe + ["evaluate", str(run_dir), "--data", "s3://demo/val", "--worst", "3", "--no-progress",
                  "--out", str(run_dir / "val_eval.json")], env)
        sh(exe + ["export", str(run_dir), str(run_dir / "model.onnx"), "--quantize", "int8"], env)
        rows = [json.loads(line) for line in transcripts.read_text().splitlines()]
    finally:
        print("== 7/7 stop the S3 server")
        server.stop()

    # summary
    print("\n================ summary ================")
    print(f"corpus:        {out / 'corpus'}")
    print(f"local shards:  {out / 'shards' / 'train'}")
    print(f"S3 data:       {out / 's3-data'} (server stopped; scripts/s3-server start {out / 's3-data'} to reopen)")
    print(f"training run:  {run_dir}  (metrics.jsonl, checkpoints/, tensorboard/)")
    if vals:
        print("validation:    " + "  ".join(f"step {v['step']}: CER {v['cer']:.3f}" for v in vals))
        first, last = vals[0]["cer"], vals[-1]["cer"]
        verdict = "learning" if last < first else "NOT improving"
        print(f"CER {first:.3f} -> {last:.3f} ({verdict}); WER {vals[-1]['wer']:.3f}")
    print(f"ONNX model:    {run_dir / 'model.onnx'} (+ model.int8.onnx); transcripts: {transcripts}")
    for r in rows[:: max(1, len(rows) // 5)][:5]:  # a few, from short to long
        print(f"  REF: {r['reference']}\n  HYP: {r['text']}   (CER {r['cer']:.2f})")
    for where, b in bench.items():
        print(f"loader {where:5s}:  {b['audio_s_per_s']:.0f} audio-s/s, {b['samples_per_s']:.0f} samples/s, "
              f"padding efficiency {b['padding_efficiency']:.3f}, first batch {b['first_batch_s']:.2f} s, "
              f"peak RSS {b['peak_rss_mb']:.0f} MB")
    print(f"total time:    {(time.time() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
