"""Issues 21 and 22: what `transcribe` and `evaluate` are given -- corpora `pack` reads, crafted and long audio.

A tiny checkpoint is trained for 2 steps by the real trainer (pipelines.tiny_cpu) on FLAC noise packed by the real
packer: its transcripts are meaningless, but everything these tests check (which utterances are read, how long,
against which reference, what fails and how) does not depend on accuracy. All audio is encoded by soundfile.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from pipelines import load_pipeline
from shardtrain.cli import main
from shardtrain.infer.checkpoint_model import load_trained
from shardtrain.infer.score import markdown_table
from shardtrain.infer.transcribe import TranscribeConfig, transcribe
from shardtrain.train.overrides import apply_overrides

TINY = ["model.d_model=32", "model.num_layers=1", "train.augment=false", "train.tensorboard=false",
        "train.progress=false", "train.cpu_threads=1", "train.val_every_steps=0", "train.warmup_steps=1",
        "stream.bucket.max_batch_seconds=30", "stream.bucket.num_buckets=1", "train.max_steps=2"]


def _noise(seconds: float, seed: int = 0, rate: int = 16000) -> np.ndarray:
    return (0.05 * np.random.default_rng(seed).standard_normal(int(seconds * rate))).astype("float32")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from shardtrain.pack import PackConfig, pack
    from shardtrain.train.loop import train
    from shardtrain.world import World

    root = tmp_path_factory.mktemp("inputs_run")
    lines = ["path\ttext"]
    for i, t in enumerate(["one two", "three four five", "six"]):
        sf.write(root / f"{i}.flac", _noise(1.0 + i / 2, i), 16000)
        lines.append(f"{root / f'{i}.flac'}\t{t}")
    (root / "m.tsv").write_text("\n".join(lines) + "\n")
    pack(PackConfig(input=str(root / "m.tsv"), output=str(root / "data"), progress=False))
    cfg = apply_overrides(load_pipeline("tiny_cpu"), TINY + [f"train.data_url={root / 'data'}",
                                                            f"train.out_dir={root / 'run'}"])
    train(cfg, World())
    return root / "run"


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_kaldi_dir_honours_segments_and_text(run_dir, tmp_path, capsys):
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    sf.write(tmp_path / "rec1.wav", _noise(6.0, 7), 16000, subtype="PCM_16")
    (kaldi / "wav.scp").write_text(f"rec1 {tmp_path / 'rec1.wav'}\n")
    (kaldi / "segments").write_text("utt-a rec1 0.5 2.0\nutt-b rec1 3.0 5.5\n")
    (kaldi / "text").write_text("utt-a one two\nutt-b THREE, four!\n")
    out = tmp_path / "hyp.jsonl"
    assert main(["transcribe", str(run_dir), str(kaldi), "--out", str(out), "--no-progress"]) == 0
    rows = {r["key"]: r for r in _rows(out)}
    assert set(rows) == {"utt-a", "utt-b"}  # the segments, not the 6 s recording
    assert rows["utt-a"]["duration_s"] == pytest.approx(1.5) and rows["utt-b"]["duration_s"] == pytest.approx(2.5)
    assert rows["utt-b"]["reference"] == "THREE, four!"  # the raw text of `text`
    capsys.readouterr()
    res = tmp_path / "eval.json"
    main(["evaluate", str(run_dir), "--data", str(kaldi), "--out", str(res), "--no-progress"])
    got = json.loads(res.read_text())["datasets"][str(kaldi)]
    assert got["utterances"] == 2 and got["chars"]["ref"] == len("one two") + len("three four")  # normalised
    assert got["raw"]["chars"]["ref"] == len("one two") + len("THREE, four!")


def test_commonvoice_folder_is_read_like_pack_reads_it(run_dir, tmp_path):
    cv = tmp_path / "cv"
    (cv / "clips").mkdir(parents=True)
    lines = ["client_id\tpath\tsentence\tlocale"]
    for i in range(3):
        sf.write(cv / "clips" / f"c{i}.wav", _noise(1.0, i), 16000)
        lines.append(f"spk\tc{i}.wav\tSentence {i}.\ten")
    (cv / "validated.tsv").write_text("\n".join(lines) + "\n")
    res = tmp_path / "eval.json"
    main(["evaluate", str(run_dir), "--data", str(cv), "--out", str(res), "--no-progress"])
    got = json.loads(res.read_text())["datasets"][str(cv)]
    assert got["utterances"] == 3 and got["failed"] == 0


def test_hugging_face_dataset_is_read_through_byte_ranges(run_dir, tmp_path):
    import io

    import datasets

    def wav(i: int) -> bytes:
        b = io.BytesIO()
        sf.write(b, _noise(1.0 + i / 4, i), 16000, format="WAV")
        return b.getvalue()

    ds = datasets.Dataset.from_dict({"audio": [{"bytes": wav(i), "path": f"a{i}.wav"} for i in range(2)],
                                     "text": ["Hello there", "WORLD"]})
    ds.cast_column("audio", datasets.Audio(decode=False)).save_to_disk(str(tmp_path / "hf"))
    out = tmp_path / "hyp.jsonl"
    assert main(["transcribe", str(run_dir), str(tmp_path / "hf"), "--out", str(out), "--no-progress"]) == 0
    rows = sorted(_rows(out), key=lambda r: r["key"])
    assert [r["reference"] for r in rows] == ["Hello there", "WORLD"]
    assert [r["duration_s"] for r in rows] == pytest.approx([1.0, 1.25])


def test_evaluate_never_scores_nothing(run_dir, tmp_path, capsys):
    bare = tmp_path / "bare"  # audio without transcripts
    bare.mkdir()
    for i in range(2):
        sf.write(bare / f"a{i}.flac", _noise(1.0, i), 16000)
    assert main(["evaluate", str(run_dir), "--data", str(bare), "--no-progress"]) == 2
    cap = capsys.readouterr()
    assert "CER" not in cap.out and "0.00" not in cap.out  # no table row for nothing
    err = [x for x in cap.err.splitlines() if "evaluate:" in x]
    assert len(err) == 1 and "nothing to score" in err[0] and str(bare) in err[0]
    (bare / "a0.txt").write_text("one two\n")  # a folder of audio + .txt references is scored
    (bare / "a1.LAB").write_text("three\n")
    res = tmp_path / "eval.json"
    assert main(["evaluate", str(run_dir), "--data", str(bare), "--out", str(res), "--no-progress"]) == 0
    assert json.loads(res.read_text())["datasets"][str(bare)]["utterances"] == 2
    unfinished = tmp_path / "unfinished"  # a pack that has not finished: its own one-line message
    unfinished.mkdir()
    (unfinished / "shard-000000.tar").write_bytes(b"\0" * 1024)
    capsys.readouterr()
    assert main(["evaluate", str(run_dir), "--data", str(unfinished), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([x for x in err if "evaluate:" in x]) == 1 and "has not finished" in err[-1]


def _lying_flac(path: Path) -> None:
    """A real 1 s FLAC whose STREAMINFO claims 2^36 - 1 samples (~50 days, 256 GiB as float32)."""
    sf.write(path, _noise(1.0, 3), 16000, format="FLAC")
    b = bytearray(path.read_bytes())
    assert b[:4] == b"fLaC"
    v = int.from_bytes(b[18:26], "big") | ((1 << 36) - 1)  # the low 36 bits of these 8 bytes: total samples
    b[18:26] = v.to_bytes(8, "big")
    path.write_bytes(bytes(b))
    assert sf.info(str(path)).frames == (1 << 36) - 1


def test_lying_header_and_broken_files_are_rows_with_an_error(run_dir, tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    _lying_flac(folder / "liar.flac")
    (folder / "junk.wav").write_bytes(b"RIFF\x10\0\0\0WAVEfmt garbage")
    sf.write(folder / "good.flac", _noise(1.0, 5), 16000)
    tm = load_trained(run_dir)
    rows, errors = transcribe(tm, [str(folder)], TranscribeConfig(progress=False))  # no 256 GiB allocation
    by_key = {r["key"]: r for r in rows}
    assert set(by_key) == {"liar", "junk", "good"} and "error" not in by_key["good"]
    assert by_key["liar"]["error"].startswith("header_mismatch") and by_key["junk"]["error"]
    assert len(errors) == 2
    out = tmp_path / "hyp.jsonl"
    capsys.readouterr()
    assert main(["transcribe", str(run_dir), str(folder), "--out", str(out), "--no-progress"]) == 1
    assert sorted(r["key"] for r in _rows(out) if "error" in r) == ["junk", "liar"]
    assert "Traceback" not in capsys.readouterr().err


def test_long_audio_runs_window_by_window(run_dir, tmp_path):
    long = tmp_path / "long.flac"
    sf.write(long, _noise(75.0, 9), 16000)
    tm = load_trained(run_dir)
    widths: list[int] = []
    hook = tm.model.register_forward_pre_hook(lambda _m, args: widths.append(int(args[0].shape[1])))
    from shardtrain.pack import PackConfig, pack

    (tmp_path / "m.tsv").write_text(f"path\ttext\n{long}\tlong one\n")
    pack(PackConfig(input=str(tmp_path / "m.tsv"), output=str(tmp_path / "data"), progress=False))
    try:
        rows, errors = transcribe(tm, [str(long)], TranscribeConfig(progress=False))
        default_max = max(widths)
        widths.clear()
        rows10, _ = transcribe(tm, [str(long)], TranscribeConfig(progress=False, window_seconds=10.0))
        windows10 = list(widths)
        widths.clear()
        packed, _ = transcribe(tm, [str(tmp_path / "data")], TranscribeConfig(progress=False, window_seconds=10.0))
    finally:
        hook.remove()
    hop = tm.config.features.hop_length
    assert not errors and len(rows) == 1 and rows[0]["duration_s"] == pytest.approx(75.0)
    assert default_max <= 30 * 16000 // hop + 2  # default window 30 s: never the whole 75 s at once
    assert len(windows10) == 8 and max(windows10) <= 10 * 16000 // hop + 2  # 75 s in 10 s windows
    assert rows10[0]["duration_s"] == pytest.approx(75.0)
    assert len(widths) == 8 and max(widths) <= 10 * 16000 // hop + 2  # the same from a packed dataset
    assert packed[0]["text"] == rows10[0]["text"] and packed[0]["duration_s"] == pytest.approx(75.0)


def test_audio_just_past_a_window_is_transcribed(run_dir, tmp_path):
    """10 s + 100 samples in 5 s windows: the last window was 100 samples, fewer feature frames than the model's
    convolutions take, and the whole file failed (model_failed) from a folder and from a packed dataset alike."""
    (tmp_path / "in").mkdir()
    audio = tmp_path / "in" / "just_over.flac"
    sf.write(audio, np.concatenate([_noise(10.0, 3), _noise(1.0, 4)[:100]]), 16000)
    from shardtrain.pack import PackConfig, pack

    (tmp_path / "m.tsv").write_text(f"path\ttext\n{audio}\tjust over\n")
    pack(PackConfig(input=str(tmp_path / "m.tsv"), output=str(tmp_path / "data"), progress=False))
    tm = load_trained(run_dir)
    cfg = TranscribeConfig(progress=False, window_seconds=5.0)
    rows, errors = transcribe(tm, [str(tmp_path / "in"), str(tmp_path / "data")], cfg)
    assert not errors and [r.get("error") for r in rows] == [None, None]
    assert rows[0]["duration_s"] == rows[1]["duration_s"] == pytest.approx(10.00625, abs=1e-4)
    assert rows[0]["text"] == rows[1]["text"]  # files and datasets cut the windows alike


def test_markdown_cells_are_escaped():
    nasty = "a|b\nc\x1b[31mred\u202e"
    res = {"x|y": {"utterances": 1, "failed": 0, "cer": 0.5, "wer": 1.0,
                   "chars": {"sub": 1, "ins": 0, "del": 0}, "words": {"sub": 1, "ins": 0, "del": 0},
                   "raw": {"cer": 0.5, "wer": 1.0},
                   "worst": [{"key": "k|1", "cer": 0.5, "reference": nasty, "hypothesis": "ok"}]}}
    table = markdown_table(res)
    assert "\x1b" not in table and "\u202e" not in table
    rows = [ln for ln in table.splitlines() if ln.startswith("|")]
    header_cells = rows[0].count("|")
    assert rows[2].replace("\\|", "").count("|") == header_cells  # the dataset row keeps its columns
    worst = rows[-1].replace("\\|", "")
    assert worst.count("|") == 5 and "\\n" in rows[-1]  # 4 cells; the newline is visible, not a line break


def test_dataset_dict_takes_split_in_transcribe_and_evaluate(run_dir, tmp_path, capsys):
    """A DatasetDict folder needs a split: the error says --split, and --split exists on both commands."""
    import io

    import datasets

    def wav(i: int) -> bytes:
        b = io.BytesIO()
        sf.write(b, _noise(1.0, i), 16000, format="WAV")
        return b.getvalue()

    dd = datasets.DatasetDict({name: datasets.Dataset.from_dict(
        {"audio": [{"bytes": wav(i), "path": f"{name}{i}.wav"} for i in range(n)], "text": ["a b"] * n})
        .cast_column("audio", datasets.Audio(decode=False)) for name, n in (("train", 1), ("test", 2))})
    dd.save_to_disk(str(tmp_path / "dd"))
    capsys.readouterr()
    assert main(["transcribe", str(run_dir), str(tmp_path / "dd"), "--no-progress"]) == 2
    assert "--split NAME" in capsys.readouterr().err
    out = tmp_path / "hyp.jsonl"
    assert main(["transcribe", str(run_dir), str(tmp_path / "dd"), "--split", "test", "--out", str(out),
                 "--no-progress"]) == 0
    assert len(_rows(out)) == 2
    res = tmp_path / "eval.json"
    main(["evaluate", str(run_dir), "--data", str(tmp_path / "dd"), "--split", "test", "--out", str(res),
          "--no-progress"])
    assert json.loads(res.read_text())["datasets"][str(tmp_path / "dd")]["utterances"] == 2


@pytest.mark.s3
@pytest.mark.slow
def test_transcribe_evaluate_and_export_take_a_run_on_s3(run_dir, s3, s3_bucket, tmp_path, monkeypatch, capsys):
    """A run trained with --out s3://... is used where it is: checkpoints read through storage, the URL intact."""
    from shardtrain.train.loop import train
    from shardtrain.world import World

    url = f"{s3_bucket}/run"
    cfg = apply_overrides(load_pipeline("tiny_cpu"), TINY + [f"train.data_url={run_dir.parent / 'data'}",
                                                            f"train.out_dir={url}"])
    train(cfg, World(), storage_options=s3.storage_options)
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)  # the CLI builds its storage options from AWS_* as a user's shell would hold them
    sf.write(tmp_path / "a.wav", _noise(1.0, 3), 16000)
    (tmp_path / "a.txt").write_text("one two")
    out = tmp_path / "hyp.jsonl"
    assert main(["transcribe", url, str(tmp_path / "a.wav"), "--out", str(out), "--no-progress"]) == 0
    assert [r["key"] for r in _rows(out)] == ["a"]
    res = tmp_path / "eval.json"
    main(["evaluate", url, "--data", str(tmp_path), "--out", str(res), "--no-progress"])
    assert json.loads(res.read_text())["checkpoint"] == f"{url}/checkpoints/step_000002"  # not s3:/...
    capsys.readouterr()
    assert main(["export", url, str(tmp_path / "m.onnx")]) == 0
    assert (tmp_path / "m.onnx").stat().st_size > 0 and "s3:/" not in capsys.readouterr().out.replace("s3://", "")


