"""Write benchmarks/README.md from benchmarks/results/*.json: one table per result file, with its machine and date.

    every bench_*.py / compare.py / gpu_check.py -> the script table (module, first docstring line)
    every results/<name>.json (top level)   -> a section: the script that wrote it, machine, date, git sha,
                                               the command, and its rows as a table (median (min-max) for repeats)

Why generated: a README written by hand kept old tables beside new ones ("this change | before"); now the
README is whatever the latest results say, and tests/test_docs.py fails when it was not regenerated.
Run: .venv/bin/python -m benchmarks.render_readme [--check]
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
MAX_COLUMNS = 12
ID_COLUMNS = ("", "tool", "decoder", "storage", "workers", "parallelism", "name", "case")
"""Columns that say which case a row is: shown first, so the column limit never drops them."""
MAX_ROWS = 40


def scripts() -> list[tuple[str, str]]:
    """(module to run with `python -m`, first docstring line) of every benchmark script."""
    out = []
    for p in sorted(BENCH.rglob("*.py"), key=lambda p: (len(p.relative_to(BENCH).parts) > 1, str(p))):
        if p.name in ("common.py", "render_readme.py") or p.name.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse(p.read_text())) or ""
        out.append((_module(p), doc.strip().splitlines()[0] if doc.strip() else ""))
    return out


def _module(path: Path) -> str:
    """`benchmarks.<room>.<script>` of a script file (rooms mirror shardtrain's subpackages)."""
    return ".".join(("benchmarks", *path.relative_to(BENCH).with_suffix("").parts))


def _modules_by_stem() -> dict[str, str]:
    """A recorded command's bare script name (results written before the scripts moved into rooms) -> module."""
    return {p.stem: _module(p) for p in BENCH.rglob("*.py") if not p.name.startswith("_")}


def _cell(v) -> str:
    if isinstance(v, dict) and "median" in v:
        lo, hi = v.get("min"), v.get("max")
        med = _cell(v["median"])
        return med if lo is None or hi is None or lo == hi else f"{med} ({_cell(lo)}-{_cell(hi)})"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    if isinstance(v, (dict, list)):
        text = json.dumps(v, separators=(",", ":"))
        return text if len(text) <= 40 else text[:37] + "..."
    return "" if v is None else str(v).replace("|", "\\|")


def _rows(doc: dict) -> tuple[str, list[dict]]:
    """The result's table: the first list of dicts (or dict of dicts) among its values, preferring `rows`."""
    keys = ["rows", "results"] + [k for k in doc if k not in ("rows", "results")]
    for k in keys:
        v = doc.get(k)
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            return k, v
        if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()) and k not in ("machine",
                                                                                                     "config"):
            return k, [{"": name, **x} for name, x in v.items()]
    return "", []


def _table(rows: list[dict]) -> str:
    cols: list[str] = []
    for r in rows:
        for c, v in r.items():
            if c not in cols and not (isinstance(v, list) and len(v) > 3):
                cols.append(c)
    first = [c for c in ID_COLUMNS if c in cols]  # what a row is before what it measured (the JSON sorts keys)
    cols = (first + [c for c in cols if c not in first])[:MAX_COLUMNS]
    lines = ["| " + " | ".join(c or "case" for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows[:MAX_ROWS]:
        lines.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
    if len(rows) > MAX_ROWS:
        lines.append(f"\n({len(rows) - MAX_ROWS} more rows in the JSON)")
    return "\n".join(lines)


def _date(doc: dict) -> str:
    """The day the result was measured (common.write_json records it)."""
    return str(doc.get("date") or "not recorded")


def _machine(doc: dict) -> str:
    m = doc.get("machine") or {}
    if not isinstance(m, dict) or not m:
        return "not recorded"
    parts = [f"{m['cpus']} CPUs" if "cpus" in m else "", f"{m['mem_gb']} GB" if "mem_gb" in m else "",
             f"Python {m['python']}" if "python" in m else "", f"load {m['load_avg_1m']}" if "load_avg_1m" in m else ""]
    return ", ".join(p for p in parts if p)


def _rerun(command: str) -> str:
    """A recorded command as it runs now: a script path (`benchmarks/x.py`, `benchmarks/load/x.py`) or an old
    module name (`benchmarks.x`, from before the scripts moved into rooms) becomes `python -m benchmarks.<room>.x`."""
    stems = _modules_by_stem()
    module = lambda m: stems.get(m.group(1).rsplit("/", 1)[-1], "benchmarks." + m.group(1))  # noqa: E731
    command = re.sub(r"(?:PYTHONPATH=\S+ )?(?:\S*python3?\s+)?benchmarks/([\w/]+)\.py",
                     lambda m: "python -m " + module(m), command)
    command = re.sub(r"\bbenchmarks\.(\w+)\b(?!\.)", module, command)
    return re.sub(r"^(\w+)\.py\b", lambda m: "python -m " + module(m), command)


def render() -> str:
    out = ["# Benchmarks", "",
           "Generated by `python -m benchmarks.render_readme` from `benchmarks/results/*.json`; do not edit by hand (re-run "
           "a benchmark, then the renderer). Every figure is measured on the machine named beside its table; ratios "
           "against a peer or a limit are taken in the same run. Set-up: `scripts/setup`, then "
           "`.venv/bin/python -m benchmarks.<script> --help` from the repository root.", "", "## Scripts", "",
           "| module | what it measures |",
           "|---|---|"]
    out += [f"| `{name}` | {doc} |" for name, doc in scripts()]
    for path in sorted(RESULTS.glob("*.json")):
        doc = json.loads(path.read_text())
        name = doc.get("benchmark") or doc.get("bench") or path.stem
        key, rows = _rows(doc)
        out += ["", f"## {path.stem}", "",
                f"`results/{path.name}` from `{name}`; machine: {_machine(doc)}; date: {_date(doc)}; "
                f"commit: `{doc.get('git_sha') or doc.get('git') or '?'}`."]
        if doc.get("command"):
            out += ["", f"Rerun: `{_rerun(doc['command'])}`"]
        out += ["", _table(rows) if rows else "(no table in this result)"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when benchmarks/README.md is not what it renders")
    args = ap.parse_args(argv)
    text = render()
    target = BENCH / "README.md"
    if args.check:
        if target.read_text() != text:
            print("benchmarks/README.md is stale: run .venv/bin/python -m benchmarks.render_readme", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {target} ({len(text.split())} words)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
