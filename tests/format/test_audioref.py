"""format/audioref.py: the one `#bytes=START-END` parser and bound that pack and infer share."""
from __future__ import annotations

import os

import pytest

from shardtrain.format.audio import AudioError
from shardtrain.format.audioref import MAX_RANGE_BYTES, byte_range_ref, parse_byte_range, read_byte_range


def test_round_trip_and_plain_paths():
    assert parse_byte_range(byte_range_ref("s3://b/x.arrow", 10, 20)) == ("s3://b/x.arrow", 10, 20)
    assert parse_byte_range("/data/a.wav") is None and read_byte_range("/data/a.wav") is None


@pytest.mark.parametrize("ref,reason", [("f#bytes=5-5", "empty_audio"), ("f#bytes=9-3", "empty_audio"),
                                        (f"f#bytes=0-{MAX_RANGE_BYTES + 1}", "range_too_large")])
def test_bad_ranges_are_refused_before_any_read(ref, reason):
    with pytest.raises(AudioError) as e:
        read_byte_range(ref)  # "f" does not exist: the range is refused first
    assert e.value.reason == reason


def test_reads_exactly_the_range_and_names_what_is_wrong(tmp_path):
    f = tmp_path / "blob.bin"
    f.write_bytes(bytes(range(100)))
    assert read_byte_range(byte_range_ref(str(f), 10, 14)) == bytes([10, 11, 12, 13])
    assert read_byte_range(byte_range_ref(f"file://{f}", 98, 100)) == bytes([98, 99])
    for ref, reason in [(byte_range_ref(str(f), 90, 120), "truncated_audio"),
                        (byte_range_ref(str(tmp_path / "gone"), 0, 4), "missing_file")]:
        with pytest.raises(AudioError) as e:
            read_byte_range(ref)
        assert e.value.reason == reason and str(tmp_path) in str(e.value)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(AudioError) as e:  # never opened: opening a FIFO would block
        read_byte_range(byte_range_ref(str(fifo), 0, 4))
    assert e.value.reason == "not_regular_file"
