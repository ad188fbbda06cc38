"""Decoding stored audio: what the bytes of a shard's audio member mean, for the loader, verify and noise banks.

    decode(bytes) -> (samples [n] or [n, ch], sample_rate_hz)                                   verify, noise
    decode_into(bytes, out) -> samples written into a preallocated row (mono float32/int16)      loader hot path

soundfile (bundled libsndfile 1.2) reads WAV, FLAC, Ogg/Opus and MP3 with no system library. decode_into runs
without the GIL on Linux (see _MemfdDecoder), which is what lets the loader decode in threads of one process.
Probing and transcoding input audio belong to `pack` (probe.py, transcode.py).
"""
from __future__ import annotations

import io
import logging
import os
import threading
from dataclasses import dataclass

import numpy as np
import soundfile as sf


log = logging.getLogger(__name__)



class AudioError(Exception):
    """Audio that cannot be packed. `reason` is a snake_case code: missing_file, empty_audio, unreadable_audio,
    truncated_audio, segment_out_of_range, unsupported_channels, unreliable_mp3_length."""

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


def decode(data: bytes, dtype: str = "float32") -> tuple[np.ndarray, int]:
    """Decode one stored audio member: (samples [n] for mono or [n, ch], sample_rate_hz). Raises AudioError."""
    if not data:
        raise AudioError("empty_audio", "0 bytes")
    try:
        x, rate = sf.read(io.BytesIO(data), dtype=dtype, always_2d=False)
    except SF_ERRORS as e:
        raise AudioError("unreadable_audio", str(e)) from e
    return x, int(rate)


# ---- loader hot path ----------------------------------------------------------------------------------------

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
            read = _snd.sf_readf_float if out.dtype == np.float32 else _snd.sf_readf_short
            got = read(handle, _ffi.from_buffer(_C_TYPES[out.dtype.char], out), len(out))
            if got < len(out):  # only a short read can carry an error (one C call less per member otherwise)
                err = _snd.sf_error(handle)
                if err:
                    raise AudioError("unreadable_audio", f"LibsndfileError: {_sf_message(err)}")
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

    Why not `SoundFile(BytesIO(data)).blocks()`: libsndfile then reads through Python callbacks, ~2x the CPU of
    the decode itself on short FLAC files; here the member goes through the memfd decoder (constant memory:
    one 16k-frame scratch buffer). Raises AudioError: unreadable_audio, or truncated_audio when decoding
    failed after some frames."""
    if not len(data):
        raise AudioError("empty_audio", "0 bytes")
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

    At most `len(out)` samples are read; fewer means the audio is shorter than the index says (truncated).
    Multi-channel audio is averaged to mono. Raises AudioError for audio libsndfile cannot read. Thread-safe,
    and runs without the GIL on Linux (see _MemfdDecoder); elsewhere it goes through BytesIO.
    """
    if not len(data):
        raise AudioError("empty_audio", "0 bytes")
    if FAST_DECODE and out.flags.c_contiguous and out.dtype.char in _FAST_DTYPES:
        got = _decoder().decode_into(data, out)
        if got >= 0:
            return got
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            if f.channels == 1 and out.dtype.char in "fh":
                return len(f.read(len(out), dtype=out.dtype.name, out=out))
            mono = f.read(len(out), dtype="float32", always_2d=True).mean(axis=1)
    except SF_ERRORS as e:
        raise AudioError("unreadable_audio", f"{type(e).__name__}: {e}") from e
    out[:len(mono)] = mono if out.dtype == np.float32 else np.round(mono * 32767).astype(out.dtype)
    return len(mono)
