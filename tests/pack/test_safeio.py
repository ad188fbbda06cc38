"""pack/safeio.py: bounded reads of untrusted input files on real files, a real FIFO (which must not block) and a
character device (the pack-level behaviour: tests/pack/test_pack_trust.py)."""
from __future__ import annotations

import os

import pytest

from shardtrain import storage
from shardtrain.pack.safeio import InputFileError, check_regular, read_bounded, read_local_bounded


def test_regular_files_within_and_over_the_limit(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"x" * 10)
    assert read_local_bounded(str(f), 10) == b"x" * 10 and check_regular(str(f), 10) == 10
    with pytest.raises(InputFileError) as e:
        read_local_bounded(str(f), 9)
    assert e.value.code == "too_large" and e.value.reason.startswith(f"too_large: {f}")
    with pytest.raises(InputFileError, match="10 bytes, more than the 9 allowed"):
        check_regular(str(f), 9)
    with pytest.raises(FileNotFoundError):
        check_regular(str(tmp_path / "none"))


def test_fifo_folder_and_device_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    with pytest.raises(InputFileError, match="is a FIFO, not a regular file") as e:
        read_local_bounded(str(fifo), 100)  # O_NONBLOCK: no writer needed to get here
    assert e.value.code == "not_regular_file"
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    with pytest.raises(InputFileError, match="is a character device"):
        check_regular(str(tmp_path / "zero.txt"))
    with pytest.raises(InputFileError, match="is a folder"):
        check_regular(str(tmp_path))


def test_read_bounded_through_a_filesystem(tmp_path):
    f = tmp_path / "chapter.trans.txt"
    f.write_text("1-2-3 HELLO\n")
    fs, _ = storage.fs_and_path(str(tmp_path), None)
    assert read_bounded(fs, str(f), 100) == b"1-2-3 HELLO\n"
    with pytest.raises(InputFileError, match="too_large"):
        read_bounded(fs, str(f), 5)
