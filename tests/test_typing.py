"""The package type-checks: mypy over shardtrain/ (config in pyproject.toml) reports no error."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_mypy_reports_no_errors():
    res = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert (ROOT / "shardtrain" / "py.typed").is_file()  # shipped, so users' type checkers read our annotations
