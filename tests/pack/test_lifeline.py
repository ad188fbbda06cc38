"""pack/lifeline.py: a worker tied to its pack dies with it, by either mechanism, with real processes: the kernel's
parent-death signal when its parent is SIGKILLed, and the watch thread when the pack process (not its parent) is
gone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
WORKER = "import sys, time; from shardtrain.pack.lifeline import die_with_parent; " \
         "die_with_parent(int(sys.argv[1]), poll_s=0.05); print('ready', flush=True); time.sleep(60)"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_watch_thread_exits_when_the_pack_process_is_gone():
    pack = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(pack.pid)], stdout=subprocess.PIPE, text=True,
                              env=ENV)
    try:
        assert worker.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        assert worker.poll() is None  # alive while the pack is
        pack.kill()
        pack.wait()
        assert worker.wait(timeout=10) == 1  # os._exit(1) from the watch thread
    finally:
        for p in (pack, worker):
            if p.poll() is None:
                p.kill()


def test_parent_death_signal_kills_the_worker_of_a_killed_parent():
    parent = subprocess.Popen([sys.executable, "-c",
                               "import os, subprocess, sys, time; "
                               f"w = subprocess.Popen([sys.executable, '-c', {WORKER!r}, str(os.getpid())]); "
                               "print(w.pid, flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True,
                              env=ENV)
    try:
        worker_pid = int(parent.stdout.readline())
        time.sleep(1.0)  # the worker has called die_with_parent
        assert psutil.pid_exists(worker_pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _gone(worker_pid, 10), "the worker outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
