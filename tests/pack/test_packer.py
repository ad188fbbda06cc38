"""pack: round trips for every input format, order, offsets, reproducibility, resume after a kill, bad input."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import webdataset as wds

from shardtrain import cli
from shardtrain.format.manifest import open_dataset
from shardtrain.pack.packer import AudioTarget, PackConfig, pack
from shardtrain.pack.shard_task import PackError
from shardtrain import faults
from shardtrain.pack.keys import assign_keys, sanitize_key
from shardtrain.format.tar import parse_header
from shardtrain.testing.corpus import make_corpus, synth_wave

DURS = [0.25 * (1 + (i * 7) % 13) for i in range(30)]  # 0.25 .. 3.25 s, shuffled order, with ties


def _pack(src, out, **kw) -> object:
    kw.setdefault("max_samples_per_shard", 4)
    kw.setdefault("progress", False)
    return pack(PackConfig(input=str(src), output=str(out), **kw))


def _read_wds(out: Path) -> list[dict]:
    urls = sorted(str(p) for p in out.glob("shard-*.tar"))
    return list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))


def _source_audio(path: str) -> np.ndarray:
    x, _ = sf.read(path, dtype="int16")
    return x


def _decoded(sample: dict) -> np.ndarray:
    ext = next(k for k in ("flac", "wav", "opus", "mp3") if k in sample)
    x, _ = sf.read(io.BytesIO(sample[ext]), dtype="int16")
    return x


def _dataset_bytes(out: Path) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}
    m = json.loads(files.pop("manifest.json"))
    m.pop("created_utc")
    files["manifest.json"] = json.dumps(m, sort_keys=True).encode()
    return files


# ---- corpora in each input format ----------------------------------------------------------------------------
def _librispeech(root: Path) -> Path:
    for spk, chapter in (("19", "198"), ("26", "495")):
        d = root / spk / chapter
        d.mkdir(parents=True)
        lines = []
        for u in range(4):
            utt = f"{spk}-{chapter}-{u:04d}"
            sf.write(d / f"{utt}.flac", synth_wave(0.4 + 0.3 * u, 16000, seed=int(spk) + u), 16000)
            lines.append(f"{utt} WORDS FOR {utt}")
        (d / f"{spk}-{chapter}.trans.txt").write_text("\n".join(lines) + "\n")
    return root


def _lhotse(root: Path) -> Path:
    from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet

    corpus = make_corpus(root / "audio", [2.0, 1.5, 3.0], seed=3)
    recs, sups = [], []
    for i, p in enumerate(sorted(corpus.glob("*.flac"))):
        rec = Recording.from_file(p)
        recs.append(rec)
        if i == 2:  # two segments of one recording: each becomes its own sample, cut out of the file
            sups += [SupervisionSegment(id=f"{rec.id}-a", recording_id=rec.id, start=0.5, duration=1.0, text="first"),
                     SupervisionSegment(id=f"{rec.id}-b", recording_id=rec.id, start=1.75, duration=1.0,
                                        text="second", speaker="s9")]
        else:
            sups.append(SupervisionSegment(id=rec.id, recording_id=rec.id, start=0, duration=rec.duration,
                                           text=f"whole {i}", language="en"))
    cuts = CutSet.from_manifests(recordings=RecordingSet.from_recordings(recs),
                                 supervisions=SupervisionSet.from_segments(sups))
    path = root / "cuts.jsonl.gz"
    cuts.to_file(path)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"), DURS, seed=1)


@pytest.mark.parametrize("fmt", ["dir", "tsv", "jsonl", "librispeech", "lhotse"])
def test_round_trip_each_format(fmt, corpus, tmp_path):
    src = {"dir": corpus, "tsv": corpus / "manifest.tsv", "jsonl": corpus / "manifest.jsonl"}.get(fmt)
    if fmt == "librispeech":
        src = _librispeech(tmp_path / "ls")
    elif fmt == "lhotse":
        src = _lhotse(tmp_path / "lh")
    r = _pack(src, tmp_path / "out", max_samples_per_shard=3)
    assert r.rejects == 0, r.rejects_by_reason
    samples = _read_wds(tmp_path / "out")  # a stock WebDataset reads every shard unchanged
    assert len(samples) == r.samples > 0
    index = open_dataset(str(tmp_path / "out")).read_index().to_pylist()
    assert [s["__key__"] for s in samples] == [row["key"] for row in index]
    for s, row in zip(samples, index):
        meta = json.loads(s["json"])
        assert meta["text"] == row["text"] and meta["source"] == row["source"]
        src_audio = _source_audio(row["source"])
        if "start_s" in meta:  # a Lhotse segment: the stored audio is exactly that slice of the file
            a = round(meta["start_s"] * 16000)
            src_audio = src_audio[a: a + meta["num_samples"]]
        np.testing.assert_array_equal(_decoded(s), src_audio)
        assert meta["num_samples"] == len(src_audio) == row["num_samples"]
    if fmt == "librispeech":
        assert {row["speaker"] for row in index} == {"19", "26"} and json.loads(samples[0]["json"])["chapter"]
    if fmt == "lhotse":
        assert sorted(row["text"] for row in index) == ["first", "second", "whole 0", "whole 1"]


def test_transcodes_rates_channels_and_codecs(tmp_path):
    """22.05 kHz stereo WAV and 16 kHz MP3 in -> 16 kHz mono FLAC out; opus target; keep_original keeps bytes."""
    a = make_corpus(tmp_path / "a", [0.5, 1.0], sample_rate_hz=22050, fmt="wav", channels=2, seed=2)
    r = _pack(a, tmp_path / "flac")
    rows = pq.read_table(tmp_path / "flac" / "index.parquet").to_pylist()
    assert r.samples == 2 and {(x["codec"], x["sample_rate_hz"], x["channels"]) for x in rows} == {("flac", 16000, 1)}
    assert [x["num_samples"] for x in rows] == [8000, 16000]
    _pack(a, tmp_path / "opus", audio=AudioTarget(codec="opus"))
    for s in _read_wds(tmp_path / "opus"):
        assert "opus" in s and sf.info(io.BytesIO(s["opus"])).samplerate == 16000
    _pack(a, tmp_path / "kept", audio=AudioTarget(keep_original=True))
    kept = _read_wds(tmp_path / "kept")
    assert [s["wav"] for s in kept] == [(a / f"utt-0000{i}.wav").read_bytes() for i in range(2)]
    m = make_corpus(tmp_path / "m", [1.0], fmt="mp3", seed=4)
    assert _pack(m, tmp_path / "mp3").samples == 1


def test_global_duration_order_and_offsets(corpus, tmp_path):
    out = tmp_path / "out"
    r = _pack(corpus, out, max_samples_per_shard=4)
    ds = open_dataset(str(out))
    rows = ds.read_index().to_pylist()
    assert r.shards == len(ds.shards) == 8 and len(rows) == 30
    order = [(x["duration_s"], x["key"]) for x in rows]
    assert order == sorted(order)  # global (duration_s, key) order, across shards
    assert [x["shard"] for x in rows] == sorted(x["shard"] for x in rows)
    for i, info in enumerate(ds.shards):
        data = (out / info.name).read_bytes()
        mine = [x for x in rows if x["shard"] == i]
        assert info.samples == len(mine) and info.bytes == len(data)
        assert info.min_duration_s == mine[0]["duration_s"] and info.max_duration_s == mine[-1]["duration_s"]
        assert mine[0]["offset"] == 0
        for a, b in zip(mine, mine[1:]):
            assert a["offset"] + a["size"] == b["offset"]
        members = {s["__key__"]: s for s in wds.WebDataset(str(out / info.name), shardshuffle=False)}
        for x in mine:
            assert data[x["audio_offset"]: x["audio_offset"] + x["audio_size"]] == members[x["key"]]["flac"]
            assert data[x["json_offset"]: x["json_offset"] + x["json_size"]] == members[x["key"]]["json"]
            assert parse_header(data[x["audio_offset"] - 512: x["audio_offset"]]) == (f"{x['key']}.flac",
                                                                                     x["audio_size"])
            assert x["offset"] == x["audio_offset"] - 512
    by_target = _pack(corpus, tmp_path / "bytes", target_shard_mb=0.1, max_samples_per_shard=None)
    sizes = [s.bytes for s in open_dataset(str(tmp_path / "bytes")).shards]
    assert by_target.shards > 1 and max(sizes[:-1]) < 0.3 * (1 << 20)


def test_byte_reproducible_for_any_worker_count(corpus, tmp_path):
    _pack(corpus, tmp_path / "a", workers=1)
    _pack(corpus, tmp_path / "b", workers=2)
    a, b = _dataset_bytes(tmp_path / "a"), _dataset_bytes(tmp_path / "b")
    assert a.keys() == b.keys() and "shard-000007.tar" in a
    for name in a:
        assert a[name] == b[name], name
    for info in tarfile_infos(tmp_path / "a" / "shard-000000.tar"):
        assert (info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode) == (0, 0, 0, "", "", 0o644)


def tarfile_infos(path):
    import tarfile

    with tarfile.open(path) as tf:
        assert tf.pax_headers == {}
        return tf.getmembers()


def test_resume_after_killed_worker(corpus, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "shardtrain", "pack", str(corpus), str(out), "--max-samples-per-shard", "4",
           "--workers", "2", "--no-progress"]
    env = dict(os.environ, **{faults.ENV: "pack.shard=5:kill"})  # the worker that starts shard 5 SIGKILLs itself
    crashed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert crashed.returncode == 2 and "re-run the same command" in crashed.stderr, crashed.stderr
    assert not (out / "manifest.json").exists()  # incomplete: readers refuse it
    with pytest.raises(Exception, match="incomplete dataset"):
        open_dataset(str(out))
    done = sorted(p.name for p in (out / "_work").glob("shard-*.json"))
    assert 0 < len(done) < 8
    before = {n.replace(".json", ".tar"): (out / n.replace(".json", ".tar")).stat() for n in done}
    fp = json.loads((out / "_work" / "layout.json").read_text())["fingerprint"]
    fired = Path(tempfile.gettempdir()) / f"shardtrain-fault-{fp[:16]}-pack.shard-5"  # the fault's once-marker
    assert fired.exists()
    fired.unlink()

    r = _pack(corpus, out, workers=2)
    assert r.shards == 8 and r.shards_written == 8 - len(done)
    for name, st in before.items():  # finished shards were not rewritten
        now = (out / name).stat()
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), name
    assert not (out / "_work").exists()
    _pack(corpus, tmp_path / "clean")
    assert _dataset_bytes(out) == _dataset_bytes(tmp_path / "clean")
    again = _pack(corpus, out, workers=2)  # complete: nothing to do
    assert again.already_complete and again.shards_written == 0


# ---- bad input --------------------------------------------------------------------------------------------------
def _bad_corpus(root: Path) -> Path:
    """A JSONL manifest with one of every kind of bad item next to good ones."""
    good = make_corpus(root / "good", [0.5, 0.6, 0.7, 0.8, 2.0, 0.05], seed=5)
    audio = root / "audio"
    audio.mkdir()
    sf.write(audio / "zero.wav", np.zeros(0, dtype=np.int16), 16000)  # valid header, 0 samples
    (audio / "empty.flac").write_bytes(b"")
    full = (good / "utt-00004.flac").read_bytes()
    (audio / "trunc.flac").write_bytes(full[: len(full) // 2])  # header promises 2.0 s
    (audio / "garbage.flac").write_bytes(b"not audio at all" * 100)
    recs = [
        {"id": "a.b/c", "path": str(good / "utt-00000.flac"), "text": "dots and slashes"},
        {"id": "a_b_c", "path": str(good / "utt-00001.flac"), "text": "plain"},
        {"id": "a/b.c", "path": str(good / "utt-00002.flac"), "text": "collides too"},
        {"id": "x" * 120, "path": str(good / "utt-00003.flac"), "text": "long id"},
        {"id": "a_b_c", "path": str(good / "utt-00003.flac"), "text": "duplicate id"},
        {"id": "missing", "path": str(audio / "nope.flac"), "text": "missing file"},
        {"id": "zero", "path": str(audio / "zero.wav"), "text": "zero samples"},
        {"id": "empty", "path": str(audio / "empty.flac"), "text": "zero bytes"},
        {"id": "trunc", "path": str(audio / "trunc.flac"), "text": "truncated"},
        {"id": "garbage", "path": str(audio / "garbage.flac"), "text": "unreadable"},
        {"id": "notext", "path": str(good / "utt-00001.flac"), "text": "   "},
        {"id": "short", "path": str(good / "utt-00005.flac"), "text": "too short"},
        {"id": "again", "path": str(good / "utt-00002.flac"), "text": "the same audio under another id"},
    ]
    path = root / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_bad_inputs_are_rejected_and_recorded(tmp_path):
    src = _bad_corpus(tmp_path)
    r = _pack(src, tmp_path / "out", min_duration_s=0.1)
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    by_id = {x["id"]: x["reason"] for x in rejects}
    assert by_id["missing"] == "missing_file"
    assert by_id["zero"] == by_id["empty"] == "empty_audio"
    assert by_id["trunc"] in ("truncated_audio", "unreadable_audio")  # audio.py decides which
    assert by_id["garbage"] == "unreadable_audio"
    assert by_id["notext"] == "empty_transcript" and by_id["short"] == "too_short"
    assert by_id["a_b_c"] == "duplicate_id" and len([x for x in rejects if x["id"] == "a_b_c"]) == 1
    again = next(x for x in rejects if x["id"] == "again")  # a merged manifest: one utterance under two ids
    assert again["reason"] == "duplicate_audio" and "'a/b.c'" in again["detail"], again
    assert again["path"] == str(tmp_path / "good" / "utt-00002.flac") or again["path"].endswith("utt-00002.flac")
    assert r.rejects == len(rejects) == 9 and r.samples == 4
    assert sum(r.rejects_by_reason.values()) == 9 and all(x["path"] for x in rejects)
    keys = sorted(pq.read_table(tmp_path / "out" / "index.parquet", columns=["key"]).column("key").to_pylist())
    assert "a_b_c" in keys and len(set(keys)) == 4
    assert all(len(k) <= 80 and "." not in k and "/" not in k for k in keys)
    assert {s["__key__"] for s in _read_wds(tmp_path / "out")} == set(keys)
    # non-UTF-8 transcript in a folder source
    d = make_corpus(tmp_path / "enc", [0.5, 0.5], seed=6)
    (d / "utt-00001.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    r2 = _pack(d, tmp_path / "enc_out")
    assert r2.samples == 1 and list(r2.rejects_by_reason) == ["bad_transcript_encoding"]


def test_keys_sanitised_stably_and_collision_free():
    ids = ["a.b/c", "a_b_c", "a/b.c", "ok-1", "x" * 120, "x" * 119 + "y", "", "é"]
    keys = assign_keys(ids)
    assert keys == assign_keys(list(reversed(ids)))  # independent of input order
    assert len(set(keys.values())) == len(ids)
    assert keys["a_b_c"] == "a_b_c" and keys["ok-1"] == "ok-1"  # already-valid ids keep their key
    assert keys["a.b/c"].startswith("a_b_c-") and keys["a/b.c"].startswith("a_b_c-")
    assert all(len(k) <= 80 and sanitize_key(k) == k for k in keys.values())
    assert assign_keys(["a.b"]) == {"a.b": "a_b"}


def test_strict_raises_at_first_bad_item(tmp_path):
    with pytest.raises(PackError, match="--strict.*a_b_c.*duplicate_id"):
        _pack(_bad_corpus(tmp_path), tmp_path / "out", strict=True)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_refuses_other_dataset_unless_overwrite(corpus, tmp_path):
    out = tmp_path / "out"
    _pack(corpus, out, max_samples_per_shard=4)
    with pytest.raises(PackError, match="different dataset.*--overwrite"):
        _pack(corpus, out, max_samples_per_shard=5)
    assert cli.main(["pack", str(corpus), str(out), "--max-samples-per-shard", "5", "--no-progress"]) == 2
    r = _pack(corpus, out, max_samples_per_shard=5, overwrite=True)
    assert r.shards == 6 and len(list(out.glob("shard-*.tar"))) == 6  # old extra shards are gone


def test_cli_pack_and_inspect(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(["pack", str(corpus / "manifest.tsv"), str(out), "--max-samples-per-shard", "10",
                   "--max-duration", "3.0", "--workers", "1", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0 and "packed    28 samples" in text and "too_long 2" in text and "files/s" in text
    assert cli.main(["inspect", str(out), "--verify", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "verify    3 shards, 28 samples: OK" in text and "duration histogram" in text
    assert cli.main(["inspect", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["totals"]["samples"] == 28 and d["codecs"] == {"flac": 28}
    assert cli.main(["pack", str(corpus), str(tmp_path / "o2"), "--codec", "opus", "--sample-rate", "22050"]) == 2


def test_cli_pack_that_accepts_nothing_exits_nonzero(tmp_path, capsys):
    """Every utterance rejected (here while encoding): no dataset is left at OUTPUT, and the command fails with one
    line naming the reasons, an example and a hint."""
    src = tmp_path / "bad"
    src.mkdir()
    (src / "a.flac").write_bytes(b"not audio at all" * 8)
    (src / "a.txt").write_text("HELLO\n")
    assert cli.main(["pack", str(src), str(tmp_path / "out"), "--no-progress"]) == 1
    err = [x for x in capsys.readouterr().err.split("\n") if x.startswith("pack: error")]
    assert len(err) == 1 and "no utterance accepted" in err[0] and "unreadable_audio x1" in err[0], err
    assert "no dataset written" in err[0]
    assert not any(p.name != "_pack.lock" for p in (tmp_path / "out").iterdir())

# ---- engine-independent laying out (pack/scan.py, pack/layout.py) ----------------------------------------------------
def test_part_boundaries_do_not_change_the_output(corpus, tmp_path):
    """Listing/probe tasks cover `part_items` items each; the layout (and so every byte) must not depend on it."""
    _pack(corpus, tmp_path / "a", part_items=1024)
    _pack(corpus, tmp_path / "b", part_items=3)
    assert _dataset_bytes(tmp_path / "a") == _dataset_bytes(tmp_path / "b")


def test_index_streamed_in_row_groups_equals_index_bytes(monkeypatch, tmp_path):
    from shardtrain.format import manifest as index
    from shardtrain.pack.packer import _IndexRows

    monkeypatch.setattr(index, "ROW_GROUP", 4)  # several row groups, split across shards
    rows = [{"key": f"k{i:03d}", "shard": i // 3, "offset": i, "size": 1, "audio_offset": 1, "audio_size": 1,
             "json_offset": 1, "json_size": 1, "codec": "flac", "duration_s": i / 10, "num_samples": i,
             "sample_rate_hz": 16000, "channels": 1, "text": "t" * i, "speaker": None, "language": "en",
             "source": f"/a/{i}.flac"} for i in range(11)]
    work = tmp_path / "_work"
    work.mkdir()
    acc = _IndexRows(str(tmp_path), None)
    for s in range(4):
        marker = {"shard": s, "rows": [r for r in rows if r["shard"] == s], "info": {}}
        (work / f"shard-{s:06d}.json").write_text(json.dumps(marker))
        assert "rows" not in acc.add(marker)
    assert acc.write(4) == 11
    assert (tmp_path / index.INDEX).read_bytes() == index.index_bytes(index.index_table(rows))


def test_pool_pack_publishes_every_marker_before_commit(corpus, tmp_path, monkeypatch):
    """With 2 workers every shard's marker is written by the driver's publisher (the tasks defer it) and each
    is on disk before the packer sees the shard as done."""
    from shardtrain.pack import engine

    seen: list[tuple[int, bool]] = []
    real = engine.LocalEngine.write

    def spy(self, job, specs, count):
        for m in real(self, job, specs, count):
            seen.append((m["shard"], (Path(job.output) / "_work" / f"shard-{m['shard']:06d}.json").exists()))
            yield m

    monkeypatch.setattr(engine.LocalEngine, "write", spy)
    r = _pack(corpus, tmp_path / "out", workers=2)
    assert sorted(s for s, _ in seen) == list(range(r.shards)) and r.shards > 2
    assert all(on_disk for _, on_disk in seen)


def test_a_pack_without_a_progress_bar_starts_no_tqdm(corpus, tmp_path):
    """No bar shown, no tqdm made: any tqdm starts tqdm's monitor thread, which outlives the pack by ~10 s and
    made the next pack in the same process (a benchmark, a notebook) fall back from a forked pool to a
    forkserver. Run in a fresh interpreter (the suite's own threads would hide it)."""
    import subprocess
    import sys

    code = f"""
import sys, threading
from shardtrain.pack import packer
from shardtrain.pack.packer import PackConfig
cfg = PackConfig(input={str(corpus)!r}, output={str(tmp_path / "out")!r}, workers=2, progress=False)
assert packer.pack(cfg).samples > 0
print(sorted(t.name for t in threading.enumerate()))
print(packer._engine(cfg).fork is sys.platform.startswith("linux"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["['MainThread']", "True"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_shown_progress_bar_counts_scanned_and_written_samples(corpus, tmp_path, monkeypatch):
    """On a terminal the bar counts the scan, then the samples written, with shards and MB in its postfix. (It
    once tested the bar for truth: a tqdm is falsy while its total is 0, so the shown bar never moved.)"""
    from tqdm import tqdm

    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(tqdm, "monitor_interval", 0)  # no monitor thread outliving the test (later packs fork)
    r = _pack(corpus, tmp_path / "out", workers=2, progress=True)
    text = term.getvalue()
    n = len(DURS)
    assert r.samples == n
    assert "pack (write)" in text
    assert f"{2 * n}/{2 * n}" in text  # the scan's items, then the samples written
    assert f"shards {r.shards}/{r.shards}" in text
