"""The fast tier (`scripts/test fast`) is a promise: it touches every room and starts no S3 server or torchrun.

Checked by collecting the tier the way scripts/test selects it, in a child pytest, so a room whose tests were
all marked slow (or a marker expression that selects nothing) fails here instead of thinning the tier silently.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAST = "not slow and not s3"
ROOMS = ["storage", "format", "pack", "load", "train", "infer", "interop", "cli", "testing"]


def _collect(marker: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", marker, "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_fast_tier_touches_every_room_and_no_s3_test():
    fast = _collect(FAST)
    rooms = {line.split("/")[1] for line in fast if line.startswith("tests/") and line.count("/") >= 2}
    assert set(ROOMS) <= rooms, f"rooms with no fast test: {sorted(set(ROOMS) - rooms)}"
    s3_tests = set(_collect("s3"))
    assert s3_tests, "no test carries the s3 marker: the conftest hook that adds it is gone"
    assert not s3_tests & set(fast), sorted(s3_tests & set(fast))[:5]
