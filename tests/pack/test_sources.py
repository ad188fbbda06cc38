"""shardtrain.pack.sources: every input format -> Items/Rejects, auto-detection, and Lhotse segments cut for real."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from shardtrain.pack.transcode import AudioTarget, encode_for_shard
from shardtrain.format.audio import decode
from shardtrain.pack.probe import probe
from shardtrain.pack.sources import Item, Reject, detect_format, iter_items


def audio(path: Path, duration_s: float = 0.3, rate_hz: int = 16000, seed: int = 0) -> Path:
    """Noise at 16-bit (so segments can be compared sample-exactly), format from the suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    x = np.random.default_rng(seed).integers(-8000, 8000, round(duration_s * rate_hz), dtype=np.int16)
    fmt, subtype = {".opus": ("OGG", "OPUS"), ".mp3": ("MP3", "MPEG_LAYER_III"), ".wav": ("WAV", "PCM_16")}.get(
        path.suffix, ("FLAC", "PCM_16"))
    sf.write(path, x, rate_hz, format=fmt, subtype=subtype)
    return path


def split(out):
    items = [o for o in out if isinstance(o, Item)]
    rejects = [o for o in out if isinstance(o, Reject)]
    assert len(items) + len(rejects) == len(out)
    return items, rejects


def test_dir_source(tmp_path):
    root = tmp_path / "corpus"
    audio(root / "a" / "x.flac")
    (root / "a" / "x.txt").write_text("hello world\n", encoding="utf-8")
    audio(root / "a" / "b" / "y.wav")
    (root / "a" / "b" / "y.txt").write_text("grüße", encoding="utf-8")
    audio(root / "z.mp3")  # no transcript
    audio(root / "w.opus")
    (root / "w.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    audio(root / "dup.flac")
    audio(root / "dup.wav")
    (root / "dup.txt").write_text("", encoding="utf-8")  # empty transcript is allowed here
    audio(root / "._x.flac")  # macOS resource fork: ignored
    (root / "notes.md").write_text("ignored")
    assert detect_format(str(root)) == "dir"
    items, rejects = split(list(iter_items(str(root))))
    by_id = {i.id: i for i in items}
    assert sorted(by_id) == ["a/b/y", "a/x", "dup.flac", "dup.wav"]
    assert by_id["a/x"].text == "hello world" and by_id["a/x"].audio == str(root / "a" / "x.flac")
    assert by_id["a/b/y"].text == "grüße" and by_id["dup.wav"].text == ""
    assert all(i.start_s == 0 and i.duration_s is None for i in items)
    reasons = {r.id: r.reason for r in rejects}
    assert reasons["z"].startswith("missing_transcript: no z.txt")
    assert reasons["w"].startswith("bad_transcript_encoding:")
    assert list(iter_items(str(root), "dir")) == list(iter_items(str(root)))  # deterministic


def test_tsv_source(tmp_path):
    audio(tmp_path / "clips" / "a.flac")
    audio(tmp_path / "clips" / "b.flac")
    rows = ["path\tsentence\tspeaker\tlocale\tduration\toffset\tgender",
            'clips/a.flac\tshe said "hi"\tspk1\ten\t0.2\t0.05\tf',
            f"{tmp_path}/clips/b.flac\t\tspk2\t\t\t\tm",
            "clips/c.flac\ttoo\tmany\tfields\there\t1\t2\t3"]
    tsv = tmp_path / "train.tsv"
    tsv.write_text("\n".join(rows) + "\n", encoding="utf-8")
    assert detect_format(str(tsv)) == "tsv"
    items, rejects = split(list(iter_items(str(tsv))))
    a, b = items
    assert a == Item(id="clips/a_50", audio=str(tmp_path / "clips" / "a.flac"), text='she said "hi"', start_s=0.05,
                     duration_s=0.2, speaker="spk1", language="en", extra=(("gender", "f"),))
    assert (b.id, b.text, b.start_s, b.duration_s, b.language) == ("clips/b_0", "", 0.0, None, None)
    assert b.audio == str(tmp_path / "clips" / "b.flac")
    assert len(rejects) == 1 and rejects[0].reason.startswith("bad_row: line 4")


def test_csv_source_quoting_and_aliases(tmp_path):
    audio(tmp_path / "a.wav")
    csv = tmp_path / "m.csv"
    csv.write_text('id,audio,transcript,speaker_id,Age\nu1,a.wav,"hello, world",7,33\n', encoding="utf-8")
    assert detect_format(str(csv)) == "csv"
    (item,) = iter_items(str(csv))
    assert item == Item(id="u1", audio=str(tmp_path / "a.wav"), text="hello, world", speaker="7",
                        extra=(("Age", "33"),))


def test_csv_stray_quote_rejects_every_line_it_swallows(tmp_path):
    """A CSV row that opens a quote and never closes it properly: every line the record took is a bad_row reject
    naming its line, the rows around it are packed with their own text (before: b's transcript swallowed c and d,
    which vanished uncounted, and the pack reported 3 samples and no reject)."""
    from shardtrain.pack.packer import PackConfig, pack

    for n in "abcde":
        audio(tmp_path / f"{n}.flac", 1.0, seed=ord(n))
    rows = ['path,text', 'a.flac,"first, quoted"', 'b.flac,"he said hi', 'c.flac,third', 'd.flac,"fourth" row',
            'e.flac,"multi', 'line fifth"', '']
    (tmp_path / "m.csv").write_text("\r\n".join(rows), encoding="utf-8")
    out = tmp_path / "out"
    res = pack(PackConfig(input=str(tmp_path / "m.csv"), output=str(out), progress=False, workers=1))
    assert res.samples == 2 and res.rejects_by_reason == {"bad_row": 3}
    import pyarrow.parquet as pq

    texts = sorted(zip(*pq.read_table(out / "index.parquet", columns=["source", "text"]).to_pydict().values()))
    assert texts == [(str(tmp_path / "a.flac"), "first, quoted"), (str(tmp_path / "e.flac"), "multi line fifth")]
    rej = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rej] == [f"{tmp_path / 'm.csv'}:{k}" for k in (3, 4, 5)]
    assert all("from line 3" in r["detail"] for r in rej)


