"""The optional SentencePiece tokenizer (extra `[sentencepiece]`): a real model trained on a few lines round-trips
through encode/decode and a checkpoint's JSON, 0 stays the blank. Without the package (hidden from the import
system in the second test), the error names the extra."""
from __future__ import annotations

import importlib.util

import pytest

from shardtrain.train.text import BLANK, SentencePieceVocab, tokenizer_from_json

HAVE_SPM = importlib.util.find_spec("sentencepiece") is not None


@pytest.mark.skipif(not HAVE_SPM, reason="sentencepiece not installed: pip install 'shardtrain[sentencepiece]' "
                                         "(the [test] extra includes it; re-run setup)")
def test_sentencepiece_vocab_round_trips_and_keeps_blank_zero(tmp_path):
    import sentencepiece as spm

    lines = ["the cat sat on the mat", "a dog ran in the park", "one two three four five six seven"] * 20
    (tmp_path / "text.txt").write_text("\n".join(lines) + "\n")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "spm"),
                                   vocab_size=30, character_coverage=1.0, minloglevel=2)
    tok = SentencePieceVocab(str(tmp_path / "spm.model"))
    ids = tok.encode("the cat  sat on the mat")  # normalised first (whitespace collapsed)
    assert ids and BLANK not in ids and max(ids) < len(tok)
    assert tok.decode(ids) == "the cat sat on the mat"
    again = tokenizer_from_json(tok.to_json())
    assert again.encode("a dog ran") == tok.encode("a dog ran") and len(again) == len(tok)
    # the .model file retrained in place with the same piece count: a checkpoint's JSON keeps its own pieces
    saved = tok.to_json()
    other = ["zebra quartz jukebox wolf vex mighty lynx", "brown fox jumps high over lazy dogs"] * 40
    (tmp_path / "text.txt").write_text("\n".join(other) + "\n")
    spm.SentencePieceTrainer.train(input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "spm"),
                                   vocab_size=30, character_coverage=1.0, minloglevel=2)
    retrained = SentencePieceVocab(str(tmp_path / "spm.model"))
    assert len(retrained) == len(tok) and retrained.encode("the cat") != tok.encode("the cat")
    from shardtrain.infer.onnx_runtime import tokenizer_decoder

    assert tokenizer_from_json(saved).encode("the cat sat") == ids[:len(tok.encode("the cat sat"))]
    assert tokenizer_decoder(saved).decode(ids) == "the cat sat on the mat"


def test_missing_sentencepiece_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "sentencepiece", None)  # a machine without the package
    with pytest.raises(RuntimeError, match=r"shardtrain\[sentencepiece\]"):
        SentencePieceVocab(str(tmp_path / "spm.model"))
