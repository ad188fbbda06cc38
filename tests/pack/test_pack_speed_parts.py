"""The packer's fast paths give the same answers as the slow ones they replace (issue 20): the ustar writer's
headers and archive end are tarfile's byte for byte; FLAC STREAMINFO read directly equals soundfile's. (The FLAC
tail check: test_tailcheck.py.)"""
from __future__ import annotations

import io
import random
import tarfile

import soundfile as sf

from shardtrain.format.tar import ShardWriter
from shardtrain.testing.corpus import make_corpus


def _tarfile_bytes(samples: list[tuple[str, str, bytes, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.TarFile(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT, encoding="utf-8") as t:
        for key, ext, audio, meta in samples:
            for name, data in ((f"{key}.{ext}", audio), (f"{key}.json", meta)):
                ti = tarfile.TarInfo(name)
                ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = len(data), 0, 0o644, 0, 0, "", ""
                t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def test_shard_writer_bytes_equal_tarfile():
    rng = random.Random(0)
    for trial in range(60):
        samples = [("".join(rng.choice("abcXYZ019_-") for _ in range(rng.randint(1, 74))) + f"{i:03d}",
                    rng.choice(["flac", "wav", "opus", "mp3"]), rng.randbytes(rng.choice([0, 1, 511, 512, 513,
                                                                                           rng.randint(0, 9000)])),
                    rng.randbytes(rng.randint(1, 700))) for i in range(rng.randint(0, 25))]
        buf = io.BytesIO()
        w = ShardWriter(buf)
        for s in samples:
            w.add(*s)
        w.close()
        assert buf.getvalue() == _tarfile_bytes(samples), trial


def test_flac_streaminfo_equals_soundfile_info(tmp_path):
    from shardtrain.pack.probe import _flac_streaminfo

    mono = make_corpus(tmp_path / "m", [0.3, 1.7], seed=1)
    stereo = make_corpus(tmp_path / "s", [0.9], sample_rate_hz=44100, channels=2, seed=2)
    for p in sorted(mono.glob("*.flac")) + sorted(stereo.glob("*.flac")):
        i, fast = sf.info(str(p)), _flac_streaminfo(str(p))
        assert fast is not None and (fast.frames, fast.samplerate, fast.channels) == (i.frames, i.samplerate,
                                                                                        i.channels)
    wav = make_corpus(tmp_path / "w", [0.5], fmt="wav", seed=3)
    assert _flac_streaminfo(str(next(wav.glob("*.wav")))) is None  # not FLAC: soundfile.info decides
