"""The package layout is a rule, not a habit: one direction of imports between the rooms, and no import cycles.

    base (world, faults, _version)  <-  storage  <-  format  <-  {pack, load}  <-  train  <-  infer  <-  cli
    testing imports only storage (and base); pack and load never import each other.

Checked on the source (AST), so lazy imports inside functions and TYPE_CHECKING imports count too: for the room
rule all of them, for the cycle check every import that runs (module level and lazy: function-level ones,
`importlib.import_module("shardtrain...")` and the lazy names a package `__init__` serves through `__getattr__`,
whose module names it holds as strings). A lazy import only hides a circle until the function runs. TYPE_CHECKING
imports stay out of the cycle graph: they never run, and a type named both ways (a config and the module that reads
it) is not a circle. The first tests run the checker on a copy of the tree with a forbidden import and circles
added, so a checker that sees nothing fails. Further down: one meaning per name, one home per syntax, short
functions and short signatures.
"""
from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "shardtrain"
BASE = {"world", "faults", "_version"}
ALLOWED = {  # room -> rooms it may import (besides itself and BASE)
    "storage": set(),
    "format": {"storage"},
    "pack": {"format", "storage"},
    "load": {"format", "storage"},
    "train": {"load", "format", "storage"},
    "infer": {"train", "load", "format", "storage"},
    "testing": {"storage"},
    "interop": {"train", "load", "format", "storage"},
}
TOP = {"cli", "__main__", "__init__"}  # entry points: may import any room


