"""`shardtrain inspect` shows what a dataset holds beyond its sizes: the transcripts' character set, its speakers
(most samples first) and the pack's reject reasons, in the text output and in --json."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "shardtrain", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_inspect_shows_charset_speakers_and_reject_reasons(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rows = [("a", "abc", "alice"), ("b", "cab", "alice"), ("c", "zé", "bob"), ("gone", "x", "bob"), ("d", "", "eve")]
    for i, (name, _, _) in enumerate(rows[:3]):
        sf.write(src / f"{name}.wav", np.random.default_rng(i).integers(-8000, 8000, 8000, dtype=np.int16), 16000)
    sf.write(src / "d.wav", np.zeros(8000, np.int16), 16000)
    (src / "list.tsv").write_text("path\ttext\tspeaker\n" + "".join(f"{n}.wav\t{t}\t{s}\n" for n, t, s in rows))
    out = tmp_path / "ds"
    p = _cli("pack", str(src / "list.tsv"), str(out), "--workers", "1", "--no-progress")
    assert p.returncode == 0, p.stderr[-2000:]
    p = _cli("inspect", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    lines = {x.split()[0]: x for x in p.stdout.split("\n") if x.strip()}
    assert lines["charset"].endswith("5 characters: abcz\u00e9"), lines["charset"]
    assert lines["speakers"] == "speakers  2, most samples: alice 2, bob 1", lines["speakers"]
    assert "missing_file 1" in lines["rejects"] and "empty_transcript 1" in lines["rejects"], lines["rejects"]
    d = json.loads(_cli("inspect", str(out), "--json").stdout)
    assert d["charset"] == {"a": 2, "b": 2, "c": 2, "z": 1, "\u00e9": 1}
    assert d["top_speakers"] == {"alice": 2, "bob": 1}
    assert d["reject_reasons"] == {"empty_transcript": 1, "missing_file": 1}
