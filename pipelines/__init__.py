"""Training presets: one module per preset, each with `def config() -> RunConfig`.

`load_pipeline("tiny_cpu")` imports `pipelines.tiny_cpu` and calls its `config()`; a variant preset calls its
base's `config()` and edits it with `dataclasses.replace`. No registry: the module name is the preset name.

Users add presets without editing this package: `--pipeline my_pkg.presets:big` imports a module and calls the
named function, and `--pipeline path/to/presets.py:big` loads a file the same way (a `.py` path alone calls
its `config()`). Each must return a RunConfig.
"""
from __future__ import annotations

import importlib
import pkgutil
import re


def available() -> list[str]:
    """Preset names (the modules of this package)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load_pipeline(name: str):
    """The RunConfig of preset `name`: `tiny_cpu` (pipelines/tiny_cpu.py), `module:function` or `file.py:function`."""
    from shardtrain.train.config import RunConfig

    target, _, func = name.partition(":") if (":" in name or name.endswith(".py")) else (name, "", "")
    if not func and not target.endswith(".py"):
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name not in available():
            raise ValueError(f"--pipeline {name!r}: unknown preset; available: {', '.join(available())}, "
                             "or module:function, or path/to/file.py:function")
        return importlib.import_module(f"{__name__}.{name}").config()
    module = _load_file(target) if target.endswith(".py") else _import(name, target)
    fn = getattr(module, func or "config", None)
    if not callable(fn):
        raise ValueError(f"--pipeline {name!r}: {target} has no function {func or 'config'!r}")
    cfg = fn()
    if not isinstance(cfg, RunConfig):
        raise ValueError(f"--pipeline {name!r}: {func or 'config'}() returned {type(cfg).__name__}, not a RunConfig")
    return cfg


def _import(name: str, module: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"--pipeline {name!r}: cannot import {module!r} ({e}); is it on PYTHONPATH?") from e


def _load_file(path: str):
    """Import a preset file by path under a private module name (it is not added to sys.path)."""
    import importlib.util
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--pipeline: no file {path!r}")
    spec = importlib.util.spec_from_file_location(f"_shardtrain_preset_{p.stem}", p)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
