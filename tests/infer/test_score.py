"""infer/score.py: the Markdown report of `shardtrain evaluate` keeps every cell a cell, whatever the transcripts
hold, and the edit counts behind CER/WER are hand-checked (evaluate on a trained model: tests/infer/test_infer.py)."""
from __future__ import annotations

from shardtrain.infer.score import _accumulate, _rate, _zero, escape_control, markdown_table, md_cell


def test_edit_counts_accumulate_per_character_and_word():
    chars, words = _zero(), _zero()
    c, w = _accumulate(chars, words, "the cat", "the bat s")
    assert (c["sub"], c["ins"], c["del"]) == (1, 2, 0) and (w["sub"], w["ins"], w["del"]) == (1, 1, 0)
    _accumulate(chars, words, "a b", "a b")
    assert chars["ref"] == 10 and words["ref"] == 4 and _rate(chars) == 0.3 and _rate(words) == 0.5


def test_cells_stay_cells():
    assert md_cell("a|b") == "a\\|b" and md_cell("back\\slash") == "back\\\\slash"
    assert escape_control("x\x1b[31my\nz\u202e") == "x\\x1b[31my\\nz\\u202e"
    res = {"s3://b/dev|x": {"utterances": 2, "cer": 0.25, "wer": 0.5, "failed": 1,
                            "chars": {"sub": 1, "ins": 0, "del": 1}, "words": {"sub": 1, "ins": 0, "del": 0},
                            "worst": [{"key": "k\n1", "cer": 0.5, "reference": "a | b", "hypothesis": "\x1b[2J"}]}}
    table = markdown_table(res)
    lines = table.splitlines()
    assert lines[2] == "| s3://b/dev\\|x | 2 | 25.00 | 1 | 0 | 1 | 50.00 | 1 | 0 | 0 | 25.00 | 50.00 | 1 |"
    assert lines[-1] == "| k\\n1 | 50.0 | a \\| b | \\x1b[2J |"
    assert all(line.count("|") - line.count("\\|") in (0, 5, 14) for line in lines)
