"""format/limits.py: the one set of limits the writer (pack's per-item check) and every reader share."""
from __future__ import annotations

from shardtrain.format import indexread, limits, validate

RATE = 16000


def test_one_set_of_limits_for_writer_and_readers():
    assert indexread.MAX_STRING_BYTES is limits.MAX_STRING_BYTES
    assert (validate.MAX_AUDIO_BYTES, validate.MAX_JSON_BYTES, validate.MAX_DURATION_S) == \
        (limits.MAX_AUDIO_BYTES, limits.MAX_JSON_BYTES, limits.MAX_DURATION_S)
    ok = {"text": "hello", "speaker": "s1", "language": "en", "source": "/a.flac"}
    assert limits.row_problem(ok, 1.0, RATE, 1, 1000, 200) is None
    cap = limits.MAX_STRING_BYTES["text"]
    assert limits.row_problem({**ok, "text": "é" * (cap // 2)}, 1.0, RATE, 1) is None  # exactly at the cap
    assert limits.row_problem({**ok, "text": "é" * (cap // 2 + 1)}, 1.0, RATE, 1)[0] == "text_too_long"
    assert limits.row_problem({**ok, "speaker": "s" * 1025}, 1.0, RATE, 1)[0] == "field_too_long"
    assert limits.row_problem(ok, 1.0, RATE, 1, audio_bytes=limits.MAX_AUDIO_BYTES + 1)[0] == "audio_too_large"
    assert limits.row_problem(ok, 1.0, RATE, 1, json_bytes=limits.MAX_JSON_BYTES + 1)[0] == "field_too_long"
    assert limits.row_problem(ok, 1.0, limits.MAX_SAMPLE_RATE_HZ + 1, 1)[0] == "unsupported_rate"
    assert limits.row_problem(ok, limits.MAX_DURATION_S + 1, RATE, 1)[0] == "too_long"
