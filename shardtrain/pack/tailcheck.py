"""Does the content of an audio file reach the length its header claims? Cheaply, without decoding it all.

    check_tail(data, info, where)    -> None, or AudioError("truncated_audio")   (what --no-decode-check still does)
    check_decoded(data, info, where) -> the same by a full decode (the decode check)
    seek_tail(f, end, where)         -> the same on an open SoundFile, by a seek and a short read

A header is a claim: FLAC's STREAMINFO carries the total sample count, and a file cut short (an interrupted copy)
or crafted keeps claiming it. Stored as is, the index promises samples the loader cannot decode, and `inspect
--verify` refuses the dataset. Decoding everything (the default decode check) costs ~1 ms per 3 s of 16 kHz FLAC.

The tail check decodes only the end. For FLAC (the format a pack keeps byte for byte by default) it is done on
the bytes: find the last frame header (sync code, a valid CRC-8), check that its first sample + block size equals
the claimed total, and decode that one frame (the metadata blocks, with STREAMINFO now claiming that frame's
samples, + the frame, through format.audio.decoded_frames; a cut or damaged frame fails to decode): ~0.03 ms.
Anything that does not pass this fast path (another codec, a false sync inside audio data, an odd layout) falls back to `seek_tail`, which is exact but costs ~0.2 ms for FLAC (libFLAC
seeks by bisection, reading a frame per step through Python callbacks). So the fast path only ever accepts; every
rejection is the exact check's.
"""
from __future__ import annotations

import io

import soundfile as sf

from shardtrain.format.audio import SF_ERRORS, AudioError, AudioInfo, decoded_frames

TAIL_FRAMES = 1024
"""Samples seek_tail decodes at the end of what a header promises."""
_SEARCH_BYTES = 1 << 17
"""How far from the end the last FLAC frame header is looked for (a frame of 4096 16-bit stereo samples is at
most ~16 KB; a larger frame falls back to seek_tail)."""
_BLOCK_SIZES = {1: 192, 2: 576, 3: 1152, 4: 2304, 5: 4608, 8: 256, 9: 512, 10: 1024, 11: 2048, 12: 4096, 13: 8192,
                14: 16384, 15: 32768}


def _crc8_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = ((c << 1) ^ 0x07) & 0xFF if c & 0x80 else (c << 1) & 0xFF
        table.append(c)
    return table


_CRC8 = _crc8_table()


def _crc8(b: bytes) -> int:
    c = 0
    for x in b:
        c = _CRC8[c ^ x]
    return c


def _metadata_end(data: bytes) -> int | None:
    """Offset of the first audio frame of a FLAC stream (after its metadata blocks), or None."""
    if data[:4] != b"fLaC" or len(data) < 42 or data[4] & 0x7F:  # STREAMINFO must come first
        return None
    pos = 4
    while pos + 4 <= len(data):
        last, length = data[pos] & 0x80, int.from_bytes(data[pos + 1: pos + 4], "big")
        pos += 4 + length
        if last:
            return pos if pos <= len(data) else None
    return None


def _frame_header(data: bytes, i: int, fixed_block: int) -> tuple[int, int] | None:
    """(first sample, block size) of a FLAC frame header at `i` whose CRC-8 is valid, else None."""
    n = len(data)
    if i + 6 > n:
        return None
    variable = data[i + 1] & 1
    b2, b3 = data[i + 2], data[i + 3]
    bs_code, rate_code = b2 >> 4, b2 & 15
    if bs_code == 0 or rate_code == 15 or b3 & 1 or (b3 >> 4) >= 11 or (b3 >> 1) & 7 == 3:
        return None
    j, x = i + 4, data[i + 4]
    if x < 0x80:
        num, extra = x, 0
    elif 0xC0 <= x <= 0xFE:
        extra = next(k for k, top in enumerate((0xE0, 0xF0, 0xF8, 0xFC, 0xFE, 0xFF), 1) if x < top)
        num = x & (0x3F >> extra)
        if j + extra >= n:
            return None
        for y in data[j + 1: j + 1 + extra]:
            if y & 0xC0 != 0x80:
                return None
            num = (num << 6) | (y & 0x3F)
    else:
        return None
    j += 1 + extra
    if bs_code == 6:
        bs, j = data[j] + 1 if j < n else 0, j + 1
    elif bs_code == 7:
        bs, j = int.from_bytes(data[j: j + 2], "big") + 1, j + 2
    else:
        bs = _BLOCK_SIZES[bs_code]
    j += 1 if rate_code == 12 else 2 if rate_code in (13, 14) else 0
    if j >= n or _crc8(data[i:j]) != data[j]:
        return None
    return (num if variable else num * fixed_block), bs


