"""shardtrain.pack.corpora: Kaldi data dirs, Hugging Face datasets and Common Voice releases, each written by the
real tool's conventions (kaldiio writes the ark, `datasets` saves its own dataset), packed for real and read back."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from shardtrain import storage
from shardtrain.format.manifest import open_dataset
from shardtrain.pack.packer import AudioTarget, PackConfig, pack
from shardtrain.pack.sources import Item, Reject, detect_format, iter_items


def noise(path: Path, duration_s: float, rate_hz: int = 16000, seed: int = 0) -> np.ndarray:
    """16-bit noise written with the format from the suffix; returns the int16 samples."""
    path.parent.mkdir(parents=True, exist_ok=True)
    x = np.random.default_rng(seed).integers(-8000, 8000, round(duration_s * rate_hz), dtype=np.int16)
    fmt, subtype = {".mp3": ("MP3", "MPEG_LAYER_III"), ".wav": ("WAV", "PCM_16")}.get(path.suffix, ("FLAC", "PCM_16"))
    sf.write(path, x, rate_hz, format=fmt, subtype=subtype)
    return x


def packed(url: str) -> dict[str, tuple[dict, bytes]]:
    """key -> (index row, stored audio bytes), read by the index's byte offsets."""
    ds = open_dataset(url)
    out = {}
    for r in ds.read_index().to_pylist():
        s = r["audio_offset"]
        out[r["key"]] = (r, storage.read_range(ds.shard_url(r["shard"]), s, s + r["audio_size"]))
    return out


def rejects(url: str) -> dict[str, str]:
    return {json.loads(x)["id"]: json.loads(x)["reason"] for x in (Path(url) / "rejects.jsonl").read_text().splitlines()}


def do_pack(src, out, **kw):
    return pack(PackConfig(input=str(src), output=str(out), workers=1, progress=False, **kw))


# ---- Kaldi ----------------------------------------------------------------------------------------------------
def test_kaldi_data_dir_with_segments_ark_and_pipes(tmp_path):
    import kaldiio  # in the [test] extra; the packer itself needs no kaldiio
    audio = tmp_path / "audio"
    rec_a = noise(audio / "a.flac", 3.0, seed=1)
    rec_b = noise(audio / "b.wav", 2.0, seed=2)
    rec_c = noise(audio / "c.flac", 1.5, seed=3)
    rec_d = np.random.default_rng(4).integers(-8000, 8000, 16000, dtype=np.int16)
    kaldiio.save_ark(str(audio / "d.ark"), {"recD": (16000, rec_d)}, scp=str(audio / "d.scp"))
    ark_entry = (audio / "d.scp").read_text().split()[1]
    ran = tmp_path / "pipe-was-run"
    data = tmp_path / "data" / "train"
    data.mkdir(parents=True)
    (data / "wav.scp").write_text("\n".join([
        f"recA {audio / 'a.flac'}",
        f"recB sox {audio / 'b.wav'} -t wav -r 16000 - |",
        f"recC flac -c -d -s {audio / 'c.flac'} |",
        f"recD {ark_entry}",
        f"recE touch {ran} && cat {audio / 'a.flac'} |",
    ]) + "\n")
    (data / "segments").write_text("\n".join([
        "spk1-recA-0000 recA 0.00 1.25", "spk1-recA-0001 recA 1.25 3.00", "spk2-recB-0000 recB 0.50 1.50",
        "spk2-recC-0000 recC 0.00 -1", "spk3-recD-0000 recD 0.25 0.75", "spk3-recE-0000 recE 0.0 1.0",
        "spk1-recA-0002 recA 2.00 2.00", "spk1-recX-0000 recX 0.0 1.0", "spk2-recB-0001 recB 1.0 2.0",
    ]) + "\n")
    (data / "text").write_text("\n".join([
        "spk1-recA-0000 HELLO THERE", "spk1-recA-0001 GENERAL KENOBI", "spk2-recB-0000 ONE TWO",
        "spk2-recC-0000 WHOLE FILE", "spk3-recD-0000 FROM AN ARK", "spk3-recE-0000 NEVER RUN",
        "spk1-recA-0002 EMPTY SEGMENT", "spk1-recX-0000 NO RECORDING", "spk9-none-0000 ONLY TEXT",
    ]) + "\n")
    (data / "utt2spk").write_text("spk1-recA-0000 spk1\nspk1-recA-0001 spk1\nspk2-recB-0000 spk2\n"
                                  "spk2-recC-0000 spk2\nspk3-recD-0000 spk3\n")
    assert detect_format(str(data)) == "kaldi"
    out = tmp_path / "ds"
    res = do_pack(data, out, audio=AudioTarget(keep_original=False))
    assert not ran.exists()  # the shell command in wav.scp was never run
    got = packed(str(out))
    want = {"spk1-recA-0000": rec_a[:20000], "spk1-recA-0001": rec_a[20000:], "spk2-recB-0000": rec_b[8000:24000],
            "spk2-recC-0000": rec_c, "spk3-recD-0000": rec_d[4000:12000]}
    assert sorted(got) == sorted(want) and res.samples == 5
    for key, x in want.items():
        row, data_bytes = got[key]
        y, rate = sf.read(io.BytesIO(data_bytes), dtype="int16")
        assert rate == 16000 and np.array_equal(y, x), key
    assert got["spk1-recA-0001"][0]["text"] == "GENERAL KENOBI" and got["spk1-recA-0001"][0]["speaker"] == "spk1"
    assert got["spk3-recD-0000"][0]["source"].startswith(str(audio / "d.ark") + "#bytes=")
    rej = rejects(str(out))
    assert rej["spk3-recE-0000"] == "unsupported_pipe" and rej["spk1-recA-0002"] == "bad_segment"
    assert rej["spk1-recX-0000"] == "missing_audio" and rej["spk9-none-0000"] == "missing_audio"
    assert rej["spk2-recB-0001"] == "missing_transcript"


