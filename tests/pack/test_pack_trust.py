"""pack against crafted inputs (issue 21): FIFOs and endless transcripts, audio whose header lies about its length.

Real files every time: a FIFO from os.mkfifo, a character device behind a symlink, a sparse 8 GiB transcript, FLAC
files whose STREAMINFO sample count is rewritten. Each bad item must be one reject with a reason, never a hang,
an allocation the size of the lie, or a dataset that `inspect --verify` refuses afterwards.
"""
from __future__ import annotations

import json
import os
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
import soundfile as sf

from shardtrain.format.audio import AudioError, AudioInfo
from shardtrain.format.manifest import open_dataset
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.pack.sources import Item
from shardtrain.pack.transcode import AudioTarget, encode_for_shard
from shardtrain.pack.verify import verify
from shardtrain.testing.corpus import make_corpus


def _pack_within(src: Path, out: Path, timeout_s: float = 120.0, **kw):
    """pack() in a daemon thread: a hang fails the test after `timeout_s` instead of blocking the suite."""
    box: dict = {}

    def run() -> None:
        try:
            box["r"] = pack(PackConfig(input=str(src), output=str(out), progress=False, workers=1, **kw))
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            box["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"pack still running after {timeout_s} s (blocked on an input file?)"
    if "e" in box:
        raise box["e"]
    return box["r"]


def _rejects(out: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (out / "rejects.jsonl").read_text().splitlines())}


def _set_flac_total_samples(path: Path, total: int) -> None:
    """Rewrite the 36-bit total-samples field of the STREAMINFO block (bytes 18..25 of a FLAC file)."""
    data = bytearray(path.read_bytes())
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO first, as every encoder writes it
    v = int.from_bytes(data[18:26], "big")
    v = (v & ~((1 << 36) - 1)) | total
    data[18:26] = v.to_bytes(8, "big")
    path.write_bytes(bytes(data))


def test_fifo_device_and_endless_transcripts_are_rejected_not_read(tmp_path):
    src = make_corpus(tmp_path / "c", [0.5, 0.6, 0.7, 0.8], seed=1)
    (src / "utt-00001.txt").unlink()
    os.mkfifo(src / "utt-00001.txt")  # nobody ever writes: open() without O_NONBLOCK waits forever
    (src / "utt-00002.txt").unlink()
    (src / "utt-00002.txt").symlink_to("/dev/zero")  # never ends
    with open(src / "utt-00003.txt", "wb") as f:  # 8 GiB, sparse: reading it whole would exhaust memory
        f.truncate(8 << 30)
    t0 = time.perf_counter()
    r = _pack_within(src, tmp_path / "out")
    assert time.perf_counter() - t0 < 60
    rej = _rejects(tmp_path / "out")
    assert r.samples == 1 and set(rej) == {"utt-00001", "utt-00002", "utt-00003"}
    assert rej["utt-00001"]["reason"] == "not_regular_file" and "FIFO" in rej["utt-00001"]["detail"]
    assert rej["utt-00002"]["reason"] == "not_regular_file" and "character device" in rej["utt-00002"]["detail"]
    assert rej["utt-00003"]["reason"] == "too_large"


def test_fifo_audio_is_rejected(tmp_path):
    src = make_corpus(tmp_path / "c", [0.5, 0.6], seed=2)
    (src / "utt-00000.flac").unlink()
    os.mkfifo(src / "utt-00000.flac")
    r = _pack_within(src, tmp_path / "out")
    rej = _rejects(tmp_path / "out")
    assert r.samples == 1 and rej["utt-00000"]["reason"] == "not_regular_file"


@pytest.mark.parametrize("decode_check", [False, True])
def test_lying_headers_rejected_per_item_and_dataset_verifies(tmp_path, decode_check):
    """A header that claims more samples than the file holds (rewritten count; bytes cut off the end) is one
    reject, with or without the full decode check, so the rest of the dataset passes `inspect --verify`."""
    src = make_corpus(tmp_path / "c", [1.0, 1.1, 1.2, 1.3], seed=3)
    _set_flac_total_samples(src / "utt-00001.flac", 2 * 17600)  # 1.1 s file claiming 2.2 s
    cut = src / "utt-00002.flac"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size * 2 // 3])
    r = _pack_within(src, tmp_path / "out", audio=AudioTarget(verify_decode=decode_check))
    rej = _rejects(tmp_path / "out")
    assert r.samples == 2 and set(rej) == {"utt-00001", "utt-00002"}
    assert {x["reason"] for x in rej.values()} <= {"truncated_audio", "unreadable_audio"}
    assert verify(open_dataset(str(tmp_path / "out")), progress=False) == []


def test_huge_claimed_length_never_allocates(tmp_path):
    """A 16 KB FLAC whose header claims 2^36 - 1 samples (256 GiB as float32) is refused from its header, and
    even past the probe (a forged AudioInfo straight to the transcoder) the tail check refuses it before any
    buffer for the claimed samples exists."""
    src = make_corpus(tmp_path / "c", [0.5, 0.6], seed=4)
    bad = src / "utt-00000.flac"
    assert bad.stat().st_size < 32 << 10
    _set_flac_total_samples(bad, (1 << 36) - 1)
    tracemalloc.start()
    try:
        r = _pack_within(src, tmp_path / "out")
        rej = _rejects(tmp_path / "out")
        assert r.samples == 1 and rej["utt-00000"]["reason"] == "implausible_header"
        info = AudioInfo(duration_s=((1 << 36) - 1) / 16000, sample_rate_hz=16000, num_samples=(1 << 36) - 1,
                         channels=1, codec="flac")
        item = Item(id="x", audio=str(bad), text="x")
        for target in (AudioTarget(sample_rate_hz=8000), AudioTarget(verify_decode=False)):  # transcode, keep
            with pytest.raises(AudioError) as e:
                encode_for_shard(item, info, target)
            assert e.value.reason == "truncated_audio"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB traced while refusing a 256 GiB claim"


def test_tail_check_keeps_honest_files_byte_for_byte(tmp_path):
    """--no-decode-check still stores an honest kept file unchanged (the tail check reads, never rewrites)."""
    src = make_corpus(tmp_path / "c", [0.35, 2.0], seed=5)
    r = _pack_within(src, tmp_path / "out", audio=AudioTarget(verify_decode=False))
    assert r.samples == 2 and r.rejects == 0
    ds = open_dataset(str(tmp_path / "out"))
    rows = ds.read_index(["key", "num_samples"]).to_pylist()
    for row in rows:
        x, _ = sf.read(src / f"{row['key']}.flac", dtype="int16")
        assert len(x) == row["num_samples"]
    assert verify(ds, progress=False) == []
