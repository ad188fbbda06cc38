"""`shardtrain train` (one process, or one rank under torchrun: rank and world size are read from its environment
here, and only here) and `shardtrain augment-demo`.
"""
from __future__ import annotations

from shardtrain.cli.common import _CREDS_HELP, _bound_malloc_heap, _parse_storage_options, _run_errors, init_logging, report_error



# ---- train (owner: train) -----------------------------------------------------------------------
def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model (one process or under torchrun)",
                       description="Train a CTC recogniser on streamed shards. Under torchrun, rank and world size "
                                   "come from its environment; on a torchrun restart the run resumes by itself. "
                                   "Preemption: SIGTERM or SIGUSR1 (--set train.preempt_signals=..., '' = off) or a "
                                   "first Ctrl-C stops every rank at the next step with a checkpoint, then exits 75; "
                                   "resume with --resume (a second Ctrl-C exits at once, 130). One trainer per --out: "
                                   "a second is refused (exit 1) naming the holder of --out/_train.lease.",
                       epilog="exit status: 0 done; 75 preempted (checkpoint committed: requeue and --resume); 1 "
                              "runtime failure (storage, checkpoint write failed, --out held by another trainer); "
                              "2 usage or invalid input (flags, a checkpoint that does not fit the config); 130 "
                              "interrupted by a second Ctrl-C")
    p.add_argument("--data", required=True, action="append",
                   help="training dataset URL (path, file://, s3://); repeat it to train on a weighted mixture")
    p.add_argument("--weight", type=float, action="append", default=[],
                   help="weight of each --data, in order (once per --data; default equal): per epoch a dataset gives "
                        "weight / sum of weights of the audio, every sample once before any repeats")
    p.add_argument("--val-data", action="append", default=[], metavar="[NAME=]URL",
                   help="validation dataset URL; repeat it for several sets, each evaluated and reported on its own "
                        "(val/NAME/cer, val/NAME/wer, val/NAME/loss) besides the pooled val_loss/cer/wer (total "
                        "errors / total reference characters or words over all sets) that picks the best "
                        "checkpoint. NAME defaults to the URL's last path component; clashing names take in parent "
                        "components (x-shards, y-shards), then -2, -3. Write ./a=b for a local path with '='. "
                        "Omit to keep the preset's (none: no validation)")
    p.add_argument("--pipeline", default="tiny_cpu", help="preset: a name in pipelines/ (tiny_cpu, librispeech_base), module:function, or path/file.py:function")
    p.add_argument("--max-steps", type=int, default=None, help="optimiser steps (overrides the preset)")
    p.add_argument("--out", required=True, help="run directory: config.json, metrics.jsonl, checkpoints/")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--batch-budget", metavar="BUDGET_JSON", default=None,
                   help="per-bucket batch budgets measured by `shardtrain tune` (budget.json): each duration bucket is "
                        "planned to its own budget, moved between epochs by the measured peaks (--set budget.*)")
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
    from shardtrain.storage.lock import LockHeld
    from shardtrain.train.loop import train
    from shardtrain.train.preempt import EXIT_PREEMPTED
    from shardtrain.world import World

    world = World.from_env()
    init_logging(world.rank, args.verbose)
    _bound_malloc_heap()
    try:
        cfg = apply_overrides(load_pipeline(args.pipeline), args.overrides)
        paths = {"data_url": args.data[0], "out_dir": args.out, **_val_fields(args.val_data)}
        if len(args.data) > 1 or args.weight:
            paths.update(mix_urls=tuple(args.data[1:]), mix_weights=tuple(args.weight))
        if args.max_steps is not None:
            paths["max_steps"] = args.max_steps
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **paths))
        if args.batch_budget:
            cfg = dataclasses.replace(cfg, budget=dataclasses.replace(cfg.budget, file=args.batch_budget))
    except ValueError as e:
        raise SystemExit(f"train: {e}") from None
    # torchrun sets TORCHELASTIC_RESTART_COUNT; after a failure, continue from the last checkpoint on our own
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    try:
        result = train(cfg, world, resume=args.resume or attempt > 0, attempt=attempt,
                       storage_options=_parse_storage_options(args.storage_option) or None)
    except ValueError as e:  # configuration problems: one line naming the flag, not a traceback per rank
        raise SystemExit(f"train: {e}") from None
    except _run_errors() + (LockHeld,) as e:  # storage, bad dataset or resume state, --out held: one line per rank
        return report_error("train", e, f" (rank {world.rank})" if world.world_size > 1 else "")
    if world.is_main:
        print(json.dumps(result, sort_keys=True))
    return EXIT_PREEMPTED if result.get("preempted") else 0


def _val_fields(values: list[str]) -> dict:
    """Repeated `--val-data [NAME=]URL` -> the TrainConfig fields; none given leaves the preset's (and --set's)."""
    from shardtrain.train.valsets import split_named

    if not values:
        return {}
    names, urls = zip(*(split_named(v) for v in values))
    return {"val_data_url": urls[0], "val_extra_urls": tuple(urls[1:]),
            "val_names": tuple(names) if any(names) else ()}


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