def _module_name(path: Path, pkg: Path) -> str:
    rel = path.relative_to(pkg.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _runtime_nodes(tree: ast.Module) -> list[ast.AST]:
    """Every node outside `if TYPE_CHECKING:` blocks: module level, function bodies (lazy imports), classes."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if _type_checking(node):
            todo += node.orelse
            continue
        out.append(node)
        todo += list(ast.iter_child_nodes(node))
    return out


def _imports(path: Path, pkg: Path, module_level_only: bool, runtime_only: bool = False) -> set[str]:
    """Dotted shardtrain modules `path` imports (`from shardtrain import x` counts as shardtrain.x): at module
    level only, or everywhere (lazy imports too), with or without those under TYPE_CHECKING (`runtime_only`)."""
    tree = ast.parse(path.read_text())
    nodes = _runtime_nodes(tree) if runtime_only else list(ast.walk(tree))
    if module_level_only:  # module level includes `if`/`try` blocks, but not function bodies or TYPE_CHECKING
        nodes = [n for top in tree.body if not _type_checking(top)
                 for n in ([top] if not isinstance(top, (ast.If, ast.Try)) else ast.walk(top))]
    out = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name.split(".")[0] == pkg.name}
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.split(".")[0] == pkg.name:
            for a in n.names:
                sub = f"{n.module}.{a.name}"
                out.add(sub if (pkg.parent / (sub.replace(".", "/") + ".py")).exists()
                        or (pkg.parent / sub.replace(".", "/")).is_dir() else n.module)
    return out


def _dynamic_imports(path: Path, pkg: Path) -> set[str]:
    """Modules `path` imports by name at run time: `importlib.import_module("shardtrain.x")` anywhere, and in a
    package `__init__` serving lazy names (a module-level `__getattr__`), every module its module-level strings name
    (`_LAZY = {"pack": "packer"}`: shardtrain.pack.packer), which the first use of such a name imports."""
    tree = ast.parse(path.read_text())
    here = _module_name(path, pkg)

    def module(name: str) -> str | None:
        for cand in (name, f"{here}.{name}"):
            where = pkg.parent / cand.replace(".", "/")
            if cand.split(".")[0] == pkg.name and (where.with_suffix(".py").is_file()
                                                   or (where / "__init__.py").is_file()):
                return cand
        return None

    names = [n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
             and ast.unparse(n.func).endswith("import_module") and isinstance(n.args[0], ast.Constant)
             and isinstance(n.args[0].value, str)]
    if path.name == "__init__.py" and any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
                                          for n in tree.body):
        top = [n for n in tree.body if not isinstance(n, (ast.Expr, ast.FunctionDef)) and not _type_checking(n)]
        names += [c.value for n in top for c in ast.walk(n) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return {m for m in map(module, names) if m is not None and m != here}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def violations(pkg: Path) -> list[str]:
    """Every import that breaks the room rule, and every import cycle among the imports that run (module level and
    lazy; not TYPE_CHECKING)."""
    bad = []
    graph: dict[str, set[str]] = {}
    for path in sorted(pkg.rglob("*.py")):
        mod = _module_name(path, pkg)
        room = _room(mod)
        room = room if (pkg / room).is_dir() or room in BASE else room  # top-level module name
        for imp in sorted(_imports(path, pkg, module_level_only=False)):
            target = _room(imp)
            if target == room or target in BASE or room in TOP:
                continue
            if room in BASE:
                bad.append(f"{mod} imports {imp}: base modules import nothing from shardtrain")
            elif target not in ALLOWED.get(room, set()):
                bad.append(f"{mod} imports {imp}: {room} may import only {sorted(ALLOWED.get(room, set()))}")
        graph[mod] = {i for i in _imports(path, pkg, module_level_only=False, runtime_only=True) if i != mod}
        graph[mod] |= _dynamic_imports(path, pkg)
    bad += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One representative cycle per strongly connected component (iterative DFS)."""
    seen, out = set(), []
    for start in graph:
        stack, path, on = [(start, iter(sorted(graph.get(start, ()))))], [start], {start}
        if start in seen:
            continue
        seen.add(start)
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                on.discard(path.pop())
                continue
            if nxt in on:
                out.append(path[path.index(nxt):] + [nxt])
            elif nxt not in seen and nxt in graph:
                seen.add(nxt)
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
                on.add(nxt)
    return out


def test_checker_catches_a_forbidden_import_and_a_cycle(tmp_path):
    pkg = tmp_path / "shardtrain"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(pkg) == []
    with open(pkg / "storage" / "fs.py", "a") as f:  # storage reaching up into the loader
        f.write("\n\ndef _late():\n    from shardtrain.load.plan import plan_epoch  # noqa\n")
    (pkg / "load" / "a_mod.py").write_text("from shardtrain.load import b_mod\n")
    (pkg / "load" / "b_mod.py").write_text("from shardtrain.load import a_mod\n")
    found = violations(pkg)
    assert any("shardtrain.storage.fs imports shardtrain.load.plan" in v for v in found), found
    assert any(v.startswith("import cycle:") and "a_mod" in v and "b_mod" in v for v in found), found


def test_a_lazy_import_circle_is_a_cycle_and_a_type_checking_one_is_not(tmp_path):
    """A circle closed by a function-level import fails the check; one closed only under TYPE_CHECKING does not."""
    pkg = tmp_path / "shardtrain"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "pack" / "c_mod.py").write_text("from shardtrain.pack import d_mod\n")
    (pkg / "pack" / "d_mod.py").write_text("def f():\n    from shardtrain.pack import c_mod  # noqa\n")
    (pkg / "pack" / "e_mod.py").write_text("from shardtrain.pack import f_mod\n")
    (pkg / "pack" / "f_mod.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                           "    from shardtrain.pack import e_mod  # noqa\n")
    found = [v for v in violations(pkg) if v.startswith("import cycle:")]
    assert any("c_mod" in v and "d_mod" in v for v in found), found
    assert not any("e_mod" in v or "f_mod" in v for v in found), found


def test_a_circle_through_a_lazy_name_or_import_module_is_a_cycle(tmp_path):
    """The room's lazy names (pack/__init__ `_LAZY` + `__getattr__`) and importlib.import_module are imports too."""
    pkg = tmp_path / "shardtrain"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    init = pkg / "pack" / "__init__.py"
    assert "_LAZY = {" in init.read_text()
    init.write_text(init.read_text().replace("_LAZY = {", '_LAZY = {"Gee": "g_mod", ', 1))
    (pkg / "pack" / "g_mod.py").write_text("def f():\n    from shardtrain.pack import PackConfig  # noqa\n")
    (pkg / "pack" / "h_mod.py").write_text("import importlib\n\n\ndef f():\n"
                                           "    return importlib.import_module('shardtrain.pack.i_mod')\n")
    (pkg / "pack" / "i_mod.py").write_text("from shardtrain.pack import h_mod  # noqa\n")
    found = [v for v in violations(pkg) if v.startswith("import cycle:")]
    assert any("shardtrain.pack.g_mod -> shardtrain.pack ->" in v or "shardtrain.pack -> shardtrain.pack.g_mod" in v
               for v in found), found
    assert any("h_mod" in v and "i_mod" in v for v in found), found


def test_pack_and_load_do_not_know_each_other(tmp_path):
    pkg = tmp_path / "shardtrain"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "pack" / "peek.py").write_text("from shardtrain.load import loader\n")
    assert any("shardtrain.pack.peek imports shardtrain.load.loader" in v for v in violations(pkg))


