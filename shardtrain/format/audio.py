"""Decoding stored audio: what the bytes of a shard's audio member mean, for the loader, verify and noise banks.

    decode(bytes) -> (samples [n] or [n, ch], sample_rate_hz)                                   verify, noise
    decode_into(bytes, out) -> samples written into a preallocated row (mono float32/int16)      loader hot path

soundfile (bundled libsndfile 1.2) reads WAV, FLAC, Ogg/Opus and MP3 with no system library. On the hot paths
(decode_into, decoded_frames) FLAC goes through dr_flac instead (miniaudio's wheel, see _DrFlac): ~1.8x less CPU,
the same samples bit for bit, and a CRC-checked frame whose bytes were damaged is left out, so damage shows as a
short read that libsndfile let through as audio in 55 of 300 single-byte flips. Both run without the GIL, which is
what lets the loader decode in threads of one process. Probing and transcoding input audio belong to `pack`
(probe.py, transcode.py).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile as sf


log = logging.getLogger(__name__)



class AudioError(Exception):
    """Audio that cannot be packed. `reason` is a snake_case code: missing_file, empty_audio, unreadable_audio,
    truncated_audio, segment_out_of_range, unsupported_channels, unreliable_mp3_length, non_finite_audio."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True, slots=True)
class AudioInfo:
    """What the index needs about one audio stream; codec is one of flac|wav|opus|mp3|other."""

    duration_s: float
    sample_rate_hz: int
    num_samples: int
    channels: int
    codec: str


def codec_of(fmt: str, subtype: str) -> str:
    if fmt == "FLAC":
        return "flac"
    if fmt in ("WAV", "WAVEX"):
        return "wav"
    if fmt == "OGG" and subtype == "OPUS":
        return "opus"
    return "mp3" if fmt == "MP3" else "other"


SF_ERRORS = (sf.SoundFileError, RuntimeError, ValueError, TypeError, EOFError)

FLOAT_SUBTYPES = frozenset({"FLOAT", "DOUBLE"})
"""Sample formats that hold floats, so may hold NaN/Inf or peaks past 1.0. libsndfile reads them as integers by
rounding without scaling unless told otherwise (every sample of a [-1, 1] signal becomes -1, 0 or +1: ~92 dB
quieter), so they are always read as float32 here and converted by `float_to_int16`."""
_SF_SUBMASK, _SF_FLOAT, _SF_DOUBLE = 0x0000FFFF, 0x0006, 0x0007


