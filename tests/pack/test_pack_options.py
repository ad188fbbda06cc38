"""pack options a new user meets first (issue 22): channel policy, minimum duration, transcript file names and
whitespace, Hugging Face DatasetDict folders."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from conftest import dataset_sha256s

from shardtrain import cli
from shardtrain.format.manifest import open_dataset
from shardtrain.pack.packer import AudioTarget, PackConfig, pack
from shardtrain.pack.shard_task import PackError
from shardtrain.pack.sources import detect_format
from shardtrain.testing.corpus import make_corpus, synth_wave


def _pack(src, out, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("workers", 1)
    return pack(PackConfig(input=str(src), output=str(out), **kw))


def _rows(out: Path) -> dict[str, dict]:
    return {r["key"]: r for r in open_dataset(str(out)).read_index(["key", "text", "duration_s"]).to_pylist()}


def _audio(out: Path) -> dict[str, np.ndarray]:
    ds = open_dataset(str(out))
    got = {}
    for r in ds.read_index(["key", "shard", "audio_offset", "audio_size"]).to_pylist():
        data = (out / ds.shards[r["shard"]].name).read_bytes()[r["audio_offset"]: r["audio_offset"] + r["audio_size"]]
        got[r["key"]] = sf.read(io.BytesIO(data), dtype="int16")[0]
    return got


def _rejects(out: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (out / "rejects.jsonl").read_text().splitlines())}


# ---- channels ---------------------------------------------------------------------------------------------------
@pytest.fixture
def one_sided(tmp_path) -> Path:
    """A stereo 16 kHz WAV with speech-like signal on the left channel only."""
    src = tmp_path / "stereo"
    src.mkdir()
    left = np.round(synth_wave(1.0, 16000, seed=7) * 32767).astype(np.int16)
    sf.write(src / "a.wav", np.stack([left, np.zeros_like(left)], axis=1), 16000, subtype="PCM_16")
    (src / "a.txt").write_text("one sided")
    return src


def test_channels_policy_first_keeps_the_level_mix_halves_it(tmp_path, one_sided):
    left = sf.read(one_sided / "a.wav", dtype="int16")[0][:, 0]
    _pack(one_sided, tmp_path / "mix")
    _pack(one_sided, tmp_path / "first", audio=AudioTarget(channel_policy="first"))
    _pack(one_sided, tmp_path / "idx1", audio=AudioTarget(channel_policy="1"))
    mix, first, idx1 = (_audio(tmp_path / n)["a"] for n in ("mix", "first", "idx1"))
    assert np.array_equal(first, left)  # exact: a picked channel is copied as int16
    rms = lambda x: float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))  # noqa: E731
    assert rms(mix) == pytest.approx(rms(left) / 2, rel=0.01)  # the 6 dB an average loses
    assert not idx1.any()
    with pytest.raises(PackError, match="no utterance accepted .* missing_channel x1"):  # nothing left: no dataset
        _pack(one_sided, tmp_path / "idx2", audio=AudioTarget(channel_policy="2"))
    assert not (tmp_path / "idx2" / "manifest.json").exists()
    with pytest.raises(ValueError, match="--channels-policy"):
        PackConfig(input="x", output="y", audio=AudioTarget(channel_policy="left"))


def test_channels_policy_and_min_duration_in_cli_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["pack", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--channels-policy" in text and "mix averages the channels" in text
    assert "--min-duration-s" in text and "default: 0.2" in text


# ---- duration -----------------------------------------------------------------------------------------------------
def test_min_duration_default_rejects_a_tenth_of_a_second_with_a_reason(tmp_path):
    src = make_corpus(tmp_path / "c", [0.1, 1.0], seed=2)
    r = _pack(src, tmp_path / "out")
    rej = _rejects(tmp_path / "out")
    assert r.samples == 1 and rej["utt-00000"]["reason"] == "too_short"
    assert "--min-duration-s 0.2" in rej["utt-00000"]["detail"]
    assert _pack(src, tmp_path / "all", min_duration_s=None).samples == 2
    assert cli.main(["pack", str(src), str(tmp_path / "cli0"), "--min-duration-s", "0", "--no-progress"]) == 0
    assert len(_rows(tmp_path / "cli0")) == 2


# ---- transcripts --------------------------------------------------------------------------------------------------
def test_transcript_extensions_case_insensitive_and_lab(tmp_path):
    src = make_corpus(tmp_path / "c", [0.5, 0.6, 0.7, 0.8], seed=3)
    for name, ext in (("utt-00000", ".TXT"), ("utt-00001", ".Txt"), ("utt-00002", ".lab")):
        text = (src / f"{name}.txt").read_text()
        (src / f"{name}.txt").unlink()
        (src / f"{name}{ext}").write_text(text)
    (src / "utt-00003.txt").unlink()
    r = _pack(src, tmp_path / "out")
    assert r.samples == 3 and sorted(_rows(tmp_path / "out")) == ["utt-00000", "utt-00001", "utt-00002"]
    assert _rejects(tmp_path / "out")["utt-00003"]["reason"] == "missing_transcript"


def test_inner_whitespace_collapsed_in_stored_text(tmp_path):
    src = make_corpus(tmp_path / "c", [0.5, 0.6], seed=4)
    (src / "utt-00000.txt").write_text("  hello  world\tand\nmore\r\n  lines \u00a0here ")
    (src / "utt-00001.txt").write_text("Already Clean, Case Kept.")
    _pack(src, tmp_path / "out")
    rows = _rows(tmp_path / "out")
    assert rows["utt-00000"]["text"] == "hello world and more lines here"
    assert rows["utt-00001"]["text"] == "Already Clean, Case Kept."  # normalisation beyond whitespace: the trainer's
    ds = open_dataset(str(tmp_path / "out"))
    r = ds.read_index(["key", "shard", "json_offset", "json_size"]).to_pylist()
    meta = [json.loads((tmp_path / "out" / ds.shards[x["shard"]].name).read_bytes()
                       [x["json_offset"]: x["json_offset"] + x["json_size"]]) for x in r]
    assert {m["text"] for m in meta} == {"hello world and more lines here", "Already Clean, Case Kept."}


# ---- Hugging Face DatasetDict -------------------------------------------------------------------------------------
def test_dataset_dict_detected_and_split_required(tmp_path):
    datasets = pytest.importorskip("datasets")
    clips = make_corpus(tmp_path / "clips", [0.5, 0.6, 0.7], seed=5)
    files = sorted(clips.glob("*.flac"))

    def split(fs: list[Path], words: list[str]):
        return datasets.Dataset.from_dict({"audio": [{"bytes": f.read_bytes(), "path": f.name} for f in fs],
                                           "text": words}).cast_column("audio", datasets.Audio(decode=False))

    dd = datasets.DatasetDict({"train": split(files[:2], ["eins", "zwei"]), "test": split(files[2:], ["drei"])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert detect_format(str(tmp_path / "dd")) == "hf"
    with pytest.raises(ValueError, match=r"--split.*train, test|--split.*test, train"):
        _pack(tmp_path / "dd", tmp_path / "none")
    with pytest.raises(ValueError, match="no split 'dev'"):
        _pack(tmp_path / "dd", tmp_path / "dev", split="dev")
    r = _pack(tmp_path / "dd", tmp_path / "train", split="train")
    assert r.samples == 2 and sorted(x["text"] for x in _rows(tmp_path / "train").values()) == ["eins", "zwei"]
    assert cli.main(["pack", str(tmp_path / "dd"), str(tmp_path / "cli"), "--split", "test", "--no-progress"]) == 0
    assert [x["text"] for x in _rows(tmp_path / "cli").values()] == ["drei"]
    assert cli.main(["pack", str(tmp_path / "dd"), str(tmp_path / "cli2"), "--no-progress"]) == 2


def test_audio_flags_reach_the_nested_audio_target_and_the_manifest_as_before(tmp_path):
    """The CLI's audio flags build PackConfig.audio: the same shards, index and manifest as PackConfig(audio=...)
    in Python, and the manifest records the options under the names (and the fingerprint) packs always had."""
    src = make_corpus(tmp_path / "src", [0.5, 1.0, 0.7], sample_rate_hz=22050, fmt="wav", channels=2, seed=5)
    flags = ["--codec", "wav", "--sample-rate", "8000", "--channels", "1", "--channels-policy", "first",
             "--no-decode-check", "--no-progress"]
    assert cli.main(["pack", str(src), str(tmp_path / "cli"), *flags]) == 0
    audio = AudioTarget(codec="wav", sample_rate_hz=8000, channels=1, channel_policy="first", verify_decode=False)
    pack(PackConfig(input=str(src), output=str(tmp_path / "api"), audio=audio, progress=False))
    assert dataset_sha256s(tmp_path / "cli") == dataset_sha256s(tmp_path / "api")
    options = json.loads((tmp_path / "cli" / "manifest.json").read_text())["options"]
    assert options == {"input": str(src), "codec": "wav", "sample_rate_hz": 8000, "channels": 1,
                       "keep_original": False, "decode_check": False, "channels_policy": "first",
                       "target_shard_mb": 256.0, "max_samples_per_shard": None, "min_duration_s": 0.2,
                       "max_duration_s": None, "source_format": "auto"}
    with pytest.raises(ValueError, match="--sample-rate 22050 is not allowed with opus"):
        PackConfig(input="x", output="y", audio=AudioTarget(codec="opus", sample_rate_hz=22050))
