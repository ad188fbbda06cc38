"""Reading untrusted input files with bounds: only regular files, at most `limit` bytes, never blocking.

    read_bounded(fs, path, limit, what) -> bytes            transcripts, LibriSpeech chapters, Kaldi tables
    check_regular(path) -> size in bytes                      local audio before soundfile opens it

A corpus is input the packer does not control. A transcript that is a FIFO blocks `open()` until a writer appears
(forever, in practice); `/dev/zero` or `/dev/urandom` behind a symlink never ends; a file being appended to grows
while it is read. So local files are opened with O_NONBLOCK (a FIFO opens at once instead of waiting for a
writer), checked with fstat to be regular files, and read for at most `limit + 1` bytes: one more than allowed
tells "too large" from "exactly at the limit" without trusting the size fstat reported. Remote files (fsspec)
are checked with one `info` call (type and size) and read with one ranged read of at most `limit + 1` bytes.
Costs: one extra fstat per local file (~1 µs), nothing extra remotely beyond the `info` request.

Failures raise `InputFileError` whose `reason` is a reject code ("not_regular_file", "too_large"), so a caller
turns it into a per-item reject with the path and the reason, never a hang or a crash of the whole pack.
"""
from __future__ import annotations

import os
import stat

from shardtrain import storage

MAX_TRANSCRIPT_BYTES = 1 << 20
"""A transcript file (`x.txt`, `x.lab`) larger than 1 MiB is rejected ("too_large"): a real one is a few hundred
bytes; a larger one is a mistake (a misnamed file) or hostile."""
MAX_CHAPTER_BYTES = 64 << 20
"""A LibriSpeech `.trans.txt` (one chapter, ~100 lines) larger than 64 MiB is rejected."""
MAX_TABLE_BYTES = 4 << 30
"""A Kaldi table (text, wav.scp, segments, ...) is read whole; above 4 GiB the input is refused."""
MAX_AUDIO_BYTES = 1 << 30
"""Audio read whole into memory (kept byte for byte, or an MP3 walked frame by frame) larger than 1 GiB is
rejected ("too_large"): it would not fit a shard of the default 256 MiB anyway, and several workers holding such
files at once could exhaust memory. Segments of long recordings are decoded by seeking, never read whole."""


class InputFileError(OSError):
    """An input file that is not a regular file, or larger than the bound; `reason` is the reject code."""

    def __init__(self, reason: str, path: str, detail: str) -> None:
        super().__init__(f"{reason}: {path} {detail}")
        self.reason = f"{reason}: {path} {detail}"
        self.code, self.detail = reason, detail


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular(path: str, limit: int | None = None) -> int:
    """Size of local `path` after checking (without opening it) that it is a regular file (symlinks followed)
    of at most `limit` bytes. FileNotFoundError when absent."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise InputFileError("not_regular_file", path, f"is {_kind(st.st_mode)}, not a regular file")
    if limit is not None and st.st_size > limit:
        raise InputFileError("too_large", path, f"{st.st_size} bytes, more than the {limit} allowed")
    return st.st_size


def read_local_bounded(path: str, limit: int) -> bytes:
    """All bytes of local regular file `path`, at most `limit` of them (see the module docstring)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputFileError("not_regular_file", path, f"is {_kind(st.st_mode)}, not a regular file")
        chunks, got = [], 0
        while got <= limit:
            b = os.read(fd, min(limit + 1 - got, 1 << 20))
            if not b:
                break
            chunks.append(b)
            got += len(b)
    finally:
        os.close(fd)
    if got > limit:
        raise InputFileError("too_large", path, f"more than the {limit} bytes allowed")
    return b"".join(chunks)


def read_bounded(fs: storage.FileSystem, path: str, limit: int) -> bytes:
    """All bytes of `path` on `fs`, refusing anything but a regular file of at most `limit` bytes."""
    if storage.fs_is_local(fs):
        return read_local_bounded(path, limit)
    info = fs.info(path)
    if info.get("type") not in ("file", None):
        raise InputFileError("not_regular_file", path, f"is a {info.get('type')}, not a file")
    size = info.get("size")
    if size is not None and size > limit:
        raise InputFileError("too_large", path, f"{size} bytes, more than the {limit} allowed")
    data = fs.cat_file(path, start=0, end=limit + 1)
    if len(data) > limit:
        raise InputFileError("too_large", path, f"more than the {limit} bytes allowed")
    return data
