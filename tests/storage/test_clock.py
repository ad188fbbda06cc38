"""A client clock an hour behind is named as the clock, with the skew and what to change, not blamed on the keys.

The shift is real for the child process (libfaketime moves every clock call it makes, as a machine with a wrong
clock would); the server is the SeaweedFS fixture with the right time."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.s3
def test_a_clock_an_hour_behind_is_named_with_the_skew(s3_bucket, s3):
    if shutil.which("faketime") is None:
        pytest.skip("faketime is not installed (apt-get install faketime): cannot shift a child's clock")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3.env, PYTHONPATH=str(ROOT))
    p = subprocess.run(["faketime", "-f", "-1h", sys.executable, "-m", "shardtrain", "inspect", f"{s3_bucket}/ds"],
                       capture_output=True, text=True, env=env, timeout=150)
    lines = [x for x in p.stderr.splitlines() if x.startswith("inspect: error")]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    line = lines[0]
    assert "clock is off by 60 min" in line and "behind" in line and "NTP" in line, line
    assert "AWS_ACCESS_KEY_ID" not in line, line
