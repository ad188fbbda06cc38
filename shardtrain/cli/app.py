"""The `shardtrain` parser and entry point: one subparser per verb, registered from the verb modules.
"""
from __future__ import annotations

import argparse
import sys
from shardtrain.cli.bench import _add_bench
from shardtrain.cli.common import EXIT_CODES_HELP, EXIT_INTERRUPTED, EXIT_USAGE, exit_code, init_logging, report_error
from shardtrain.cli.infer import _add_evaluate, _add_export, _add_transcribe
from shardtrain.cli.ledger import _add_ledger
from shardtrain.cli.plan import _add_plan
from shardtrain.cli.pack import _add_inspect, _add_pack, _add_synth
from shardtrain.cli.train import _add_augment_demo, _add_train
from shardtrain.cli.tune import _add_tune



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardtrain",
        description="Pack speech corpora into shards, stream them, train, and benchmark the loader.",
        epilog=EXIT_CODES_HELP,
    )
    from shardtrain._version import __version__

    parser.add_argument("--version", action="version", version=f"shardtrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_synth, _add_pack, _add_inspect, _add_bench, _add_train, _add_augment_demo, _add_transcribe,
                _add_evaluate, _add_export, _add_tune, _add_plan, _add_ledger):
        add(sub)
    for p in sub.choices.values():  # `shardtrain pack -v ...` too; SUPPRESS keeps a -v given before the command
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. The one error handler of the CLI: an error the user can act on is one line on stderr and
    the exit status of `common.exit_code` (the same for every command); a bug keeps its traceback."""
    args = build_parser().parse_args(argv)  # usage errors: argparse prints them and exits 2
    return _run(args)


def run() -> None:
    """The process entry point (the `shardtrain` script, `python -m shardtrain`, torchrun's workers): `main`, then
    the exit. A `train` process leaves without tearing the interpreter down (`_leave`): in teardown, threads of
    torch's gloo process group (still running after destroy_process_group) and Arrow's IO threads can end a
    finished run with std::terminate ("terminate called without an active exception", SIGABRT; seen in one full
    test run's 3-rank job of tests/integration/test_train_elastic.py, not on reruns), and torchrun then reports the
    job as failed after its last checkpoint was written. Other commands exit normally. A usage error is also
    written to $SHARDTRAIN_EXIT_FILE when set (`_note_usage_error`)."""
    try:
        args = build_parser().parse_args()
    except SystemExit as e:  # argparse's usage error
        if e.code == EXIT_USAGE:
            _note_usage_error()
        raise
    rc = _run(args)
    if rc == EXIT_USAGE:
        _note_usage_error()
    if args.command == "train":
        _leave(rc)
    sys.exit(rc)


def _note_usage_error() -> None:
    """Write "2" to $SHARDTRAIN_EXIT_FILE when it is set (scripts/slurm_train.sbatch sets it): torchrun reports
    every failed worker as exit 1, so without this the job script cannot tell a usage error (a typo in a flag, a
    checkpoint that does not fit the config), which no requeue can fix, from a crash, and requeued it up to
    MAX_REQUEUES times."""
    import os

    path = os.environ.get("SHARDTRAIN_EXIT_FILE")
    if path:
        try:
            with open(path, "w") as f:
                f.write(f"{EXIT_USAGE}\n")
        except OSError:
            pass  # the job script then requeues as before


def _leave(rc: int) -> None:
    """Exit now with `rc`, after what a normal exit would still do for us: atexit handlers (logging's flush among
    them) and the standard streams. Interpreter teardown (module and C++ static destruction) is skipped; the
    process's remaining threads are all idle daemons or pool workers of a finished run."""
    import atexit
    import os

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(rc)


def _run(args: argparse.Namespace) -> int:
    from shardtrain.format.safe import printable

    init_logging(0, args.verbose)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit as e:  # `raise SystemExit("train: --n must be >= 1")`: a usage error, exit 2 (Python says 1)
        if isinstance(e.code, str):
            print(printable(e.code), file=sys.stderr)
            return EXIT_USAGE
        raise
    except Exception as e:
        from shardtrain.storage import credentials_error

        e = credentials_error(e) or e  # missing/refused S3 keys from any depth: one line naming what to set
        code = exit_code(e)
        if code is None:
            raise
        report_error(args.command, e)
        return code


if __name__ == "__main__":
    run()
