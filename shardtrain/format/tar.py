"""Shard format v1 on the byte level: a reproducible ustar writer and a checked header reader.

    write: [(key, ext, audio bytes, json bytes)] -> ShardWriter -> shard-NNNNNN.tar + [MemberOffsets]
    read:  512-byte header -> parse_header (checksum, regular file, name, size); iter_tar_members for verify

Byte-reproducible by construction: every header has mtime 0, uid/gid 0, empty uname/gname, mode 0o644, and the
plain ustar format (names are <= 80 + 5 chars, so no PAX or GNU long-name records are ever needed); the archive
ends with tarfile's standard two zero blocks padded to a 10240-byte record. The writer reports where each member's
header and data lie, which is what index.parquet stores so a reader can slice audio out of a byte range without
parsing tar. Nothing read from a shard is unpickled or evaluated.
"""
from __future__ import annotations

import hashlib
import io
import re
import tarfile
from dataclasses import dataclass
from typing import BinaryIO, Iterator

from shardtrain.format.codecs import CODECS

BLOCK = 512
KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,80}\Z")  # \Z: whole string (`$` accepts a trailing newline)


@dataclass(frozen=True, slots=True)
class MemberOffsets:
    """Where one sample lies inside its shard (all byte offsets from the start of the tar)."""

    offset: int
    """First byte of the audio member's header."""
    size: int
    """Bytes from `offset` to the end of the json member's padding (= next sample's offset)."""
    audio_offset: int
    audio_size: int
    json_offset: int
    json_size: int

    def __reduce__(self):  # see format/audio.py AudioInfo.__reduce__
        return (MemberOffsets, (self.offset, self.size, self.audio_offset, self.audio_size, self.json_offset,
                                self.json_size))


class _HashingWriter:
    """File-like wrapper that counts and (unless `hashed` is False) sha256-hashes what passes through."""

    def __init__(self, raw: BinaryIO, hashed: bool = True) -> None:
        self.raw = raw
        self.pos = 0
        self.sha = hashlib.sha256() if hashed else None

    def write(self, b) -> int:
        self.raw.write(b)
        if self.sha is not None:
            self.sha.update(b)
        self.pos += len(b)
        return len(b)

    def tell(self) -> int:
        return self.pos


_RECORD = 20 * BLOCK
"""tarfile's default record size: a closed archive is padded to a multiple of it."""
_NUL_BLOCK = bytes(BLOCK)


def _ustar_header(name: str, size: int) -> bytes:
    """The header tarfile writes for a regular file `name` (ASCII, <= 100 chars) of `size` bytes with mode 0o644,
    mtime 0, uid/gid 0 and empty uname/gname in USTAR format, byte for byte (tests compare it with tarfile's),
    built directly: a few us instead of tarfile's ~60 us (a TarInfo, its dict of fields, itn/stn per field),
    which was ~10% of a kept-FLAC pack's CPU time at two members a sample."""
    raw = name.encode("ascii")
    if len(raw) > 100 or size >= 8 ** 11:
        raise ValueError(f"tar member {name!r} ({size} B) does not fit a plain ustar header")
    h = bytearray(BLOCK)
    h[0:len(raw)] = raw
    h[100:156] = b"0000644\x000000000\x000000000\x00" + b"%011o\x00" % size + b"00000000000\x00" + b"        "
    h[156] = 0x30  # REGTYPE "0"
    h[257:265] = b"ustar\x0000"
    h[148:155] = b"%06o\x00" % sum(h)
    return bytes(h)


