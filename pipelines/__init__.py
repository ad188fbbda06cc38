"""Training presets: one module per preset, each with `def config() -> RunConfig`.

`load_pipeline("tiny_cpu")` imports `pipelines.tiny_cpu` and calls its `config()`; a variant preset calls its
base's `config()` and edits it with `dataclasses.replace`. No registry: the module name is the preset name.
"""
from __future__ import annotations

import importlib
import pkgutil
import re


def available() -> list[str]:
    """Preset names (the modules of this package)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load_pipeline(name: str):
    """The RunConfig of preset `name` (a module `pipelines/<name>.py`)."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name not in available():
        raise ValueError(f"--pipeline {name!r}: unknown preset; available: {', '.join(available())}")
    return importlib.import_module(f"{__name__}.{name}").config()