def float_to_int16(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float samples at full scale 1.0 -> int16 at full scale 32768, the same scale libsndfile and dr_flac use for
    16-bit audio (so a float source and its 16-bit copy reach the batch at the same level); peaks past 1.0 clip."""
    y = np.clip(np.round(np.asarray(x, np.float32) * np.float32(32768.0)), -32768, 32767)
    if out is None:
        return y.astype(np.int16)
    out[:len(y)] = y
    return out


def check_finite(x: np.ndarray, where: str) -> None:
    """AudioError("non_finite_audio") when a float decode holds NaN or +-Inf: one such sample makes the loss NaN
    and, stepped on, every weight. ~0.1 ms per 10 s of 16 kHz audio; integer formats never need it."""
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        bad = int(np.count_nonzero(~np.isfinite(x)))
        raise AudioError("non_finite_audio", f"{where}: {bad} of {x.size} samples are NaN or infinite")


def decode(data: bytes, dtype: str = "float32") -> tuple[np.ndarray, int]:
    """Decode one stored audio member: (samples [n] for mono or [n, ch], sample_rate_hz). Raises AudioError."""
    if not data:
        raise AudioError("empty_audio", "0 bytes")
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            floats = f.subtype in FLOAT_SUBTYPES
            x = f.read(dtype="float32" if floats else dtype, always_2d=False)
            rate = f.samplerate
    except SF_ERRORS as e:
        raise AudioError("unreadable_audio", str(e)) from e
    if floats:
        check_finite(x, "float audio")
        x = x.astype(dtype, copy=False) if np.dtype(dtype).kind == "f" else float_to_int16(x)
    return x, int(rate)


# ---- loader hot path ----------------------------------------------------------------------------------------
class _DrFlac:
    """dr_flac (from miniaudio's wheel, a cffi module whose calls release the GIL) reading FLAC straight from
    memory into the caller's array.

    Why: libsndfile converts libFLAC's int32 output sample by sample (`flac_buffer_copy`: 34% of the loader's
    CPU, more than the decoding itself) and reads through a file descriptor (a memfd copy and ~50 us of open
    per member); dr_flac converts in blocks and reads the bytes where they are. Measured here on the 4k espeak
    corpus's members: 0.58-0.64 against 1.02-1.24 CPU-s (float32), 0.66-0.75 against 0.93-1.30 (int16), output
    identical bit for bit (16-bit FLAC scales by 2^-15 in both). Unlike libFLAC through libsndfile, a frame
    that fails its CRC is dropped, not output: damage reads short, which callers already treat as bad audio.
    A stream dr_flac cannot open (not FLAC, an odd layout) goes to libsndfile.
    """

    def __init__(self) -> None:
        from _miniaudio import ffi, lib  # the cffi module of the `miniaudio` wheel; its Python layer is not needed

        self.ffi, self.lib = ffi, lib
        self.open_memory, self.close = lib.ma_dr_flac_open_memory, lib.ma_dr_flac_close
        self.read = {"f": (lib.ma_dr_flac_read_pcm_frames_f32, "float *"),
                     "h": (lib.ma_dr_flac_read_pcm_frames_s16, "ma_dr_flac_int16 *")}

    @contextlib.contextmanager
    def _opened(self, data) -> Iterator[Any]:
        """A dr_flac decoder over `data` (closed on exit), or None when dr_flac cannot open the stream."""
        src = self.ffi.from_buffer(data)  # alive until close: dr_flac reads from it
        handle = self.open_memory(src, len(data), self.ffi.NULL)
        if handle == self.ffi.NULL:
            yield None
            return
        try:
            yield handle
        finally:
            self.close(handle)

    def decode_into(self, data, out: np.ndarray) -> int | None:
        """Samples written into `out`; -channels for a multi-channel stream (the caller downmixes); None when
        dr_flac cannot open the stream."""
        with self._opened(data) as handle:
            if handle is None:
                return None
            if handle.channels != 1:
                return -int(handle.channels)
            read, ctype = self.read[out.dtype.char]
            return int(read(handle, len(out), self.ffi.cast(ctype, self.ffi.from_buffer(out))))

    def decoded_frames(self, data) -> int | None:
        """Frames a full decode yields (16k frames at a time into one scratch buffer); None when dr_flac cannot
        open the stream."""
        with self._opened(data) as handle:
            if handle is None:
                return None
            block = 1 << 14
            scratch = self.ffi.new("ma_dr_flac_int16[]", block * max(1, int(handle.channels)))
            read, total = self.read["h"][0], 0
            while True:
                got = int(read(handle, block, scratch))
                total += got
                if got < block:
                    return total


def _dr_flac() -> _DrFlac | None:
    try:
        return _DrFlac()
    except (ImportError, AttributeError) as e:  # no miniaudio wheel for this platform, or one without these calls
        log.info("dr_flac unavailable (%s): FLAC decodes through libsndfile", e)
        return None


DR_FLAC = _dr_flac()
"""The FLAC fast path, or None (then libsndfile decodes FLAC too)."""


def _is_flac(data) -> bool:
    return len(data) >= 4 and bytes(data[:4]) == b"fLaC"



class _MemfdDecoder:
    """libsndfile on an in-memory file descriptor, called through soundfile's cffi handle on its bundled library.

    Why: `sf.SoundFile(io.BytesIO(...))` makes libsndfile read through Python callbacks, and every callback
    takes the GIL, so two decode threads in one process topped out at ~85% of two processes (measured here:
    9,400-9,900 against 11,700 audio-s/s). Copying the member into a memfd (one pwrite, ~10 us per 100 kB) lets
    libsndfile read with plain syscalls, and cffi calls release the GIL, so the whole decode runs without it.
    The memfd is per thread and per process (a forked DataLoader worker must not share its parent's). Costs one
    file descriptor per decode thread. `SoundFile(fd)` itself is not used: its Python costs ~75 us a member under
    the GIL (see `_snd`).
    """

    def __init__(self) -> None:
        self.fd = os.memfd_create("shardtrain-decode", os.MFD_CLOEXEC)
        self.pid = os.getpid()

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass

    def _open(self, data):
        """(handle, SF_INFO) of `data` copied into the memfd; the caller closes the handle."""
        n = len(data)
        os.ftruncate(self.fd, n)
        if os.pwrite(self.fd, data, 0) != n:
            raise AudioError("unreadable_audio", "short write to the decode buffer")
        os.lseek(self.fd, 0, os.SEEK_SET)
        info = _ffi.new("SF_INFO*")
        handle = _snd.sf_open_fd(self.fd, _SFM_READ, info, 0)
        if handle == _ffi.NULL:
            raise AudioError("unreadable_audio", f"LibsndfileError: {_sf_message(_snd.sf_error(_ffi.NULL))}")
        return handle, info

    def decoded_frames(self, data) -> int:
        """Frames a full decode of `data` yields, decoded in blocks into one scratch buffer (constant memory)."""
        handle, info = self._open(data)
        try:
            block = 1 << 14
            scratch = _ffi.new("short[]", block * max(1, int(info.channels)))
            total = 0
            while True:
                got = _snd.sf_readf_short(handle, scratch, block)
                if got <= 0:
                    break
                total += int(got)
            err = _snd.sf_error(handle)
            if err:
                raise AudioError("truncated_audio" if total else "unreadable_audio",
                                 f"LibsndfileError: {_sf_message(err)}")
            return total
        finally:
            _snd.sf_close(handle)

    def decode_into(self, data, out: np.ndarray) -> int:
        handle, info = self._open(data)
        try:
            if info.channels != 1:
                return -int(info.channels)  # caller falls back to the downmixing path
            is_float = (info.format & _SF_SUBMASK) in (_SF_FLOAT, _SF_DOUBLE)
            dest = out if out.dtype == np.float32 or not is_float else np.zeros(len(out), np.float32)
            read = _snd.sf_readf_float if dest.dtype == np.float32 else _snd.sf_readf_short
            got = read(handle, _ffi.from_buffer(_C_TYPES[dest.dtype.char], dest), len(dest))
            if got < len(out):  # only a short read can carry an error (one C call less per member otherwise)
                err = _snd.sf_error(handle)
                if err:
                    raise AudioError("unreadable_audio", f"LibsndfileError: {_sf_message(err)}")
            if is_float:  # the only members that can hold NaN; integer formats skip the scan
                check_finite(dest[:got], "float audio")
                if dest is not out:
                    float_to_int16(dest[:got], out)
            return int(got)
        finally:
            _snd.sf_close(handle)


_snd, _ffi = sf._snd, sf._ffi  # noqa: SLF001 - soundfile's own cffi handle on its bundled libsndfile
"""libsndfile's C calls straight from soundfile's cffi handle: SoundFile's Python wrapper costs ~75 us a member
(~115 against ~40 us for a 10 ms file, measured here), all of it under the GIL that the decode threads share."""
_SFM_READ = 0x10
_C_TYPES = {"f": "float[]", "h": "short[]"}


def _sf_message(code: int) -> str:
    return _ffi.string(_snd.sf_error_number(code)).decode("utf-8", "replace")


_tls = threading.local()
FAST_DECODE = hasattr(os, "memfd_create")
"""Linux: decode through a per-thread memfd without the GIL; elsewhere through BytesIO (GIL-bound callbacks)."""
_FAST_DTYPES = "fh"  # float32, int16: what libsndfile writes straight into the row



def _decoder() -> _MemfdDecoder:
    dec = getattr(_tls, "dec", None)
    if dec is None or dec.pid != os.getpid():
        dec = _tls.dec = _MemfdDecoder()
    return dec


def decoded_frames(data) -> int:
    """Frames (samples per channel) a full decode of one stored member yields: the packer's decode check.

    FLAC goes through dr_flac (_DrFlac: a damaged frame fails its CRC and is not counted, so the count comes up
    short of the header's), anything else through the memfd decoder (`SoundFile(BytesIO(data)).blocks()` would
    read through Python callbacks, ~2x the CPU of the decode on short files). Constant memory: one 16k-frame
    scratch buffer. Raises AudioError: unreadable_audio, or truncated_audio when libsndfile failed after some
    frames."""
    if not len(data):
        raise AudioError("empty_audio", "0 bytes")
    if DR_FLAC is not None and _is_flac(data):
        frames = DR_FLAC.decoded_frames(data)
        if frames is not None:
            return frames
    if FAST_DECODE:
        return _decoder().decoded_frames(data)
    decoded = 0
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            for block in f.blocks(blocksize=1 << 16, dtype="int16"):
                decoded += len(block)
    except SF_ERRORS as e:
        raise AudioError("truncated_audio" if decoded else "unreadable_audio", f"{type(e).__name__}: {e}") from e
    return decoded


def decode_into(data, out: np.ndarray) -> int:
    """Decode one stored member straight into `out` (a zeroed 1-D float32 or int16 row); returns samples written.

    At most `len(out)` samples are read; fewer means the audio is shorter than the index says (truncated) or,
    for FLAC, that a frame was damaged (dr_flac drops a frame that fails its CRC). Multi-channel audio is
    averaged to mono. Raises AudioError for audio that cannot be read. Thread-safe and without the GIL: FLAC
    through dr_flac (_DrFlac), other codecs through libsndfile on a memfd on Linux (_MemfdDecoder), else BytesIO.
    """
    if not len(data):
        raise AudioError("empty_audio", "0 bytes")
    fast_out = out.flags.c_contiguous and out.dtype.char in _FAST_DTYPES
    if DR_FLAC is not None and fast_out and _is_flac(data):
        got = DR_FLAC.decode_into(data, out)
        if got is not None and got >= 0:
            return got
    if FAST_DECODE and fast_out:
        got = _decoder().decode_into(data, out)
        if got >= 0:
            return got
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            if f.channels == 1 and out.dtype.char in "fh" and (f.subtype not in FLOAT_SUBTYPES or
                                                               out.dtype == np.float32):
                got = len(f.read(len(out), dtype=out.dtype.name, out=out))
                if f.subtype in FLOAT_SUBTYPES:
                    check_finite(out[:got], "float audio")
                return got
            mono = f.read(len(out), dtype="float32", always_2d=True).mean(axis=1)
    except SF_ERRORS as e:
        raise AudioError("unreadable_audio", f"{type(e).__name__}: {e}") from e
    check_finite(mono, "audio")
    if out.dtype == np.float32:
        out[:len(mono)] = mono
    else:
        float_to_int16(mono, out)
    return len(mono)
