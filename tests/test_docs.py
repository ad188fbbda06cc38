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
    bench = ROOT / "benchmarks"
    scripts = [".".join(("benchmarks", *p.relative_to(bench).with_suffix("").parts)) for p in bench.rglob("*.py")
               if p.name not in ("__init__.py", "common.py", "render_readme.py")]
    assert len(scripts) > 10 and all(f"`{s}`" in text for s in scripts)


def test_benchmarks_mirror_the_rooms():
    """benchmarks/<room>/ for the rooms of shardtrain/: a script measures one room (cross-room runs stay on top)."""
    bench, pkg = ROOT / "benchmarks", ROOT / "shardtrain"
    rooms = [d.name for d in bench.iterdir() if d.is_dir() and (d / "__init__.py").exists()]
    assert len(rooms) >= 6 and all((pkg / r / "__init__.py").exists() for r in rooms), rooms
    top = sorted(p.stem for p in bench.glob("*.py") if not p.name.startswith("_"))
    assert top == ["common", "gpu_check", "render_readme"], top
