"""Every ```python block of README.md runs as written, so the documentation cannot rot.

Each block runs in a fresh interpreter (no state shared between blocks), with the repository on PYTHONPATH and
the working directory a folder prepared once per module with what the snippets' paths name:

    corpus/train, corpus/dev   tone corpora (utt-00000.flac + utt-00000.txt, manifest.tsv) from shardtrain.testing
    shards/train, shards/dev   those corpora packed by the real packer (small shards, so there are several)
    runs/tiny                  a two-step `shardtrain train --pipeline tiny_cpu` run (checkpoint, vocabulary)
    model.onnx                 `shardtrain export runs/tiny model.onnx`

A snippet that cannot run here (a GPU, a cluster, an S3 bucket) belongs in a ```bash or ```text block; one that is
a ```python block must run in seconds against the folder above.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import shardtrain_cli_many

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
TRAIN_DURATIONS_S = [0.4 + 0.15 * ((i * 7) % 11) for i in range(24)]
DEV_DURATIONS_S = [0.5 + 0.2 * (i % 4) for i in range(6)]


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, code) of every ```python block."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def _env(cwd: Path) -> dict[str, str]:
    """The repository first on the path; Hugging Face kept offline and its cache inside the work folder."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(cwd / ".hf-cache")}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    from shardtrain.pack.packer import PackConfig, pack
    from shardtrain.testing.corpus import make_corpus

    root = tmp_path_factory.mktemp("readme")
    for name, durations, seed in (("train", TRAIN_DURATIONS_S, 1), ("dev", DEV_DURATIONS_S, 2)):
        corpus = make_corpus(root / "corpus" / name, durations, seed=seed)
        pack(PackConfig(input=str(corpus), output=str(root / "shards" / name), max_samples_per_shard=6, workers=1,
                        progress=False))
    train = ["train", "--data", "shards/train", "--val-data", "shards/dev", "--pipeline", "tiny_cpu",
             "--max-steps", "2", "--out", "runs/tiny", "--set", "train.ckpt_every_steps=2",
             "--set", "train.val_every_steps=2", "--set", "train.warmup_steps=1",
             "--set", "stream.bucket.max_batch_seconds=8", "--set", "model.d_model=32", "--set", "model.num_layers=1",
             "--set", "model.num_heads=2"]
    for argv, p in zip((train, ["export", "runs/tiny", "model.onnx"]),
                       shardtrain_cli_many(train, ["export", "runs/tiny", "model.onnx"], cwd=root)):  # torch once
        assert p.returncode == 0, f"shardtrain {' '.join(argv)}: {p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return root


def test_readme_has_python_snippets():
    assert BLOCKS, "README.md has no ```python block: the snippet test would pass on nothing"


@pytest.mark.slow
@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_snippet_runs_as_written(workdir: Path, line: int, code: str):
    p = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=_env(workdir), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, f"README.md line {line} failed:\n{code}\n--- stderr:\n{p.stderr[-4000:]}"
