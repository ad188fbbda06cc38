"""Kaldi wav.scp `sox ... -r RATE ... |` pipes: never run, so the rate the pipe would produce is derived from the
file's header; a pipe that resamples down is rejected with the fix, never packed as full-band audio."""
from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import numpy as np
import soundfile as sf

from shardtrain import storage
from shardtrain.format.manifest import open_dataset
from shardtrain.pack.packer import AudioTarget, PackConfig, pack


def _tone(path: Path, rate_hz: int, seconds: float = 1.0) -> np.ndarray:
    t = np.arange(round(rate_hz * seconds)) / rate_hz
    x = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
    sf.write(path, x, rate_hz, subtype="PCM_16")
    return x


def test_sox_resampling_pipes(tmp_path):
    audio = tmp_path / "audio"
    audio.mkdir()
    tel = _tone(audio / "tel.wav", 8000)
    _tone(audio / "tel2.wav", 8000)  # its own file: the same file twice would be a duplicate_audio reject
    _tone(audio / "wide.wav", 16000)
    down = f"sox {audio / 'wide.wav'} -t wav -r 8000 -"
    # what Kaldi would read: the pipe really produces 8 kHz, so packing wide.wav at 16 kHz would mislabel it
    assert sf.info(io.BytesIO(subprocess.run(down.split(), capture_output=True, check=True).stdout)).samplerate == 8000
    data = tmp_path / "data"
    data.mkdir()
    (data / "wav.scp").write_text(f"tel sox {audio / 'tel.wav'} -t wav -r 8000 - |\n"
                                  f"up sox {audio / 'tel2.wav'} -t wav -r 16000 - |\n"
                                  f"down {down} |\n")
    (data / "text").write_text("tel A TONE\nup A TONE AGAIN\ndown A WIDE TONE\n")
    out = tmp_path / "ds"
    res = pack(PackConfig(input=str(data), output=str(out), workers=1, progress=False,
                          audio=AudioTarget(keep_original=False)))
    assert res.samples == 2
    rej = {json.loads(x)["id"]: json.loads(x)["reason"] for x in (out / "rejects.jsonl").read_text().split("\n") if x}
    assert list(rej) == ["down"] and rej["down"] == "unsupported_pipe"
    ds = open_dataset(str(out))
    rms_in = np.sqrt(np.mean(tel.astype(float) ** 2))
    for r in ds.read_index().to_pylist():
        y, rate = sf.read(io.BytesIO(storage.read_range(ds.shard_url(r["shard"]), r["audio_offset"],
                                                        r["audio_offset"] + r["audio_size"])), dtype="int16")
        assert rate == 16000 and abs(len(y) / rate - 1.0) < 0.01, r["key"]
        assert abs(np.sqrt(np.mean(y.astype(float) ** 2)) / rms_in - 1) < 0.05, r["key"]  # same level, resampled


def test_sox_downsampling_reason_names_rates_and_fix(tmp_path):
    from shardtrain.pack.sources import Reject, iter_items
    _tone(tmp_path / "wide.wav", 16000)
    (tmp_path / "wav.scp").write_text(f"w sox {tmp_path / 'wide.wav'} -t wav -r 8k - |\n")
    (tmp_path / "text").write_text("w HELLO\n")
    got = list(iter_items(str(tmp_path), "kaldi"))
    assert len(got) == 1 and isinstance(got[0], Reject)
    assert "16000 Hz to 8000 Hz" in got[0].reason and "sox in.wav -r 8000 out.wav" in got[0].reason
