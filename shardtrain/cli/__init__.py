"""cli: the `shardtrain` command line, the only code that prints. Imports every room; nothing imports it.

    app.py     build_parser() and main(): subcommands, --version, -v before or after the subcommand, and the one
               error handler (an error the user can act on: one line, the exit status of common.exit_code)
    common.py  logging set-up, --storage-option parsing (and the credentials advice), one-line errors and the exit
               status table (0 ok, 1 runtime failure, 2 usage or invalid input, 130 interrupted), malloc bound
    pack.py    synth, pack, inspect
    bench.py   bench (the loader timed per stage)
    train.py   train (one process or torchrun), augment-demo
    infer.py   transcribe, evaluate, export
    __main__.py `python -m shardtrain`
    ledger.py  ledger
    plan.py    plan
    tune.py    tune

Each subcommand has an `_add_<name>(sub)` that declares its flags (all with help=) and a `_cmd_<name>(args) -> int`
that builds the config, calls the library and prints the result (data-derived text through
format.safe.printable); errors the user can fix are one line and a non-zero exit, not a traceback.
"""
from shardtrain.cli.app import build_parser, main
from shardtrain.cli.common import _bound_malloc_heap, _parse_storage_options, init_logging

__all__ = ["build_parser", "init_logging", "main", "_bound_malloc_heap", "_parse_storage_options"]