def test_the_package_follows_the_rule():
    assert violations(PKG) == []


def _third_party(path: Path) -> set[str]:
    """Top-level names of the packages `path` imports, anywhere in it (lazy imports too)."""
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module}
    return {name.split(".")[0] for name in names}


def test_only_storage_talks_to_fsspec():
    """Storage access lives in one room: the product rooms name a filesystem as `storage.FileSystem` and open URLs
    through `storage.fs_and_path` (with its S3 tuning, retries and redaction), never through fsspec itself.
    testing/ is exempt: its S3 server hands tests a raw s3fs client on purpose (to look behind storage/)."""
    found = [str(p.relative_to(ROOT)) for p in sorted(PKG.rglob("*.py"))
             if _room(_module_name(p, PKG)) not in ("storage", "testing") and {"fsspec", "s3fs"} & _third_party(p)]
    assert found == [], f"import fsspec/s3fs outside shardtrain/storage: {found}"


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_every_room_is_a_package_with_a_map(room):
    init = PKG / room / "__init__.py"
    assert init.is_file() and len(ast.get_docstring(ast.parse(init.read_text())) or "") > 80


@pytest.mark.parametrize("room", sorted(set(ALLOWED) | {"cli"}))
def test_every_module_is_in_its_room_map(room):
    """A room's __init__ docstring lists its modules (`name.py  what it does`): a module missing from the map is
    one a reader of the room never learns about."""
    doc = ast.get_docstring(ast.parse((PKG / room / "__init__.py").read_text())) or ""
    listed = set(re.findall(r"^\s*([\w_]+\.py)\s", doc, flags=re.M))
    modules = {p.name for p in (PKG / room).glob("*.py") if p.name != "__init__.py"}
    assert not modules - listed, f"shardtrain/{room}/__init__.py does not map {sorted(modules - listed)}"


