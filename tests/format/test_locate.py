"""A wide unpacked corpus (LibriSpeech with 60 speakers, more folders than the survey's listing budget) passed where
a dataset belongs gets the `shardtrain pack` advice, not "nothing `shardtrain pack` reads"."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

from shardtrain.format.locate import MAX_LISTINGS, missing_manifest_message

ROOT = Path(__file__).resolve().parents[2]


def _librispeech(root: Path, speakers: int) -> Path:
    buf = io.BytesIO()
    sf.write(buf, np.zeros(1600, np.int16), 16000, format="FLAC")
    for s in range(speakers):
        chapter = root / str(100 + s) / "7"
        chapter.mkdir(parents=True)
        (chapter / f"{100 + s}-7-0000.flac").write_bytes(buf.getvalue())
        (chapter / f"{100 + s}-7.trans.txt").write_text(f"{100 + s}-7-0000 HI\n")
    return root


def test_inspect_and_train_advise_pack_for_a_wide_librispeech_tree(tmp_path):
    corpus = _librispeech(tmp_path / "train-clean-100", 60)
    assert 60 > MAX_LISTINGS
    assert "unpacked corpus" in missing_manifest_message(str(corpus))
    assert "unpacked corpus" in missing_manifest_message(str(tmp_path))  # one level above: still found
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, "PYTHONPATH": str(ROOT)}
    for args in (["inspect", str(corpus)], ["train", "--data", str(corpus), "--out", str(tmp_path / "run")]):
        p = subprocess.run([sys.executable, "-m", "shardtrain", *args], capture_output=True, text=True, timeout=300,
                           env=env)
        assert p.returncode == 2, (args, p.stderr[-2000:])
        assert f"shardtrain pack {corpus} OUTPUT" in p.stderr and "nothing `shardtrain pack` reads" not in p.stderr
