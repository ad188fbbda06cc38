"""pack/keys.py: sample keys from source ids: sanitised, bounded, collision-free and independent of input order
(the keys of a real pack: tests/pack/test_packer.py)."""
from __future__ import annotations

import random
import re

from shardtrain.pack.keys import assign_keys, sanitize_key

KEY = re.compile(r"[A-Za-z0-9_-]{1,80}")


def test_sanitize_key():
    assert sanitize_key("spk1/ch2/utt-003") == "spk1_ch2_utt-003"
    assert sanitize_key("día 1.wav") == "d_a_1_wav"
    assert re.fullmatch(r"id-[0-9a-f]{8}", sanitize_key(""))
    long_a, long_b = "a" * 100, "a" * 99 + "b"
    ka, kb = sanitize_key(long_a), sanitize_key(long_b)
    assert len(ka) == 80 and ka[:71] == "a" * 71 and ka != kb and KEY.fullmatch(ka)


def test_assign_keys_collision_free_and_order_independent():
    ids = ["a/b", "a_b", "a.b", "x", "a" * 100, "a" * 101, "é", "_"]
    keys = assign_keys(ids)
    assert set(keys) == set(ids) and len(set(keys.values())) == len(ids)
    assert all(KEY.fullmatch(k) for k in keys.values())
    assert keys["a_b"] == "a_b" and keys["x"] == "x"  # an id that already is its key keeps it
    assert keys["a/b"].startswith("a_b-") and keys["a.b"].startswith("a_b-")
    shuffled = ids[:]
    random.Random(1).shuffle(shuffled)
    assert assign_keys(shuffled) == keys
