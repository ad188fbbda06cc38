"""The one fault-injection seam in the product: crash on purpose where recovery must be proven.

Crash recovery (re-running `pack` after a killed pool, `torchrun --max-restarts` resuming from the last checkpoint)
can only be tested by crashing a real process at a known point. Product code marks those points with
`faults.point(name, value)`; it costs one dict lookup, and does nothing unless the environment of the process
arms it:

    SHARDTRAIN_FAULTS="pack.shard=5:kill"            the process that starts writing shard 5 SIGKILLs itself
    SHARDTRAIN_FAULTS="train.step.rank1=3:raise"     rank 1 raises InjectedFault after step 3 (after its checkpoint)
    SHARDTRAIN_FAULTS="train.step.rank0=5:oom"       rank 0 raises torch.OutOfMemoryError inside the forward of
                                                     step 5's unsplit attempt (the trainer splits and redoes it)

An entry is `point=value[:action]`, comma separated; action `raise` (default), `kill` or `oom`. A point names the
actions it can fire (`actions`): the trainer's after-step point fires raise/kill, its in-step point only oom, so
both share the name `train.step.rank<R>`. With `once_marker`, the
caller names a file that records that the fault fired, so a restarted process (torchrun, a re-run) goes on.
This is the only place where product code reads a test switch; it reads the
environment at each call (a few microseconds; points sit on per-shard and per-step paths only).
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

ENV = "SHARDTRAIN_FAULTS"
ACTIONS = ("raise", "kill", "oom")


class InjectedFault(RuntimeError):
    """Raised by an armed fault point with action `raise`."""


def _armed() -> dict[tuple[str, str], str]:
    out = {}
    for entry in filter(None, (e.strip() for e in os.environ.get(ENV, "").split(","))):
        where, _, action = entry.partition(":")
        name, _, value = where.partition("=")
        if action not in ("", *ACTIONS) or not value:
            raise ValueError(f"{ENV}: bad entry {entry!r} (want point=value[:raise|kill|oom])")
        out[(name, value)] = action or "raise"
    return out


def point(name: str, value: object, *, once_marker: Path | None = None,
          actions: tuple[str, ...] = ("raise", "kill")) -> None:
    """Fire the fault armed for (`name`, `value`) when its action is one of `actions`: raise InjectedFault,
    SIGKILL this process, or raise torch.OutOfMemoryError (what CUDA raises when an allocation fails)."""
    armed = _armed()
    action = armed.get((name, str(value))) if armed else None
    if action is None or action not in actions:
        return
    if once_marker is not None:
        if once_marker.exists():
            return
        once_marker.write_text(f"{name}={value} fired\n")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "oom":
        import torch  # only here: the seam itself stays importable without torch

        raise torch.OutOfMemoryError(f"CUDA out of memory (injected at {name}={value}, {ENV})")
    raise InjectedFault(f"injected fault at {name}={value} ({ENV})")
