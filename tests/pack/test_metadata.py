"""Folders of audio described by a metadata table (LJSpeech, Hugging Face audiofolder, DeepSpeech CSV, any table
with --audio-column/--text-column/--delimiter), and a pack that accepts nothing: each through the CLI as typed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import soundfile as sf

from shardtrain.format.manifest import open_dataset

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "shardtrain", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def _pack(src: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    return _cli("pack", str(src), str(out), "--workers", "1", "--no-progress", *flags)


def _wavs(folder: Path, names: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(names):
        sf.write(folder / f"{n}.wav", np.random.default_rng(i).integers(-8000, 8000, 8000, dtype=np.int16), 16000)


def _texts(out: Path) -> dict[str, str]:
    rows = open_dataset(str(out)).read_index().to_pylist()
    return {r["id"] if "id" in r else r["key"]: r["text"] for r in rows}


def _packs_to(src: Path, want: list[str], *flags: str) -> None:
    """`shardtrain pack SRC OUT FLAGS` exits 0 and stores exactly the transcripts `want`."""
    out = src.parent / "ds"
    p = _pack(src, out, *flags)
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(_texts(out).values()) == sorted(want)


def test_ljspeech_folder(tmp_path):
    _wavs(tmp_path / "LJ" / "wavs", ["LJ001-0001", "LJ001-0002"])
    (tmp_path / "LJ" / "metadata.csv").write_text('LJ001-0001|Printing, in "1" sense|Printing, in "one" sense\n'
                                                  "LJ001-0002|Dr. Who|\n")
    _packs_to(tmp_path / "LJ", ['Dr. Who', 'Printing, in "one" sense'])


def test_audiofolder_metadata_csv(tmp_path):
    _wavs(tmp_path / "af" / "data", ["a", "b"])
    (tmp_path / "af" / "metadata.csv").write_text('file_name,transcription\ndata/a.wav,"hello, there"\n'
                                                  "data/b.wav,general kenobi\n")
    _packs_to(tmp_path / "af", ["general kenobi", "hello, there"])


def test_deepspeech_csv(tmp_path):
    _wavs(tmp_path / "clips", ["x", "y"])
    (tmp_path / "train.csv").write_text(f"wav_filename,wav_filesize,transcript\n{tmp_path / 'clips' / 'x.wav'},1,one\n"
                                        "clips/y.wav,1,two\n")
    _packs_to(tmp_path / "train.csv", ["one", "two"])


def test_other_columns_and_delimiter_are_named_on_the_command_line(tmp_path):
    _wavs(tmp_path / "w", ["p", "q"])
    (tmp_path / "list.psv").write_text("clip|words|who\nw/p.wav|first one|s1\nw/q.wav|second one|s2\n")
    _packs_to(tmp_path / "list.psv", ["first one", "second one"], "--source-format", "csv", "--delimiter", "|",
              "--audio-column", "clip", "--text-column", "Words")
    p = _pack(tmp_path / "list.psv", tmp_path / "ds2", "--source-format", "csv", "--delimiter", "|",
              "--audio-column", "wav")
    assert p.returncode == 2 and "no column 'wav' (--audio-column)" in p.stderr and "'clip'" in p.stderr, p.stderr
    assert not (tmp_path / "ds2" / "manifest.json").exists()


def test_pack_that_accepts_nothing_writes_no_dataset_and_says_why(tmp_path):
    _wavs(tmp_path / "corpus", [f"u{i}" for i in range(5)])
    (tmp_path / "corpus" / "labels.csv").write_text("audio_file,sentence_text\n" + "".join(
        f"u{i}.wav,word {i}\n" for i in range(5)))
    p = _pack(tmp_path / "corpus", tmp_path / "ds")
    lines = [x for x in p.stderr.split("\n") if x.strip() and " INFO " not in x and " WARNING " not in x]
    assert p.returncode == 1 and len(lines) == 1, p.stderr[-2000:]
    assert "no utterance accepted" in lines[0] and "missing_transcript x5" in lines[0]
    assert "labels.csv" in lines[0] and "--audio-column" in lines[0] and "no dataset written" in lines[0]
    assert not (tmp_path / "ds" / "manifest.json").exists()
    p = _pack(tmp_path / "corpus" / "labels.csv", tmp_path / "ds", "--audio-column", "audio_file",
              "--text-column", "sentence_text")  # following the hint works, into the same OUTPUT
    assert p.returncode == 0 and len(_texts(tmp_path / "ds")) == 5, p.stderr[-2000:]