def test_kaldi_without_segments_and_refused_entries(tmp_path):
    noise(tmp_path / "x.flac", 0.5)
    (tmp_path / "feats.ark").write_bytes(b"u1 \0BFM \x04\x02\x00\x00\x00")
    data = tmp_path / "data"
    data.mkdir()
    (data / "wav.scp").write_text(f"u1 {tmp_path / 'x.flac'}\nu2 ark:/dev/stdin\nu3 {tmp_path / 'feats.ark'}:3\n"
                                  f"u4 sph2pipe -f wav -c 2 {tmp_path / 'x.sph'} |\n")
    (data / "text").write_text("u1 A B\nu2 C\nu3 D\nu4 E\n")
    out = list(iter_items(str(data)))
    items = [o for o in out if isinstance(o, Item)]
    reasons = {o.id: o.reason.split(":")[0] for o in out if isinstance(o, Reject)}
    assert [(i.id, i.text, i.start_s, i.duration_s) for i in items] == [("u1", "A B", 0.0, None)]
    assert reasons == {"u2": "unsupported_ark", "u3": "unsupported_ark", "u4": "unsupported_pipe"}
    assert "features" in next(o.reason for o in out if isinstance(o, Reject) and o.id == "u3")


def test_kaldi_repeated_ids_keep_the_first_line_and_are_rejected(tmp_path):
    """A data dir concatenated by hand repeats ids: the first `segments`/`text` line of an id is packed, every
    repeat is a named duplicate_id reject (before: the last line won silently, so u1's first segment vanished and
    its transcript was packed over the audio of the repeat's [1.0, 1.5] s)."""
    x = noise(tmp_path / "r1.wav", 2.0)
    data = tmp_path / "data"
    data.mkdir()
    (data / "wav.scp").write_text(f"r1 {tmp_path / 'r1.wav'}\n")
    (data / "segments").write_text("u1 r1 0.0 0.5\nu2 r1 0.5 1.0\nu1 r1 1.0 1.5\n")
    (data / "text").write_bytes("\ufeffu1 first\nu2 second\nu2 second again\n".encode())  # a BOM, too
    out = tmp_path / "ds"
    res = do_pack(data, out, min_duration_s=0.0)
    got = packed(str(out))
    assert res.samples == 2 and res.rejects_by_reason == {"duplicate_id": 2}
    for key, text, (a, b) in (("u1", "first", (0, 8000)), ("u2", "second", (8000, 16000))):
        row, data_ = got[key]
        assert row["text"] == text
        assert np.array_equal(sf.read(io.BytesIO(data_), dtype="int16")[0], x[a:b])
    rej = [json.loads(r) for r in (out / "rejects.jsonl").read_text().splitlines()]
    assert sorted((r["id"], r["path"].rsplit("/", 1)[1]) for r in rej) == [("u1", "segments"), ("u2", "text")]
    assert all("line 3" in r["detail"] and "first one is kept" in r["detail"] for r in rej)


# ---- Common Voice ---------------------------------------------------------------------------------------------
CV_HEADER = "client_id\tpath\tsentence_id\tsentence\tsentence_domain\tup_votes\tdown_votes\tage\tgender\taccents\t" \
            "variant\tlocale\tsegment"


