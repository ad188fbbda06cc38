"""Issue 22, item 3: one text normaliser, chosen in the pipeline, for vocabulary, targets, validation and scoring.

The run test trains the real tiny_cpu pipeline for 2 steps on a dataset packed by the real packer from FLAC files
written with soundfile (noise: the model's accuracy does not matter here, what it was built with does).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from pipelines import load_pipeline
from shardtrain.infer.score import Score
from shardtrain.train.config import RunConfig
from shardtrain.train.normalize import SPEECH, TextNormConfig
from shardtrain.train.overrides import apply_overrides, from_dict, to_dict
from shardtrain.train.text import CharVocab, error_counts, tokenizer_from_json

NFD_E = "e\u0301"  # e + COMBINING ACUTE ACCENT
TINY = ["model.d_model=32", "model.num_layers=1", "train.augment=false", "train.tensorboard=false",
        "train.progress=false", "train.cpu_threads=1", "train.val_every_steps=0", "train.warmup_steps=1",
        "stream.bucket.max_batch_seconds=30", "stream.bucket.num_buckets=1"]


def test_nfd_and_nfc_forms_are_one_symbol():
    v = CharVocab.from_texts([f"caf{NFD_E}", "café", "CAFÉ"], SPEECH)
    assert v.chars == sorted(set("café")) and "\u0301" not in v.chars
    assert v.encode(f"caf{NFD_E}") == v.encode("café") == v.encode("Café!")
    assert v.unknown_chars == 0
    legacy = CharVocab.from_texts([f"caf{NFD_E}", "café"])  # the default keeps what was written: two forms
    assert "\u0301" in legacy.chars and "é" in legacy.chars


def test_speech_normaliser_rules():
    assert SPEECH.apply("  Don’t STOP -- it's\t“quoted”,\nOK?  ") == "don't stop it's quoted ok"
    assert SPEECH.apply("well-known U.S.A.") == "well known u s a"
    assert SPEECH.apply("50% + $3") == "50 + $3"  # symbols are not punctuation
    assert TextNormConfig().apply(" A,  b\tC ") == "A, b C"  # legacy: whitespace only
    with pytest.raises(ValueError, match="text.case"):
        TextNormConfig(case="title")


def test_correct_all_caps_reference_scores_zero_normalised_cer():
    s = Score(normalizer=SPEECH)
    s.add("u1", "HELLO, WORLD! IT'S ME.", "hello world it's me")
    out = s.summary()
    assert out["cer"] == 0.0 and out["wer"] == 0.0
    assert out["raw"]["cer"] > 0.5 and out["raw"]["wer"] == 1.0  # raw still shows what differs
    assert error_counts(["HELLO, WORLD!"], ["hello world"], SPEECH)["char_errors"] == 0


def test_old_checkpoints_without_a_normaliser_get_the_identity():
    tok = tokenizer_from_json({"kind": "char", "chars": ["A", "B"]})  # what checkpoints stored before
    assert tok.normalizer == TextNormConfig() and tok.encode("A  B") == [1, 2]
    stored = to_dict(RunConfig())
    stored.pop("text")
    assert from_dict(RunConfig, stored).text == TextNormConfig()
    assert tokenizer_from_json(CharVocab(["a"], SPEECH).to_json()).normalizer == SPEECH


def test_default_pipelines_normalise():
    for name in ("tiny_cpu", "librispeech_base", "tiny_bilstm"):
        assert load_pipeline(name).text == SPEECH, name
    assert apply_overrides(load_pipeline("tiny_cpu"), ["text.case=keep"]).text.case == "keep"


def _pack(root: Path, name: str, texts: list[str]) -> str:
    from shardtrain.pack import PackConfig, pack

    rng = np.random.default_rng(len(name))
    lines = ["path\ttext"]
    for i, t in enumerate(texts):
        p = root / f"{name}-{i}.flac"
        sf.write(p, (0.05 * rng.standard_normal(16000 + 1600 * i)).astype("float32"), 16000)
        lines.append(f"{p}\t{t}")
    (root / f"{name}.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    pack(PackConfig(input=str(root / f"{name}.tsv"), output=str(root / name), progress=False))
    return str(root / name)


def test_run_normalises_targets_stores_the_normaliser_and_names_missing_val_chars(tmp_path, caplog):
    from shardtrain.infer.checkpoint_model import load_trained
    from shardtrain.train.loop import train
    from shardtrain.world import World

    train_url = _pack(tmp_path, "train", ["Hello, World!", "HOW are you?", f"Caf{NFD_E} au lait"])
    val_url = _pack(tmp_path, "dev", ["Grüße aus Köln", "hello"])
    index = __import__("pyarrow.parquet", fromlist=["x"]).read_table(Path(train_url) / "index.parquet")
    assert "Hello, World!" in index.column("text").to_pylist()  # the raw transcript stays in the index
    cfg = apply_overrides(load_pipeline("tiny_cpu"), TINY + [f"train.data_url={train_url}",
                                                            f"train.val_data_url={val_url}",
                                                            f"train.out_dir={tmp_path / 'run'}", "train.max_steps=2"])
    with caplog.at_level(logging.WARNING, logger="shardtrain"):
        train(cfg, World())
    warned = [r.getMessage() for r in caplog.records if "not in the training vocabulary" in r.getMessage()]
    assert len(warned) == 1 and "'dev'" in warned[0]  # once, at start, naming the set
    for c in "üßö":
        assert repr(c) in warned[0]
    vocab = json.loads((tmp_path / "run" / "vocab.json").read_text())
    assert set(vocab["chars"]) == set("hello world how are you café au lait")  # lower case, no punctuation
    assert TextNormConfig.from_json(vocab["normalizer"]) == SPEECH
    tm = load_trained(tmp_path / "run")
    assert tm.tokenizer.normalizer == SPEECH and tm.config.text == SPEECH