def _with_total(meta: bytes, total: int) -> bytes:
    """FLAC metadata with STREAMINFO's 36-bit total-sample count (bytes 18..25) replaced."""
    v = (int.from_bytes(meta[18:26], "big") & ~((1 << 36) - 1)) | total
    return meta[:18] + v.to_bytes(8, "big") + meta[26:]


def _flac_tail_ok(data: bytes, total: int) -> bool:
    """True when the last frame of FLAC `data` ends at sample `total` and decodes whole (the fast path)."""
    start = _metadata_end(data)
    if start is None:
        return False
    fixed_block = int.from_bytes(data[8:10], "big")  # STREAMINFO min block size (= the block size when fixed)
    lo, i = max(start, len(data) - _SEARCH_BYTES), len(data) - 2
    while i >= lo:
        i = data.rfind(b"\xff", lo, i + 1)
        if i < 0:
            return False
        if data[i + 1] in (0xF8, 0xF9):
            hdr = _frame_header(data, i, fixed_block)
            if hdr is not None:
                first, bs = hdr
                if first + bs != total:
                    return False
                try:  # metadata claiming `bs` samples + the last frame: the decoder decodes just that frame
                    return decoded_frames(_with_total(data[:start], bs) + data[i:]) == bs
                except AudioError:
                    return False
        i -= 1
    return False


def seek_tail(f: sf.SoundFile, end: int, where: str) -> None:
    """Seek to `end - TAIL_FRAMES` in open file `f` and decode up to `end`: raises AudioError("truncated_audio")
    when the content ends before (the seek or the read fails or comes up short). Also what stops a transcode from
    allocating an array for samples that do not exist."""
    k = min(TAIL_FRAMES, end)
    try:
        pos = f.seek(end - k)
        got = len(f.read(k, dtype="int16", always_2d=True))
    except SF_ERRORS as e:
        raise AudioError("truncated_audio", f"{where}: header promises {end} samples, the content ends before "
                                            f"({e})") from e
    if pos != end - k or got != k:
        raise AudioError("truncated_audio", f"{where}: header promises {end} samples, decoding its last {k} "
                                            f"yields {got}")


def check_tail(data: bytes, info: AudioInfo, where: str) -> None:
    """The tail check on audio bytes in memory (module docstring): the FLAC fast path, else seek_tail."""
    if info.codec == "flac" and _flac_tail_ok(data, info.num_samples):
        return
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            if f.seekable():
                seek_tail(f, info.num_samples, where)
                return
    except SF_ERRORS as e:
        raise AudioError("unreadable_audio", f"{where}: {e}") from e
    check_decoded(data, info, where)  # a codec libsndfile cannot seek (GSM 6.10): decoded through


def check_decoded(data: bytes, info: AudioInfo, where: str) -> None:
    """Decode `data` fully (format.audio.decoded_frames: constant memory, no Python IO callbacks) and check it
    yields the promised sample count: AudioError("truncated_audio") when not (the decode check that
    `--no-decode-check` turns off)."""
    try:
        decoded = decoded_frames(data)
    except AudioError as e:
        raise AudioError(e.reason, f"{where}: {e.detail}") from e
    if decoded != info.num_samples:
        raise AudioError("truncated_audio", f"{where}: header promises {info.num_samples} samples, decode yields "
                                            f"{decoded}")
