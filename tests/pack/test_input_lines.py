"""Line-oriented manifests (LibriSpeech .trans.txt, Kaldi tables) split at "\\n" only, and csv/tsv tables read the
same way: a U+2028, U+0085, form feed or lone carriage return inside a transcript is transcript text, packed whole,
never a line break."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import soundfile as sf

from shardtrain.format.manifest import open_dataset
from shardtrain.pack.packer import PackConfig, pack

ODD = {"a": "HELLO\u2028WORLD", "b": "ONE\u0085TWO", "c": "FORM\x0cFEED", "d": "LONE\rRETURN"}


def _flac(path: Path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, np.random.default_rng(seed).integers(-8000, 8000, 16000, dtype=np.int16), 16000)


def _texts(out: Path) -> list[str]:
    return sorted(open_dataset(str(out)).read_index().column("text").to_pylist())


def _rejects(out: Path) -> list[dict]:
    rej = out / "rejects.jsonl"
    return [json.loads(x) for x in rej.read_text().split("\n") if x] if rej.exists() else []


# the packer folds whitespace runs (these separators included) to one space: the whole transcript, one line
WANT = sorted(" ".join(v.split()) for v in ODD.values())


def test_librispeech_transcripts_keep_unicode_line_separators(tmp_path):
    chapter = tmp_path / "ls" / "19" / "198"
    for i, k in enumerate(ODD):
        _flac(chapter / f"19-198-000{i}.flac", i)
    lines = [f"19-198-000{i} {ODD[k]}" for i, k in enumerate(ODD)]
    (chapter / "19-198.trans.txt").write_bytes(("\r\n".join(lines) + "\r\n").encode())
    out = tmp_path / "ds"
    res = pack(PackConfig(input=str(tmp_path / "ls"), output=str(out), workers=1, progress=False))
    assert _rejects(out) == [] and res.samples == 4
    assert _texts(out) == WANT


def test_kaldi_text_keeps_unicode_line_separators(tmp_path):
    data = tmp_path / "kaldi"
    data.mkdir()
    for i, k in enumerate(ODD):
        _flac(tmp_path / "audio" / f"{k}.flac", i)
    (data / "wav.scp").write_text("".join(f"{k} {tmp_path / 'audio' / k}.flac\r\n" for k in ODD))
    (data / "text").write_bytes("".join(f"{k} {v}\r\n" for k, v in ODD.items()).encode())
    out = tmp_path / "ds"
    res = pack(PackConfig(input=str(data), output=str(out), workers=1, progress=False))
    assert _rejects(out) == [] and res.samples == 4
    assert _texts(out) == WANT


def test_tables_keep_lone_carriage_returns_and_unicode_separators(tmp_path):
    """TSV, CSV (CRLF ends) and a Common Voice TSV: a transcript holding a lone "\\r" is packed whole (before: the
    csv module ended the row there, "LONE" was packed and "RETURN" became a bad_row)."""
    for i, k in enumerate(ODD):
        _flac(tmp_path / "clips" / f"{k}.flac", i)
    (tmp_path / "m.tsv").write_bytes(("path\ttext\r\n" + "".join(f"clips/{k}.flac\t{v}\r\n" for k, v in ODD.items())
                                      ).encode())
    (tmp_path / "m.csv").write_bytes(("path,text\r\n" + "".join(f'clips/{k}.flac,"{v}"\r\n' for k, v in ODD.items())
                                      ).encode())
    (tmp_path / "validated.tsv").write_bytes(("client_id\tpath\tsentence\n" + "".join(
        f"c\t{k}.flac\t{v}\n" for k, v in ODD.items())).encode())
    for name in ("m.tsv", "m.csv", "validated.tsv"):
        out = tmp_path / f"ds-{name}"
        res = pack(PackConfig(input=str(tmp_path / name), output=str(out), workers=1, progress=False))
        assert _rejects(out) == [] and res.samples == 4, name
        assert _texts(out) == WANT, name
