"""Tests mirror modules: every module of a room, shardtrain/<room>/<module>.py, has its direct test in
tests/<room>/test_<module>.py, so "where is this tested" has one answer and a module without a test shows here.

The test files live in folders without __init__.py (pytest's default imports), so two test files may not share a
basename: where test_<module>.py is taken by another room (tests/load/test_plan.py and pack/plan.py), the mirror is
tests/<room>/test_<room>_<module>.py. Multi-room scenarios live in tests/integration/ and mirror nothing.

Two short lists say why a module has no mirror yet, each entry with its reason:
  EXEMPT   nothing to test on its own (an entry point, constants), or another change is adding the file right now
           (pending: remove the entry once it has merged)
  ELSEWHERE  tested directly, but in a file named for a scenario rather than the module (checked: that file exists
           and imports the module); each entry is a rename or a split waiting to be done, never a new exemption
A mirror that appears makes its entry stale, which fails too, so the lists only shrink.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ["storage", "format", "pack", "load", "train", "infer", "interop", "cli", "testing"]

EXEMPT = {
    "cli/__main__.py": "`python -m shardtrain.cli`: two lines calling cli.main, run by every CLI test",
    "format/codecs.py": "constants only (codec names, extensions, encode ratios), no behaviour",
    "load/errors.py": "one exception class (StreamError), raised and asserted by the loader's tests",
}

ELSEWHERE = {
}


def _modules() -> list[str]:
    return sorted(f"{p.parent.name}/{p.name}" for room in ROOMS for p in (ROOT / "shardtrain" / room).glob("*.py")
                  if p.name != "__init__.py")


def _mirror(module: str) -> Path | None:
    room, name = module[:-3].split("/")
    for candidate in (f"test_{name}.py", f"test_{room}_{name}.py"):
        if (ROOT / "tests" / room / candidate).is_file():
            return ROOT / "tests" / room / candidate
    return None


def test_every_module_has_its_mirror_or_a_reason():
    missing = [m for m in _modules() if _mirror(m) is None and m not in EXEMPT and m not in ELSEWHERE]
    assert not missing, f"modules without tests/<room>/test_<module>.py: {missing}"


def test_the_lists_are_not_stale():
    modules = set(_modules())
    pending = {m for m, why in EXEMPT.items() if why.startswith("pending:")}
    gone = sorted((set(EXEMPT) - pending | set(ELSEWHERE)) - modules)
    assert not gone, f"listed modules that no longer exist: {gone}"
    mirrored = sorted(m for m in (set(EXEMPT) | set(ELSEWHERE)) & modules if _mirror(m) is not None)
    assert not mirrored, f"these have their mirror now; drop them from EXEMPT/ELSEWHERE: {mirrored}"
    assert all(why.strip() for why in EXEMPT.values())


def test_elsewhere_files_really_test_their_module():
    """Each ELSEWHERE file imports its module, or names it (`<room>/<module>.py`) as what it tests."""
    wrong = []
    for module, test in ELSEWHERE.items():
        path = ROOT / "tests" / test
        room, name = module[:-3].split("/")
        text = path.read_text() if path.is_file() else ""
        if not re.search(rf"shardtrain\.{room}\.{name}\b|from shardtrain\.{room} import[^\n]*\b{name}\b|"
                         rf"\b{room}/{name}\.py\b", text):
            wrong.append(f"{module}: {test}")
    assert not wrong, f"these files do not exist or neither import nor name their module: {wrong}"


def test_test_files_have_unique_basenames():
    """pytest imports test files by basename (no __init__.py): a second test_x.py in another folder breaks
    collection, so the mirror of a clashing name is test_<room>_<module>.py."""
    seen: dict[str, Path] = {}
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        assert p.name not in seen, f"{p} and {seen[p.name]} share a basename"
        seen[p.name] = p
