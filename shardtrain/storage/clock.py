"""Time without progress: one clock per read, enforced while the read waits (connect, answer, body).

    ProgressClock(url, budget_s)   started when a read starts; `got(n)` as bytes arrive moves its mark forward
    clock.watch(conn) ... unwatch  while a request waits on `conn`, the watchdog cuts the socket at the deadline
    clock.describe()               why it ran out: refused, stall (silence) or trickle, in a few words

Why a watchdog thread and not only socket timeouts: a socket timeout bounds each `recv`, so a server that sends
one byte per second never trips it, and http.client reads a status line and headers with many `recv`s under one
timeout. The watchdog holds the deadlines of the requests in flight and, when one passes, shuts that socket down:
the blocked `recv` returns at once, whatever the library above it was doing. It sleeps on a condition until the
nearest deadline (no polling); a request that starts with a later deadline than the one it sleeps to does not
wake it.

Progress is `PROGRESS_BYTES` (64 KiB) received, or a response read to its end (a small object counts whole), so
the slowest read that is never cut moves 64 KiB per budget (546 B/s at the default 120 s, 13 KB/s at 5 s); a
trickle below that is cut at the budget. Time the consumer spends between pieces (`hold`/`resume`) is not
counted: only waiting on the server is.

Costs on the hot path: `got` is an add and a compare per piece, plus one `time.monotonic()` per 64 KiB;
`hold`/`resume` two `monotonic()` calls per piece; `watch`/`unwatch` a lock per request (8 MB pieces).
"""
from __future__ import annotations

import math
import os
import socket
import threading
import time
from typing import Any

PROGRESS_BYTES = 64 << 10
"""Bytes that count as progress (the clock's mark moves when this many more have arrived)."""
_answered = False


def answered() -> bool:
    """True once any read in this process (or its forking parent) made progress: the storage endpoint works, so
    a later refused connection is a restart to ride out, not a wrong endpoint (storage.retry.Backoff)."""
    return _answered


class ProgressClock:
    """Deadline = mark + budget_s; the mark moves on progress and by the time the consumer held a piece."""

    __slots__ = ("url", "budget_s", "mark", "pending", "phase", "expired", "held", "conn", "last_error", "got_any")

    def __init__(self, url: str, budget_s: float):
        self.url, self.budget_s = url, float(budget_s)
        self.mark = time.monotonic()
        self.pending = 0
        """Bytes received since the mark last moved (under PROGRESS_BYTES)."""
        self.phase = "connect"
        """What the read waits for: connect, answer (status and headers) or body."""
        self.expired = False
        self.held = False
        self.conn: Any = None
        self.last_error: BaseException | None = None
        self.got_any = False

    def deadline(self) -> float:
        return self.mark + self.budget_s

    def remaining(self) -> float:
        return self.mark + self.budget_s - time.monotonic()

    def got(self, n: int) -> None:
        """`n` bytes arrived (hot path)."""
        self.pending += n
        if self.pending >= PROGRESS_BYTES:
            global _answered
            self.pending = 0
            self.got_any = _answered = True
            self.mark = time.monotonic()

    def done(self) -> None:
        """A response was read to its end: progress whatever its size."""
        global _answered
        self.pending = 0
        self.got_any = _answered = True
        self.mark = time.monotonic()

    def hold(self) -> float:
        """The consumer has a piece: its time until `resume` is not the server's."""
        self.held = True
        return time.monotonic()

    def resume(self, since: float) -> None:
        self.mark += time.monotonic() - since
        self.held = False
        _WATCHDOG.kick_if_before(self.mark + self.budget_s)

    def watch(self, conn: Any) -> None:
        """Cut `conn`'s socket if this clock's deadline passes before `unwatch` (one request's wait)."""
        self.conn = conn
        _WATCHDOG.add(self)

    def unwatch(self) -> None:
        _WATCHDOG.discard(self)
        self.conn = None

    def describe(self) -> str:
        """Why the budget ran out, for the one-line error."""
        e = self.last_error
        if isinstance(e, ConnectionRefusedError):
            return "connection refused: nothing is listening at the endpoint"
        if self.pending:
            return (f"trickle: {self.pending} bytes in the last {self.budget_s:g} s, under the "
                    f"{PROGRESS_BYTES >> 10} KiB that count as progress")
        if self.expired or isinstance(e, TimeoutError):
            what = {"connect": "connecting", "answer": "connected, waiting for an answer"}.get(
                self.phase, "the body stopped")
            return f"stall: no byte for {self.budget_s:g} s ({what})"
        if e is not None:
            return f"{type(e).__name__}: {e}"
        return "no progress"


def _cut(conn: Any) -> None:
    """Wake whoever waits on `conn` (shutdown makes a blocked recv return at once, from any thread)."""
    sock = getattr(conn, "sock", None)
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Watchdog:
    """One daemon thread per process sleeping until the nearest deadline of the watched clocks."""

    def __init__(self) -> None:
        self._reinit()

    def _reinit(self) -> None:
        """Fresh state (also in a forked child: the parent's lock may have been held by another thread)."""
        self._cond = threading.Condition()
        self._clocks: set[ProgressClock] = set()
        self._pid = -1
        self.next_wake = math.inf

    def _ensure_thread(self) -> None:  # called with the lock held; a forked child starts its own thread
        if self._pid != os.getpid():
            self._pid, self._clocks, self.next_wake = os.getpid(), set(), math.inf
            threading.Thread(target=self._run, name="storage-watchdog", daemon=True).start()

    def add(self, clock: ProgressClock) -> None:
        with self._cond:
            self._ensure_thread()
            self._clocks.add(clock)
            if clock.deadline() < self.next_wake:
                self._cond.notify()

    def discard(self, clock: ProgressClock) -> None:
        with self._cond:
            self._clocks.discard(clock)

    def kick_if_before(self, deadline: float) -> None:
        if deadline < self.next_wake:  # read without the lock: a stale value only costs a spurious wake
            with self._cond:
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                nearest = math.inf
                for c in list(self._clocks):
                    d = c.deadline()
                    if c.held:  # the consumer has the read: look again a budget from now
                        nearest = min(nearest, now + c.budget_s)
                    elif d <= now:
                        c.expired = True
                        self._clocks.discard(c)
                        _cut(c.conn)
                    else:
                        nearest = min(nearest, d)
                self.next_wake = nearest
                self._cond.wait(None if nearest == math.inf else nearest - now)


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG._reinit)
