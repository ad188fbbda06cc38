"""pack/inputfs.py: input URLs, the audio references Items carry, and manifest text opens (gzip included, newlines
kept as they are), on real local files."""
from __future__ import annotations

import gzip

from shardtrain.pack.inputfs import audio_ref, input_fs, open_text, resolve_audio


def test_input_fs_and_references(tmp_path):
    fs, path = input_fs(f"file://{tmp_path}/", None)
    assert path == str(tmp_path)
    assert audio_ref(fs, f"{tmp_path}/a.flac") == f"{tmp_path}/a.flac"  # local: a plain path
    assert resolve_audio(str(tmp_path / "m"), "../wavs/x.wav", fs) == f"{tmp_path}/wavs/x.wav"
    assert resolve_audio(str(tmp_path), "/abs/x.wav", fs) == "/abs/x.wav"
    assert resolve_audio(str(tmp_path), "s3://b/x.wav", fs) == "s3://b/x.wav"


def test_open_text_plain_and_gzip_keeps_line_endings(tmp_path):
    text = "path\ttext\r\na.wav\tone\u2028two\n"
    (tmp_path / "m.tsv").write_bytes(text.encode())
    with gzip.open(tmp_path / "m.tsv.gz", "wb") as f:
        f.write(text.encode())
    fs, _ = input_fs(str(tmp_path), None)
    for name in ("m.tsv", "m.tsv.gz"):
        with open_text(fs, str(tmp_path / name)) as f:
            assert f.read() == text