class ShardWriter:
    """Write samples (audio member, then json member) to a binary file object as reproducible ustar.

    Use as a context manager; `close()` writes the end-of-archive blocks. `sha256` and `bytes` are valid after
    close. The caller decides sample order (the packer sorts by (duration_s, key)).

    A shard can also be assembled from parts: writers with `hashed=False` that are never closed write whole
    members of consecutive samples (a pack worker's slice of a shard, to a file of its own), and the shard's
    writer takes each part's bytes with `append`. Offsets a part's writer reported are then relative to the part.
    """

    def __init__(self, fileobj: BinaryIO, hashed: bool = True) -> None:
        self._out = _HashingWriter(fileobj, hashed)
        self._keys: set[str] = set()
        self.closed = False

    def _member(self, name: str, data: bytes) -> int:
        """Header, data and zero padding to a whole block of one member; returns the header's offset."""
        at = self._out.pos
        self._out.write(_ustar_header(name, len(data)))
        self._out.write(data)
        pad = -len(data) % BLOCK
        if pad:
            self._out.write(_NUL_BLOCK[:pad])
        return at

    def add(self, key: str, ext: str, audio: bytes, meta_json: bytes) -> MemberOffsets:
        if not KEY_RE.fullmatch(key):
            raise ValueError(f"shard key {key!r} must match [A-Za-z0-9_-]{{1,80}}")
        if ext not in CODECS:
            raise ValueError(f"audio extension {ext!r} not in {CODECS}")
        if key in self._keys:
            raise ValueError(f"duplicate key {key!r} in one shard")
        self._keys.add(key)
        offset = self._member(f"{key}.{ext}", audio)
        json_header = self._member(f"{key}.json", meta_json)
        return MemberOffsets(
            offset=offset,
            size=self._out.pos - offset,
            audio_offset=offset + BLOCK,
            audio_size=len(audio),
            json_offset=json_header + BLOCK,
            json_size=len(meta_json),
        )

    def append(self, members) -> int:
        """Whole members another ShardWriter wrote (a part, see the class docstring) appended as they are, hashed
        and counted; returns the offset of the first. Keys are not checked again: each part's writer checked its
        own, and the caller's parts hold different samples (the packer's layout gives each sample its own key)."""
        if self.closed or len(members) % BLOCK:
            raise ValueError(f"cannot append {len(members)} bytes: not whole {BLOCK}-byte blocks, or archive closed")
        at = self._out.pos
        self._out.write(members)
        return at

    def close(self) -> None:
        """The end of the archive as tarfile writes it: two zero blocks, then zeros up to a whole record."""
        if not self.closed:
            self._out.write(_NUL_BLOCK * 2)
            rest = self._out.pos % _RECORD
            if rest:
                self._out.write(bytes(_RECORD - rest))
            self.closed = True

    @property
    def sha256(self) -> str:
        if self._out.sha is None:
            raise ValueError("this writer was made with hashed=False")
        return self._out.sha.hexdigest()

    @property
    def bytes(self) -> int:
        return self._out.pos

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_USTAR = b"ustar\x0000"
_OCTAL_FIELDS = ((100, 108), (108, 116), (116, 124), (124, 136), (136, 148), (329, 337), (337, 345))
"""mode, uid, gid, size, mtime, devmajor, devminor: the numeric fields tarfile parses (refusing malformed ones)."""


def _fast_header(block: bytes) -> tuple[str, int] | None:
    """(name, size) of a plain POSIX ustar regular-file header with a valid unsigned checksum and no name prefix,
    the only kind the writer makes; None for anything else, which parse_header then hands to tarfile. Accepts
    nothing tarfile would refuse and gives the same name and size; ~2 us instead of ~17 us (a row has two)."""
    if block[257:265] != _USTAR or block[156:157] != b"0" or any(block[157:257]) or any(block[345:500]):
        return None
    try:
        nums = [int(block[a:b].split(b"\0", 1)[0].strip() or b"0", 8) for a, b in _OCTAL_FIELDS]
        chk = int(block[148:156].split(b"\0", 1)[0].strip() or b"0", 8)
        name = block[:100].split(b"\0", 1)[0].decode("utf-8")
        for a, b in ((265, 297), (297, 329)):  # uname, gname: tarfile decodes them too
            block[a:b].split(b"\0", 1)[0].decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    if block[124] in (0o200, 0o377) or chk != sum(block) - sum(block[148:156]) + 256:
        return None
    return name, nums[3]


def parse_header(block: bytes) -> tuple[str, int]:
    """(name, size) of one 512-byte header of a regular member; raises ValueError when it is not one: short or
    empty block, checksum mismatch (tarfile verifies it), undecodable name, or a link/directory/special type."""
    if len(block) == BLOCK:
        fast = _fast_header(block)
        if fast is not None:
            return fast
    if len(block) != BLOCK:
        raise ValueError(f"header block has {len(block)} bytes, not {BLOCK}")
    try:
        ti = tarfile.TarInfo.frombuf(block, "utf-8", "strict")
    except (tarfile.HeaderError, UnicodeDecodeError) as e:
        raise ValueError(f"invalid ustar header ({type(e).__name__}: {str(e)[:80]!r})") from None
    if not ti.isreg():
        raise ValueError(f"member type {ti.type!r} is not a regular file")
    return ti.name, ti.size


def iter_tar_members(fileobj: BinaryIO) -> Iterator[tuple[str, int, bytes]]:
    """(name, data_offset, data) for each regular member, in file order. Raises tarfile.TarError on damage."""
    with tarfile.open(fileobj=fileobj, mode="r|") as tf:
        for ti in tf:
            if not ti.isreg():
                continue
            f = tf.extractfile(ti)
            data = f.read() if f is not None else b""
            if len(data) != ti.size:
                raise tarfile.ReadError(f"member {ti.name} truncated: {len(data)} of {ti.size} bytes")
            yield ti.name, ti.offset_data, data
