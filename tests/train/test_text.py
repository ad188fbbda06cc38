"""train/text.py: the character vocabulary, greedy CTC decoding, and edit distances and error rates (hand-checked,
and equal to the pure-Python loop they replaced on random strings and word lists)."""
from __future__ import annotations

import random

import torch

from shardtrain.train.text import CharVocab, edit_distance, edit_ops, encode_batch, error_counts, greedy_decode
from shardtrain.train.text import tokenizer_from_json


def test_char_vocab_round_trip_and_unknown_chars():
    v = CharVocab.from_texts(["HELLO  WORLD", "HOW"])
    assert len(v) == 1 + len(set("HELOWRD "))
    assert v.decode(v.encode("HELLO WORLD")) == "HELLO WORLD"
    assert v.decode(v.encode("HEX")) == "HE" and v.unknown_chars == 1
    assert tokenizer_from_json(v.to_json()).chars == v.chars
    flat, lens = encode_batch(v, ["HOW", "", "LO"])
    assert lens.tolist() == [3, 0, 2] and flat.numel() == 5


def test_greedy_decode_collapses_repeats_and_blanks():
    path = torch.tensor([[1, 1, 0, 1, 2, 2, 0, 0, 3, 9]])  # last frame is beyond the length
    log_probs = torch.nn.functional.one_hot(path, 10).float().log_softmax(-1)
    assert greedy_decode(log_probs, torch.tensor([9])) == [[1, 1, 2, 3]]


def test_edit_distance_and_error_rates_hand_checked():
    assert edit_distance("kitten", "sitting") == 3
    c = error_counts(["THE CAT SAT", "A B"], ["THE BAT SAT", "A B C"])
    assert c == {"char_errors": 1 + 2, "chars": 11 + 3, "word_errors": 1 + 1, "words": 3 + 2}


def _old_edit_distance(ref, hyp) -> int:
    """The pure-Python loop train/text.py used before rapidfuzz: the reference the new one must equal."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


def test_edit_distance_equals_the_old_implementation_and_ops_add_up():
    rng = random.Random(0)
    for _ in range(300):
        a = "".join(rng.choice("ab c'") for _ in range(rng.randint(0, 40)))
        b = "".join(rng.choice("ab c'") for _ in range(rng.randint(0, 40)))
        d = edit_distance(a, b)
        assert d == _old_edit_distance(a, b)
        wa, wb = a.split(), b.split()
        assert edit_distance(wa, wb) == _old_edit_distance(wa, wb)
        ops = edit_ops(a, b)
        assert sum(ops.values()) == d and ops["ins"] - ops["del"] == len(b) - len(a)
    assert edit_ops("ABCD", "AXCDE") == {"sub": 1, "ins": 1, "del": 0}
    assert edit_ops("THE CAT SAT".split(), "THE SAT".split()) == {"sub": 0, "ins": 0, "del": 1}