def test_only_the_entry_is_imported_from_the_training_loop():
    """train/loop.py is the process entry: other modules import `train` from it and nothing else (the schedule,
    optimiser and seeds live in train/schedule.py), and interop imports nothing from it at all."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path == PKG / "train" / "loop.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "shardtrain.train.loop":
                names = {a.name for a in node.names}
                if names != {"train"} or path.parent.name == "interop":
                    bad.append(f"{path.relative_to(PKG)} imports {sorted(names)} from shardtrain.train.loop")
            elif isinstance(node, ast.ImportFrom) and node.module == "shardtrain.train" and \
                    any(a.name == "loop" for a in node.names):
                bad.append(f"{path.relative_to(PKG)} imports the loop module itself")
    assert bad == [], bad


# ---- one meaning per name, short functions ---------------------------------------------------------------------
PLAN_HOMES = ("load/", "cli/plan.py")
"""`plan` means one thing: the loader's epoch plan (which rows make which batch on which rank), made in load/ and
shown by `shardtrain plan`. Other rooms use it (a ledger counts planned rows), but define no plan of their own: the
pack's shard layout is a layout, tune's bucket edges are buckets, inference groups files."""


PLAN_USERS = {"train/trainer.py: _replanned"}
"""Names outside load/ that act on the loader's plan (the trainer restarts the loader when the closed loop moves
the budget table); each one is listed, so a new meaning of the word cannot slip in."""


def _defined_names(tree: ast.Module) -> list[str]:
    return [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def test_plan_names_one_thing():
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith(PLAN_HOMES):
            continue
        names = _defined_names(ast.parse(path.read_text()))
        wrong += [f"{rel}: {n}" for n in names if "plan" in n.lower() and f"{rel}: {n}" not in PLAN_USERS]
        if "plan" in path.stem:
            wrong.append(f"{rel}: module name")
    assert not wrong, f"'plan' defined outside the loader's epoch plan: {wrong}"


MAX_FUNCTION_LINES = 60


def test_no_function_is_longer_than_a_page():
    """Every function and method fits on one screen (60 lines), the trainer's loop included: a longer one does
    several jobs; split it (argparse declarations too)."""
    long = []
    for path in sorted(PKG.rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            lines = n.end_lineno - n.lineno + 1 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) else 0
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(PKG)}:{n.lineno} {n.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


MAX_PARAMETERS = 8
"""Parameters a function may take (keyword-only, *args and **kwargs count; self/cls do not). Past that, the values
travel together and want a home: a frozen config near its owner (tune.Search), the object that already holds
them (RunState, StepContext, World), or a value grouping what one call writes (checkpoint.CheckpointParts)."""
LONG_SIGNATURES = {
    "storage/fs.py: iter_range": (12, "the ranged read's knobs (retry budget, piece size, backoff, pins, "
                                      "direct_http) are keyword defaults its callers forward as **kw; a frozen read "
                                      "policy belongs to the storage room's own pass"),
    "load/planner.py: rows_epoch": (9, "an epoch's key (seed, epoch, world size, chain) beside a mixture's row maps, "
                                       "as epoch_plan takes them; a frozen epoch key is the load room's change"),
}
"""Functions allowed past MAX_PARAMETERS, each with the count it may not exceed and why it has not moved yet. An
entry that is no longer needed fails the test, so the list only shrinks."""


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from _functions(node, f"{name}.")
        else:
            yield from _functions(node, prefix)


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len(names) - (names[:1] in (["self"], ["cls"])) + (a.vararg is not None) + (a.kwarg is not None)


def test_parameters_count_keyword_only_and_star_args_not_self():
    tree = ast.parse("class A:\n    def m(self, a, /, b=1, *c, d, e=2, **f): pass\n"
                     "def g(x, *, y): pass\n")
    assert {name: parameters(fn) for name, fn in _functions(tree)} == {"A.m": 6, "g": 2}


def test_no_function_takes_more_than_a_handful_of_parameters():
    """No function in shardtrain/ takes more than MAX_PARAMETERS values, except the listed ones, which may not grow."""
    long, seen = [], set()
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        for name, fn in _functions(ast.parse(path.read_text())):
            n, key = parameters(fn), f"{rel}: {name}"
            allowed = LONG_SIGNATURES.get(key, (MAX_PARAMETERS, ""))[0]
            if key in LONG_SIGNATURES and n > MAX_PARAMETERS:
                seen.add(key)
            if n > allowed:
                long.append(f"{key} ({n} parameters)")
    assert not long, f"functions over {MAX_PARAMETERS} parameters (group them, or list them with a reason): {long}"
    stale = sorted(set(LONG_SIGNATURES) - seen)
    assert not stale, f"no longer past the limit, remove from LONG_SIGNATURES: {stale}"


AUDIO_REF_HOME = "format/audioref.py"
AUDIO_REF_USERS = {
    "pack/scan.py": "tests whether a local item is a reference (`in`) to skip its os.stat: parses no range and bounds "
                    "nothing; format.audioref.parse_byte_range is the one to call there (pack room)",
}
"""Modules outside format/audioref.py whose code names the `#bytes=` syntax, and why none of them parses it."""


def _code_strings(tree: ast.AST):
    """(line, text) of every string constant that is code, not a docstring or other bare string statement."""
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_one_audio_reference_parser():
    """`<file>#bytes=START-END` is written and parsed by format/audioref.py alone (one parser, one bound:
    MAX_RANGE_BYTES), for pack and infer alike: no other module's code spells the syntax."""
    found, users = [], set()
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        hits = [line for line, text in _code_strings(ast.parse(path.read_text())) if "#bytes=" in text]
        if rel == AUDIO_REF_HOME or not hits:
            continue
        if rel in AUDIO_REF_USERS:
            users.add(rel)
        else:
            found += [f"{rel}:{line}" for line in hits]
    assert not found, f"the #bytes= reference outside {AUDIO_REF_HOME} (call format.audioref): {found}"
    assert users == set(AUDIO_REF_USERS), f"no longer needed in AUDIO_REF_USERS: {sorted(set(AUDIO_REF_USERS) - users)}"


def test_every_folder_of_modules_is_a_declared_room():
    """A new folder of modules is a new room: it needs its line in the import rule (ALLOWED) and a map (the tests
    above run over the declared rooms); a folder inside a room would hide its modules from the room's map."""
    folders = {p.parent.relative_to(PKG).as_posix() for p in PKG.rglob("*.py") if p.parent != PKG}
    assert folders == set(ALLOWED) | {"cli"}, sorted(folders ^ (set(ALLOWED) | {"cli"}))
