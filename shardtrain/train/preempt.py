"""Preemption: a signal stops every rank at the same step, with a committed checkpoint, then exit 75.

    SIGTERM / SIGUSR1 (train.preempt_signals) or a first Ctrl-C -> handler sets a flag (nothing else: a handler
        runs between two bytecodes, so it must not log, save or touch the process group)
    -> at the next step boundary ONE all-reduce (max) of the flag: every rank sees it even when the signal reached
       one rank or one node
    -> every rank writes the checkpoint of that step (loader state + ledger), the trainer returns "preempted",
       the CLI exits EXIT_PREEMPTED (75)
    a second Ctrl-C raises KeyboardInterrupt at once (exit 130, no checkpoint).

Why 75: sysexits.h's EX_TEMPFAIL ("temporary failure, retry"), distinct from a failure (1), a usage error (2) or a
process killed by the signal itself (143 = 128 + SIGTERM): scripts/slurm_train.sbatch requeues on it. Under
torchrun an exit of 75 is a worker failure, so `--max-restarts` resumes on the spot when only a rank was signalled
(the agent itself was not stopped).

Time from signal to committed checkpoint: the rest of the current step, plus the checkpoint write; reported as
`preempt_s` in metrics.jsonl (rank 0's clock from the signal it saw; a rank that saw no signal reports from the
agreement). torchrun kills its workers 30 s after forwarding a signal to them, so a step plus a checkpoint must fit
in 30 s under torchrun (SLURM: --signal=TERM@120 warns 120 s before the walltime).
Cost: one all-reduce of one float per optimiser step (~0.1 ms with gloo on one host).
"""
from __future__ import annotations

import logging
import signal
import threading
import time

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75


def parse_signals(spec: str) -> tuple[signal.Signals, ...]:
    """"SIGTERM,SIGUSR1" (or "TERM,USR1") -> signals; "" -> none. A name that is no signal is a ValueError."""
    out = []
    for name in (s.strip().upper() for s in spec.split(",") if s.strip()):
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full in ("SIGKILL", "SIGSTOP") or not hasattr(signal.Signals, full):
            raise ValueError(f"train.preempt_signals: {name!r} is not a signal a process can catch "
                             "(use e.g. SIGTERM,SIGUSR1, or '' to turn preemption handling off)")
        out.append(signal.Signals[full])
    return tuple(out)


class Preemption:
    """The flag the handlers set and the step boundary's agreement on it. Install only in the main thread."""

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.signals = signals
        self.signum: int | None = None
        self.t_signal: float | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "Preemption":
        """Handle the configured signals and SIGINT; nothing when off or outside the main thread (a library
        caller's thread cannot own signals: it keeps the defaults)."""
        if not self.signals or threading.current_thread() is not threading.main_thread():
            return self
        for sig in (*self.signals, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        if self.signum is None:
            self.signum, self.t_signal = signum, time.time()

    def agreed(self, comm) -> bool:
        """Collective: True on every rank when any rank was signalled (one all-reduce)."""
        hit = comm.max([0.0 if self.signum is None else float(self.signum)])[0] > 0
        if hit and self.t_signal is None:
            self.t_signal = time.time()
        return hit

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal on another rank"
