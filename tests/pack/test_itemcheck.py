"""pack/itemcheck.py: the per-item limits, hand-checked at their edges (the rejects they produce in a real pack:
tests/pack/test_levels.py)."""
from __future__ import annotations

from shardtrain.format.audio import AudioInfo
from shardtrain.pack.config import PackConfig
from shardtrain.pack.item import Item
from shardtrain.pack.itemcheck import TARGET_SLACK_CHARS, ItemError, item_problem, stored_problem, target_problem


def test_target_problem_edges():
    # 2 s at 50 chars/s + 20 slack = 120 characters allowed
    assert target_problem("x" * 120, 2.0, 50) is None
    reason, detail = target_problem("x" * 121, 2.0, 50)
    assert reason == "impossible_target" and detail.startswith("121 characters in 2.00 s (60 a second)")
    assert "--max-chars-per-s 0 turns the check off" in detail
    assert target_problem("x" * 10_000, 0.1, 0) is None and target_problem("x" * 10_000, 0.1, None) is None
    assert target_problem("x" * TARGET_SLACK_CHARS, 0.0, 50) is None


def test_item_problem_uses_the_config_bound_and_the_format_limits(tmp_path):
    cfg = PackConfig(input="i", output="o", max_chars_per_s=10)
    assert item_problem(cfg, Item("a", "/a.flac", "x" * 30), 1.0) is None
    assert item_problem(cfg, Item("a", "/a.flac", "x" * 31), 1.0)[0] == "impossible_target"
    assert item_problem(cfg, Item("a", "/a.flac", "ok", speaker="s" * (1 << 20)), 1.0)[0] == "field_too_long"
    assert item_problem(cfg, Item("a", "/a.flac", "ok"), 1e9)[0] == "too_long"  # a format limit, not the config


def test_stored_problem_checks_the_encoded_sample():
    item = Item("a", "/a.flac", "hello")
    good = AudioInfo(duration_s=1.0, sample_rate_hz=16000, num_samples=16000, channels=1, codec="flac")
    assert stored_problem(item, good, audio_bytes=30_000, json_bytes=200) is None
    too_big = stored_problem(item, good, audio_bytes=1 << 40, json_bytes=200)
    assert too_big is not None and too_big[0] == "audio_too_large"
    assert stored_problem(item, AudioInfo(duration_s=1.0, sample_rate_hz=16000, num_samples=16000, channels=1000,
                                          codec="flac"), 100, 100)[0] == "unsupported_channels"
    e = ItemError(*too_big)
    assert e.reason == too_big[0] and str(e) == f"{too_big[0]}: {too_big[1]}"