@pytest.mark.parametrize("gz", [False, True])
def test_jsonl_source_nemo_keys_and_bad_line(tmp_path, gz):
    audio(tmp_path / "wav" / "a.wav")
    lines = [json.dumps({"audio_filepath": "wav/a.wav", "text": "one", "duration": 0.3, "lang": "de",
                         "snr": 12.5, "tags": ["x"]}),
             "",
             "{not json",
             json.dumps(["a", "list"]),
             json.dumps({"text": "no audio"})]
    path = tmp_path / ("m.jsonl.gz" if gz else "m.jsonl")
    payload = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(payload) if gz else payload)
    assert detect_format(str(path)) == "jsonl"
    items, rejects = split(list(iter_items(str(path))))
    assert items == [Item(id="wav/a", audio=str(tmp_path / "wav" / "a.wav"), text="one", duration_s=0.3,
                          language="de", extra=(("snr", 12.5), ("tags", ["x"])))]
    assert [r.reason.split(":")[0] for r in rejects] == ["bad_json", "bad_json", "missing_path"]
    assert "line 3" in rejects[0].reason and rejects[0].path.endswith(":3")


def test_jsonl_fields_that_are_not_strings_are_rejected_not_stringified(tmp_path):
    """A JSON transcript, speaker or duration of the wrong type is a bad_field reject naming it (before: str() of it
    was packed: the transcript "['hello', 'world']", "True", a duration of true as 1.0 s); integers are text."""
    audio(tmp_path / "a.flac")
    recs = [{"audio_filepath": "a.flac", "text": ["hello", "world"]}, {"audio_filepath": "a.flac", "text": True},
            {"audio_filepath": "a.flac", "text": {"orth": "x"}}, {"path": "a.flac", "text": "ok", "speaker": [3]},
            {"path": "a.flac", "text": "ok", "duration": True, "id": "d"}, {"path": "a.flac", "text": 42, "id": "n"},
            {"path": "a.flac", "text": "fine", "sentence": ["another", "alias"], "id": "f"}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    items, rejects = split(list(iter_items(str(path))))
    assert [(i.id, i.text) for i in items] == [("n", "42"), ("f", "fine")]
    assert [r.reason for r in rejects] == [
        'bad_field: text is list ["hello", "world"], not a string', "bad_field: text is bool true, not a string",
        'bad_field: text is dict {"orth": "x"}, not a string', "bad_field: speaker is list [3], not a string",
        "bad_field: duration is bool true, not a number"]


def test_a_utf8_bom_costs_no_row(tmp_path):
    """A BOM (what Windows editors write) before the first line of a JSONL manifest, a Lhotse CutSet and a
    LibriSpeech chapter transcript: every row is read and the CutSet is still detected as one (before: the first
    row was a bad_json / missing_audio reject, and the CutSet a jsonl manifest of missing_path rejects)."""
    bom = "\ufeff".encode()
    audio(tmp_path / "a.flac")
    audio(tmp_path / "b.flac")
    rows = [{"audio_filepath": "a.flac", "text": "one"}, {"audio_filepath": "b.flac", "text": "two"}]
    (tmp_path / "m.jsonl").write_bytes(bom + "".join(json.dumps(r) + "\r\n" for r in rows).encode())
    items, rejects = split(list(iter_items(str(tmp_path / "m.jsonl"))))
    assert [(i.id, i.text) for i in items] == [("a", "one"), ("b", "two")] and not rejects

    from lhotse import CutSet, Recording, SupervisionSegment

    rec = Recording.from_file(tmp_path / "a.flac", recording_id="a")
    cut = rec.to_cut().with_id("c")
    cut.supervisions = [SupervisionSegment(id="s", recording_id="a", start=0.0, duration=0.1, text="cut")]
    CutSet.from_cuts([cut]).to_file(tmp_path / "cuts.jsonl")
    (tmp_path / "cuts.jsonl").write_bytes(bom + (tmp_path / "cuts.jsonl").read_bytes())
    assert detect_format(str(tmp_path / "cuts.jsonl")) == "lhotse"
    items, rejects = split(list(iter_items(str(tmp_path / "cuts.jsonl"))))
    assert [(i.id, i.text, i.duration_s) for i in items] == [("s", "cut", 0.1)] and not rejects

    chapter = tmp_path / "libri" / "19" / "198"
    for u in range(2):
        audio(chapter / f"19-198-000{u}.flac", seed=u)
    (chapter / "19-198.trans.txt").write_bytes(bom + b"19-198-0000 FIRST\n19-198-0001 SECOND\n")
    items, rejects = split(list(iter_items(str(tmp_path / "libri"))))
    assert [(i.id, i.text) for i in items] == [("19-198-0000", "FIRST"), ("19-198-0001", "SECOND")]
    assert not rejects


def test_librispeech_source(tmp_path):
    root = tmp_path / "train-clean-5"
    chap = root / "19" / "198"
    for utt in ("19-198-0000", "19-198-0001", "19-198-0003"):
        audio(chap / f"{utt}.flac")
    (chap / "19-198.trans.txt").write_text("19-198-0000 NORTHANGER ABBEY\n19-198-0001 CHAPTER ONE\n"
                                           "19-198-0002 NO AUDIO HERE\n")
    audio(root / "26" / "495" / "26-495-0000.flac")
    (root / "26" / "495" / "26-495.trans.txt").write_text("26-495-0000 A B\n")
    assert detect_format(str(root)) == "librispeech"
    items, rejects = split(list(iter_items(str(root))))
    assert [i.id for i in items] == ["19-198-0000", "19-198-0001", "26-495-0000"]
    assert items[0] == Item(id="19-198-0000", audio=str(chap / "19-198-0000.flac"), text="NORTHANGER ABBEY",
                            speaker="19", language="en", extra=(("chapter", "198"),))
    assert items[2].speaker == "26"
    assert sorted((r.id, r.reason.split(":")[0]) for r in rejects) == [("19-198-0002", "missing_audio"),
                                                                        ("19-198-0003", "missing_transcript")]


def test_lhotse_source_segments(tmp_path):
    from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

    long_wav = audio(tmp_path / "long.wav", duration_s=3.0, seed=1)
    short_flac = audio(tmp_path / "short.flac", duration_s=1.0, seed=2)
    rec_long = Recording.from_file(str(long_wav))
    rec_short = Recording.from_file(str(short_flac))
    two = MonoCut(id="cut-two", start=0.5, duration=2.0, channel=0, recording=rec_long, supervisions=[
        SupervisionSegment(id="sup-a", recording_id=rec_long.id, start=0.1, duration=0.4, text="first",
                           speaker="S1", language="English", custom={"origin": "test"}),
        SupervisionSegment(id="sup-b", recording_id=rec_long.id, start=1.0, duration=0.75, text="second",
                           speaker="S2", gender="f")])
    whole = MonoCut(id="cut-whole", start=0.0, duration=1.0, channel=0, recording=rec_short, supervisions=[
        SupervisionSegment(id="sup-w", recording_id=rec_short.id, start=0.0, duration=1.0, text="all")])
    bare = MonoCut(id="cut-bare", start=0.0, duration=1.0, channel=0, recording=rec_short)
    manifest = tmp_path / "cuts.jsonl.gz"
    CutSet.from_cuts([two, whole, bare]).to_file(manifest)
    # append a cut whose recording lives in a command (lhotse supports it; we must reject it)
    odd = whole.to_dict()
    odd["id"], odd["recording"]["sources"] = "cut-cmd", [{"type": "command", "channels": [0], "source": "cat x"}]
    with gzip.open(manifest, "at") as f:
        f.write(json.dumps(odd) + "\n")

    assert detect_format(str(manifest)) == "lhotse"
    items, rejects = split(list(iter_items(str(manifest))))
    by_id = {i.id: i for i in items}
    assert sorted(by_id) == ["sup-a", "sup-b", "sup-w"]
    a, b, w = by_id["sup-a"], by_id["sup-b"], by_id["sup-w"]
    assert (a.start_s, a.duration_s, a.text, a.speaker, a.language) == (0.6, 0.4, "first", "S1", "English")
    assert a.extra == (("origin", "test"),) and b.extra == (("gender", "f"),)
    assert (b.start_s, b.duration_s, b.audio) == (1.5, 0.75, str(long_wav))
    assert (w.start_s, w.duration_s, w.audio) == (0.0, None, str(short_flac))
    assert sorted((r.id, r.reason.split(":")[0]) for r in rejects) == [("cut-bare", "missing_transcript"),
                                                                        ("cut-cmd", "unsupported_source")]
    # the segments really are the right samples of the recording
    ref, _ = sf.read(long_wav, dtype="int16")
    for item, first in ((a, 9600), (b, 24000)):
        data, info = encode_for_shard(item, probe(item.audio), AudioTarget())
        np.testing.assert_array_equal(decode(data, "int16")[0], ref[first:first + info.num_samples])
        assert info.num_samples == round(item.duration_s * 16000)
    data, _ = encode_for_shard(w, probe(w.audio), AudioTarget())
    assert data == short_flac.read_bytes()  # whole file, already flac 16k mono: kept byte for byte


def test_detect_format_errors_name_what_was_looked_for(tmp_path):
    with pytest.raises(ValueError, match="does not exist.*LibriSpeech"):
        detect_format(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("x")
    with pytest.raises(ValueError, match="no audio files"):
        detect_format(str(tmp_path / "empty"))
    (tmp_path / "list.txt").write_text("x")
    with pytest.raises(ValueError, match="unknown type"):
        detect_format(str(tmp_path / "list.txt"))
    with pytest.raises(ValueError, match="source_format"):
        iter_items(str(tmp_path), "sphinx")


def test_remote_dir_and_manifest_give_urls_that_probe(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/remote/spk/x.flac", audio(tmp_path / "x.flac").read_bytes())
    fs.pipe("/remote/spk/x.txt", b"remote text")
    fs.pipe("/remote/m.jsonl", json.dumps({"path": "spk/x.flac", "text": "t"}).encode() + b"\n")
    (item,) = iter_items("memory://remote")
    assert item.id == "spk/x" and item.text == "remote text" and item.audio.startswith("memory://")
    (from_manifest,) = iter_items("memory://remote/m.jsonl")
    assert from_manifest.audio == item.audio
    assert probe(item.audio).num_samples == 4800
