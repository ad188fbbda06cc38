"""The `shardtrain` parser and entry point: one subparser per verb, registered from the verb modules.
"""
from __future__ import annotations

import argparse
import sys
from shardtrain.cli.bench import _add_bench
from shardtrain.cli.common import init_logging
from shardtrain.cli.infer import _add_evaluate, _add_export, _add_transcribe
from shardtrain.cli.pack import _add_inspect, _add_pack, _add_synth
from shardtrain.cli.train import _add_augment_demo, _add_train
from shardtrain.cli.tune import _add_tune



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
                _add_evaluate, _add_export, _add_tune):
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
