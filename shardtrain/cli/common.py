"""What every subcommand shares: logging set-up (with credential redaction), `--storage-option` parsing that keeps
values strings unless typed and steers credentials to the environment, one-line error text, and the malloc bound
`train` sets before it allocates batches.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Mapping



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
    from shardtrain.storage.redact import StorageOptions

    return StorageOptions(out)  # its repr masks the secrets in every config, lock or dataset that holds it


def _one_line(e: BaseException) -> str:
    """An error as one line: a DataLoader worker's re-raised error carries the worker's traceback in its
    message; its last line is the error itself."""
    lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()] or [type(e).__name__]
    last = lines[-1]
    if len(lines) > 1 and ": " in last and "." in last.split(": ", 1)[0]:  # "pkg.mod.StreamError: message"
        last = last.split(": ", 1)[1]
    return last


EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_CODES_HELP = ("exit status: 0 success; 1 runtime failure (storage unreachable or timed out, problems found by "
                   "inspect --verify, inputs skipped or nothing accepted); 2 usage or invalid input (bad flags, a path "
                   "that is not a dataset or a checkpoint, an invalid dataset, missing or refused credentials); "
                   "130 interrupted (Ctrl-C)")


def exit_code(e: BaseException) -> int | None:
    """The exit status of an error a command reports in one line, or None for an error that keeps its traceback
    (a bug). One table for every command: what the user must fix (input, flags, credentials) is 2, what went
    wrong while running (storage, timeouts) is 1."""
    names = {c.__name__ for c in type(e).__mro__}  # by name: an error path imports no room (pyarrow, torch)
    if "CredentialsError" in names:  # storage's: missing or refused keys are configuration, never transient
        return EXIT_USAGE
    if isinstance(e, (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)) \
            or names & {"DatasetError", "PackError", "CheckpointError"}:
        return EXIT_USAGE
    if isinstance(e, OSError) or names & {"StreamError", "LockHeld"}:  # another pack holds OUTPUT: wait, re-run
        return EXIT_FAILURE
    return None


def missing_local_path(url: str) -> bool:
    """True for a local path (no scheme, or file://) where nothing exists: the commands refuse it before importing
    the libraries that would find the same (pyarrow, numpy, fsspec: ~0.3 s of CPU), so a typo answers at once."""
    import os

    if "://" in url and not url.startswith("file://"):
        return False
    return not os.path.lexists(os.path.expanduser(url.removeprefix("file://")))  # `~` as fsspec reads it


def report_error(command: str, e: BaseException, where: str = "") -> int:
    """Print `command: error: <one line>` on stderr (terminal-safe) and return the exit status for `e`."""
    from shardtrain.format.safe import printable

    print(f"{command}: error{where}: {printable(_one_line(e))}", file=sys.stderr)
    return exit_code(e) or EXIT_FAILURE


def _run_errors() -> tuple[type[BaseException], ...]:
    """Errors a run reports in one line with their fix (not a traceback): unreadable or refused storage, a
    broken dataset, too much bad data. Programming errors keep their tracebacks."""
    from shardtrain.format.manifest import DatasetError
    from shardtrain.load.errors import StreamError
    from shardtrain.train.guards import TrainingHalted

    return (StreamError, DatasetError, OSError, TrainingHalted)


def one_blas_thread() -> None:
    """OPENBLAS_NUM_THREADS=1 unless the user set it, for a command that does no linear algebra (pack): set before
    numpy is first imported, and inherited by its worker processes. Why: numpy's OpenBLAS starts a thread per core
    at import that spins ~80 ms waiting for work (a process that only imported numpy: 0.14 CPU-s against 0.06 with
    one thread); a pack's driver, forkserver and workers each paid it on a 2-core machine, while the scan and the
    pool's start are what its wall time waits on (perf of a 2,000-file pack)."""
    import os

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _bound_malloc_heap(env: Mapping[str, str] | None = None) -> bool:
    """Fix glibc's mmap threshold at 1 MB for a training process; returns True when set.

    glibc raises the threshold each time a large block is freed (up to 32 MB); from then on the variable-sized
    batch tensors of training (every batch has its own length) come from the heap, which fragments and never
    shrinks: the demo's trainer grew to ~3.9 GB RSS. With a fixed threshold big tensors stay in mmap and go back
    to the OS when freed (40 tiny_cpu steps on 60 s batches: 1.8 GB and growing -> ~1.2 GB flat, same speed;
    benchmarks/train/bench_train_rss.py). Skipped when MALLOC_MMAP_THRESHOLD_ is set (the user chose) or off glibc."""
    import os

    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in (os.environ if env is None else env):
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