def test_a_checkpoint_decodes_with_its_own_vocabulary_not_a_later_vocab_json(run_dir, tmp_path):
    """RUN/vocab.json is the latest run's: a run that started over in the folder (nothing loaded on --resume)
    rewrote it beside older steps of another vocabulary, and those steps decoded with the wrong characters,
    silently. Each checkpoint's meta.json carries its own tokenizer, which loading prefers."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    want = load_trained(run).tokenizer.to_json()
    vocab = json.loads((run / "vocab.json").read_text())
    assert vocab == want
    swapped = json.loads(json.dumps(vocab).replace('"e"', '"\\u0000"').replace('"o"', '"e"').replace('"\\u0000"',
                                                                                                  '"o"'))
    assert swapped != vocab  # same size, two characters exchanged: another run's vocabulary
    (run / "vocab.json").write_text(json.dumps(swapped))
    assert load_trained(run).tokenizer.to_json() == want


def test_a_folder_with_a_stem_twice_keys_those_files_by_their_path(tmp_path):
    """a/x.wav and b/x.wav were both key "x": two output rows no one could tell apart. A repeated stem is keyed by
    its path under the folder; a unique one keeps its stem (LibriSpeech ids match the packed keys)."""
    from shardtrain.infer.transcribe import folder_source

    for rel in ("a/x.wav", "b/x.wav", "b/y.flac"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        sf.write(tmp_path / rel, _noise(0.3), 16000)
    keys = sorted(u.key for u in folder_source(tmp_path).items)
    assert keys == ["a/x.wav", "b/x.wav", "y"]
    assert [u.key for u in folder_source(tmp_path / "a" / "x.wav").items] == ["x"]