def test_common_voice_release(tmp_path):
    root = tmp_path / "cv-corpus-20.0" / "de"
    lines = [CV_HEADER]
    for i in range(4):
        noise(root / "clips" / f"common_voice_de_{i}.mp3", 0.6 + 0.2 * i, seed=i)
        lines.append(f"c{i % 2}\tcommon_voice_de_{i}.mp3\ts{i}\tSatz \"{i}\" auf Deutsch\t\t2\t0\t"
                     f"{'twenties' if i else ''}\tfemale\t\t\tde\t")
    lines.append("c9\tcommon_voice_de_99.mp3\ts99\tKein Clip\t\t2\t0\t\t\t\t\tde\t")
    lines.append("c9\tbroken_row.mp3\tonly four fields")
    lines.append("c9\tcommon_voice_de_0.mp3\ts5\t\t\t2\t0\t\t\t\t\tde\t")
    (root / "validated.tsv").write_text("\n".join(lines) + "\n")
    (root / "train.tsv").write_text("\n".join(lines[:3]) + "\n")
    assert detect_format(str(root)) == "commonvoice"
    assert detect_format(str(root / "train.tsv")) == "commonvoice"
    out = tmp_path / "ds"
    res = do_pack(root, out)
    got = packed(str(out))
    assert res.samples == 4 and sorted(got) == [f"common_voice_de_{i}" for i in range(4)]
    for i in range(4):
        row = got[f"common_voice_de_{i}"][0]
        assert row["text"] == f'Satz "{i}" auf Deutsch' and row["speaker"] == f"c{i % 2}" and row["language"] == "de"
        assert abs(row["duration_s"] - (0.6 + 0.2 * i)) < 0.08
    meta = json.loads(storage.read_range(open_dataset(str(out)).shard_url(got["common_voice_de_1"][0]["shard"]),
                                         got["common_voice_de_1"][0]["json_offset"],
                                         got["common_voice_de_1"][0]["json_offset"]
                                         + got["common_voice_de_1"][0]["json_size"]))
    assert meta["gender"] == "female" and meta["age"] == "twenties"
    rej = rejects(str(out))
    assert rej["common_voice_de_99"] == "missing_file" and "empty_transcript" in rej.values()
    assert any(v == "bad_row" for v in rej.values())
    train = [o for o in iter_items(str(root / "train.tsv")) if isinstance(o, Item)]
    assert [i.id for i in train] == ["common_voice_de_0", "common_voice_de_1"]


# ---- Hugging Face datasets ------------------------------------------------------------------------------------
@pytest.fixture
def hf_dataset(tmp_path):
    """A `datasets` dataset with an Audio column (3 rows embedded bytes, 1 path-only) saved by the library itself."""
    import datasets
    clips = tmp_path / "clips"
    files = [clips / f"utt{i}.flac" for i in range(4)]
    for i, f in enumerate(files):
        noise(f, 0.4 + 0.1 * i, seed=10 + i)
    rows = {"audio": [{"bytes": f.read_bytes(), "path": f.name} for f in files[:3]] + [{"bytes": None,
                                                                                       "path": str(files[3])}],
            "words": ["eins", "zwei", "drei", "vier"], "speaker_id": ["a", "b", "a", "b"],
            "id": ["u0", "u1", "u2", "u3"]}
    ds = datasets.Dataset.from_dict(rows).cast_column("audio", datasets.Audio(decode=False))
    return ds, files


def test_hugging_face_save_to_disk(tmp_path, hf_dataset):
    ds, files = hf_dataset
    ds.save_to_disk(str(tmp_path / "hf"))
    assert detect_format(str(tmp_path / "hf")) == "hf"
    with pytest.raises(ValueError, match="--text-column"):
        list(iter_items(str(tmp_path / "hf")))
    out = tmp_path / "ds"
    res = do_pack(tmp_path / "hf", out, text_column="words")
    got = packed(str(out))
    assert res.samples == 4 and sorted(got) == ["u0", "u1", "u2", "u3"]
    for i, f in enumerate(files):
        row, data = got[f"u{i}"]
        assert data == f.read_bytes()  # 16 kHz mono FLAC is kept byte for byte, wherever it came from
        assert row["text"] == ["eins", "zwei", "drei", "vier"][i] and row["speaker"] == "ab"[i % 2]
    sources = {k: v[0]["source"] for k, v in got.items()}
    assert all(".arrow#bytes=" in v for v in sources.values())  # save_to_disk embeds path-only audio too


def test_hugging_face_text_column_of_lists_is_refused(tmp_path, hf_dataset):
    """--text-column naming a list column (word lists) is refused naming its type (before: each row's Python repr,
    "['eins', 'x']", was packed as its transcript)."""
    ds, _ = hf_dataset
    ds = ds.map(lambda r: {"tokens": [r["words"], "x"]})
    ds.save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(ValueError, match=r"text column 'tokens' holds list<item: string>, not strings"):
        list(iter_items(str(tmp_path / "hf"), text_column="tokens"))
    assert [i.text for i in iter_items(str(tmp_path / "hf"), text_column="words")] == ["eins", "zwei", "drei", "vier"]


def test_hugging_face_parquet(tmp_path, hf_dataset, monkeypatch):
    ds, files = hf_dataset
    ds = ds.remove_columns("id").rename_column("words", "sentence")
    ds.to_parquet(str(tmp_path / "train.parquet"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the Arrow copy goes to ~/.cache/shardtrain/hf-arrow
    assert detect_format(str(tmp_path / "train.parquet")) == "hf"
    out = tmp_path / "ds"
    res = do_pack(tmp_path / "train.parquet", out)
    got = packed(str(out))
    assert res.samples == 4 and sorted(got) == ["utt0", "utt1", "utt2", "utt3"]
    assert [got[f"utt{i}"][1] == f.read_bytes() for i, f in enumerate(files)] == [True] * 4
    assert got["utt2"][0]["text"] == "drei"
    assert got["utt3"][0]["source"] == str(files[3])  # to_parquet keeps a path-only row's path
    assert list((tmp_path / "home" / ".cache" / "shardtrain" / "hf-arrow").glob("train.parquet.*.arrow"))
