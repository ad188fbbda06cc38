"""`shardtrain` command line: thin argparse layer over the library.

Each subcommand has an `_add_<name>(sub)` that declares its flags and a `_cmd_<name>(args) -> int` that builds
the config, calls the library and prints the result. Only this module prints; the library logs.
"""
from __future__ import annotations

import argparse
import logging
import sys


def init_logging(rank: int = 0, verbose: bool = False) -> None:
    """One logging setup for every entry point; non-zero ranks log warnings only."""
    level = logging.DEBUG if verbose else (logging.INFO if rank == 0 else logging.WARNING)
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def _parse_storage_options(pairs: list[str] | None) -> dict:
    """`--storage-option key=value` pairs to an fsspec storage_options dict (values parsed as JSON when they can be)."""
    import json

    out: dict = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise SystemExit(f"--storage-option expects key=value, got {pair!r}")
        k, v = pair.split("=", 1)
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


# ---- pack (owner: pack) -------------------------------------------------------------------------
def _add_pack(sub) -> None:
    p = sub.add_parser("pack", help="pack a corpus into length-sorted WebDataset shards + index")
    p.set_defaults(func=_cmd_pack)


def _cmd_pack(args) -> int:
    raise SystemExit("pack: not implemented yet")


# ---- inspect (owner: pack) ----------------------------------------------------------------------
def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="summarise (and with --verify, check) a packed dataset")
    p.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args) -> int:
    raise SystemExit("inspect: not implemented yet")


# ---- synth (owner: testing) ---------------------------------------------------------------------
def _add_synth(sub) -> None:
    p = sub.add_parser("synth", help="generate a speech corpus (espeak-ng) with transcripts")
    p.set_defaults(func=_cmd_synth)


def _cmd_synth(args) -> int:
    raise SystemExit("synth: not implemented yet")


# ---- bench (owner: stream) ----------------------------------------------------------------------
def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="measure loader throughput on a dataset")
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args) -> int:
    raise SystemExit("bench: not implemented yet")


# ---- train (owner: train) -----------------------------------------------------------------------
def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model (one process or under torchrun)")
    p.set_defaults(func=_cmd_train)


def _cmd_train(args) -> int:
    raise SystemExit("train: not implemented yet")


# ---- augment-demo (owner: augment) --------------------------------------------------------------
def _add_augment_demo(sub) -> None:
    p = sub.add_parser("augment-demo", help="write augmented examples as WAV files and spectrogram PNGs")
    p.set_defaults(func=_cmd_augment_demo)


def _cmd_augment_demo(args) -> int:
    raise SystemExit("augment-demo: not implemented yet")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardtrain",
        description="Pack speech corpora into shards, stream them, train, and benchmark the loader.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_synth, _add_pack, _add_inspect, _add_bench, _add_train, _add_augment_demo):
        add(sub)
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
