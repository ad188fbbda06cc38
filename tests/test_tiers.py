"""The fast tier (`scripts/test fast`) is a promise: it touches every room and starts no S3 server or torchrun.

Checked by collecting the suite once in a child pytest with the marker expression scripts/test passes (read from
the script), keeping what it selects and what it deselects with each test's markers (after the conftest hook that
marks S3 users), so a room whose tests were all marked slow (or an expression that selects nothing) fails here
instead of thinning the tier silently.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ["storage", "format", "pack", "load", "train", "infer", "interop", "cli", "testing"]

COLLECT = """
import json, sys
import pytest

class Tier:
    selected, deselected = {}, {}

    @pytest.hookimpl(trylast=True)  # after conftest's s3 marks and the -m selection
    def pytest_collection_modifyitems(self, items):
        Tier.selected = {i.nodeid: sorted({m.name for m in i.iter_markers()}) for i in items}

    def pytest_deselected(self, items):
        Tier.deselected.update({i.nodeid: sorted({m.name for m in i.iter_markers()}) for i in items})

code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", sys.argv[1], "tests"], plugins=[Tier()])
print("TIER " + json.dumps([Tier.selected, Tier.deselected]))
sys.exit(int(code))
"""


def _fast_expression() -> str:
    m = re.search(r'set -- -m "([^"]+)" "\$@"', (ROOT / "scripts" / "test").read_text())
    assert m, "scripts/test no longer selects the fast tier with -m"
    return m.group(1)


def test_fast_tier_touches_every_room_and_no_s3_test():
    expr = _fast_expression()
    out = subprocess.run([sys.executable, "-c", COLLECT, expr], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    fast, rest = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("TIER "))[5:])
    rooms = {n.split("/")[1] for n in fast if n.startswith("tests/") and n.count("/") >= 2}
    assert set(ROOMS) <= rooms, f"rooms with no fast test: {sorted(set(ROOMS) - rooms)}"
    s3_tests = [n for n, marks in {**fast, **rest}.items() if "s3" in marks]
    assert s3_tests, "no test carries the s3 marker: the conftest hook that adds it is gone"
    assert not [n for n in s3_tests if n in fast], [n for n in s3_tests if n in fast][:5]
    assert not [n for n, marks in fast.items() if "slow" in marks]
    assert rest and all({"slow", "s3"} & set(marks) for marks in rest.values())
