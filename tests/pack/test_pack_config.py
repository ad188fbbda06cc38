"""pack/config.py: PackConfig and AudioTarget refuse bad flags when built, naming the flag, and the options recorded
in the manifest are exactly those that shape the output (the workers, engine and progress do not)."""
from __future__ import annotations

import pytest

from shardtrain.pack.config import AudioTarget, PackConfig, channel_index


@pytest.mark.parametrize("kw, msg", [
    ({"codec": "aac"}, "--codec must be one of"), ({"sample_rate_hz": 0}, "--sample-rate must be > 0"),
    ({"codec": "opus", "sample_rate_hz": 44100}, "not allowed with opus"),
    ({"codec": "mp3", "sample_rate_hz": 96000}, "not allowed with mp3"),
    ({"codec": "opus", "channels": 3}, "--channels must be 1..2 for opus"), ({"channels": 9}, "must be 1..8 for flac"),
    ({"channel_policy": "left"}, "--channels-policy must be mix, first or a channel index"),
    ({"max_clipped_share": 1.5}, "max_clipped_share must be in"),
])
def test_audio_target_refuses(kw, msg):
    with pytest.raises(ValueError, match=msg):
        AudioTarget(**kw)


@pytest.mark.parametrize("kw, msg", [
    ({"target_shard_mb": 0}, "--target-shard-mb must be > 0"), ({"max_samples_per_shard": 0}, ">= 1"),
    ({"max_chars_per_s": -1}, "--max-chars-per-s must be >= 0"), ({"workers": 0}, "--workers must be >= 1"),
    ({"min_duration_s": 5, "max_duration_s": 1}, "--min-duration-s must be <= --max-duration-s"),
    ({"engine": "spark"}, "--engine must be one of"), ({"part_items": 0}, "part_items must be >= 1"),
])
def test_pack_config_refuses(kw, msg):
    with pytest.raises(ValueError, match=msg):
        PackConfig(input="i", output="o", **kw)


def test_channel_index_and_dataset_options():
    assert [channel_index(p) for p in ("mix", "first", "2")] == [None, 0, 2]
    base = PackConfig(input="i", output="o").dataset_options()
    assert base["codec"] == "flac" and base["sample_rate_hz"] == 16000 and "channels_policy" not in base
    same = PackConfig(input="other", output="o2", workers=4, engine="ray", progress=False, probe_threads=2)
    assert same.dataset_options() == base  # where and how fast it runs does not shape the output
    other = PackConfig(input="i", output="o", max_chars_per_s=20, audio=AudioTarget(channel_policy="first"))
    assert other.dataset_options() == {**base, "max_chars_per_s": 20, "channels_policy": "first"}
