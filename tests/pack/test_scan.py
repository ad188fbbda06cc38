"""pack/scan.py: one part of a real folder corpus (FLAC written by make_corpus, plus files broken on purpose) read,
probed and filtered: what becomes a candidate, each reject's reason and where it is decided (early: without audio;
late: after the header probe), durations from the headers, transcripts' whitespace collapsed, and a digest that
follows what shapes the sample (the whole pack: tests/pack/test_packer.py)."""
from __future__ import annotations

import dataclasses

import numpy as np

from shardtrain.pack.config import PackConfig
from shardtrain.pack.parts import iter_parts
from shardtrain.pack.scan import collapse_whitespace, sample_digest, scan_part
from shardtrain.pack.shard_task import SampleSpec
from shardtrain.testing.corpus import make_corpus

DURS = [1.0, 1.5, 0.1, 2.0, 1.2, 0.8]


def corpus(tmp_path):
    root = make_corpus(tmp_path / "c", DURS, seed=2)
    (root / "manifest.tsv").unlink()
    (root / "manifest.jsonl").unlink()
    (root / "utt-00001.txt").write_text("  \n")  # empty transcript: an early reject
    (root / "utt-00003.flac").write_bytes(b"fLaC" + b"\0" * 64)  # a header that lies: a late reject
    (root / "utt-00004.txt").write_text("two\tspaces  and\na line break")
    return root


def scan(cfg):
    parts = list(iter_parts(cfg.input, part_items=1024))
    assert len(parts) == 1
    return scan_part(cfg, parts[0])


def test_rejects_where_decided_durations_and_text(tmp_path):
    cfg = PackConfig(input=str(corpus(tmp_path)), output=str(tmp_path / "out"), progress=False)
    part, records = scan(cfg)
    assert part.items == 6
    assert [(pos, row["reason"], row["id"]) for pos, row in part.early] == [(1, "empty_transcript", "utt-00001")]
    ids = part.ids.to_pylist()
    assert ids == ["utt-00000", "utt-00002", "utt-00003", "utt-00004", "utt-00005"] and part.pos.tolist() == [0, 2, 3,
                                                                                                               4, 5]
    assert part.keys.to_pylist() == ids  # already valid keys
    late = {ids[j]: row["reason"] for j, row in part.late.items()}
    assert late == {"utt-00002": "too_short", "utt-00003": "unreadable_audio"}
    assert part.late[1]["detail"] == "0.100 s < --min-duration-s 0.2" and part.late[1]["key"] is None
    assert part.ok.tolist() == [True, False, False, True, True]
    np.testing.assert_allclose(part.duration_s[part.ok], [1.0, 1.2, 0.8], atol=1e-3)
    assert all(e > 0 for e in part.est_bytes[part.ok]) and not part.est_bytes[~part.ok].any()
    texts = {item.id: item.text for item, info, _, _ in records if info is not None}
    assert texts["utt-00004"] == "two spaces and a line break"
    assert [r[1] is None for r in records] == [False, True, True, False, False]


def test_min_duration_and_digest_follow_the_config_and_the_sample(tmp_path):
    root = corpus(tmp_path)
    part, records = scan(PackConfig(input=str(root), output=str(tmp_path / "o"), progress=False,
                                    min_duration_s=0.05))
    assert {part.ids[j].as_py() for j in part.late} == {"utt-00003"}  # 0.1 s is kept under a 0.05 s minimum
    item, info, dur, est = records[1]
    s = SampleSpec(key="k", item=item, info=info, duration_s=dur, est_bytes=est)
    d = sample_digest(s)
    assert len(d) == 16 and d == sample_digest(dataclasses.replace(s, key="other"))  # the key is not in it
    assert d != sample_digest(dataclasses.replace(s, item=dataclasses.replace(item, text="changed")))
    assert d != sample_digest(s, stamp="mtime-size")


def test_collapse_whitespace():
    assert collapse_whitespace(" a\u00a0b\u2003 c\r\n") == "a b c" and collapse_whitespace("") == ""


def test_the_same_segment_through_two_lhotse_windows_is_packed_once(tmp_path):
    """lhotse's cut_into_windows keeps a supervision that spans a window boundary in both windows; seen through
    the second window its start is 9.3 + (-1.2) = 8.100000000000001 s. Segments are compared in samples, so
    each supervision is packed once, its audio exactly its samples (before: s3 was packed twice, float noise
    hid the duplicate)."""
    import io

    import soundfile as sf
    from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

    from shardtrain.format.manifest import open_dataset
    from shardtrain.pack.packer import pack
    from shardtrain.storage import read_range

    x = np.random.default_rng(0).integers(-3000, 3000, 16000 * 10, dtype=np.int16)
    sf.write(tmp_path / "r.wav", x, 16000)
    rec = Recording.from_file(tmp_path / "r.wav", recording_id="r")
    starts = [0.3, 2.9, 5.7, 8.1]
    sups = [SupervisionSegment(id=f"s{i}", recording_id="r", start=s, duration=1.7, text=f"sup {i}")
            for i, s in enumerate(starts)]
    cut = MonoCut(id="c", start=0, duration=rec.duration, channel=0, recording=rec, supervisions=sups)
    CutSet.from_cuts([cut]).cut_into_windows(duration=3.1).to_file(tmp_path / "cuts.jsonl")
    out = tmp_path / "out"
    res = pack(PackConfig(input=str(tmp_path / "cuts.jsonl"), output=str(out), progress=False, workers=1))
    assert res.samples == 4 and res.rejects_by_reason == {"duplicate_audio": 3}
    ds = open_dataset(str(out))
    rows = {r["text"]: r for r in ds.read_index().to_pylist()}
    assert sorted(rows) == [f"sup {i}" for i in range(4)]
    for i, s in enumerate(starts):
        r = rows[f"sup {i}"]
        data = read_range(ds.shard_url(r["shard"]), r["audio_offset"], r["audio_offset"] + r["audio_size"])
        a = round(s * 16000)
        assert np.array_equal(sf.read(io.BytesIO(data), dtype="int16")[0], x[a:a + round(1.7 * 16000)])
