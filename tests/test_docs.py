"""The READMEs describe the product as it is: benchmarks/README.md is what `python -m benchmarks.render_readme` renders
from the committed results, and every Python snippet of README.md runs as written (tests/test_readme_snippets.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_benchmarks_readme_is_rendered_from_the_results():
    res = subprocess.run([sys.executable, "-m", "benchmarks.render_readme", "--check"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr


def test_every_benchmark_script_is_listed():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = [f"benchmarks.{p.stem}" for p in (ROOT / "benchmarks").glob("*.py")
               if p.name not in ("__init__.py", "common.py", "render_readme.py")]
    assert scripts and all(f"`{s}`" in text for s in scripts)
