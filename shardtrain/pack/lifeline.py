"""Worker processes die with the pack that started them (`ProcessPoolExecutor(initializer=die_with_parent)`).

Without it, a pack killed with SIGKILL (OOM killer, a cancelled job) leaves its pool workers running: they finish
the shards already queued to them, writing into an OUTPUT nobody is committing any more, and then block forever.

Two mechanisms, because a forkserver worker's parent is the fork server, not the pack (a forked worker's is the pack):
- Linux: prctl(PR_SET_PDEATHSIG, SIGKILL), so the kernel kills the worker when the fork server exits (it exits
  as soon as the pack's end of its pipe closes, i.e. when the pack dies).
- Everywhere: a daemon thread that checks every `poll_s` whether the pack's pid is still alive and whether this
  process was re-parented, and exits the worker when not. Costs one syscall per half second per worker.
"""
from __future__ import annotations

import os
import signal
import threading
import time


def die_with_parent(pack_pid: int, poll_s: float = 0.5) -> None:
    """Pool initializer: tie this worker's life to process `pack_pid` (see module docstring)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the watch thread alone
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            try:
                os.kill(pack_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass
            if os.getppid() != parent:  # re-parented: whoever started us is gone
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
