"""Probe, decode and transcode audio with soundfile (libsndfile 1.2: WAV, FLAC, Ogg/Opus, MP3; no system library).

    probe(path) -> AudioInfo(duration_s, sample_rate_hz, num_samples, channels, codec)      headers only
    encode_for_shard(Item, AudioInfo, AudioTarget) -> (bytes to store, AudioInfo of the stored audio)
    decode(bytes) -> (samples [n] or [n, ch], sample_rate_hz)                                 verify
    decode_into(bytes, out) -> samples written into a preallocated row (mono float32/int16)     loader hot path

Costs (one core, measured here): `probe` of a FLAC/WAV/Opus header ~0.05 ms plus the open; kept-original bytes
are read once and, with `AudioTarget.verify_decode`, decoded once to catch truncation (FLAC ~2 ms per 10 s);
transcoding adds torchaudio's sinc resampler and the encoder.

MP3 lengths: libsndfile takes the sample count from the Xing/Info (LAME) tag when there is one, and then it is
exact, gapless-corrected. Without the tag it *estimates* the count from the first frame's bitrate and then stops
decoding at that estimate: a VBR file without a tag measured here reported and decoded 78,048 of 160,000 samples,
silently. A file truncated after its tag was written decodes short without an error. So `probe` walks the MP3
frame headers (no decode; ~the cost of reading the file) and raises `AudioError` when the walked length and
libsndfile's length disagree by more than a few frames: "truncated_audio" when the file holds less than the tag
promises, "unreliable_mp3_length" when it holds more than libsndfile would decode.

Remote audio (any fsspec URL) is opened through fsspec; local paths and `file://` URLs use plain files.
"""
from __future__ import annotations

import io
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import soundfile as sf

from shardtrain.sources import Item

log = logging.getLogger(__name__)

SHARD_CODECS = ("flac", "wav", "opus", "mp3")
_SF_FORMAT = {"flac": ("FLAC", "PCM_16"), "wav": ("WAV", "PCM_16"), "opus": ("OGG", "OPUS"),
              "mp3": ("MP3", "MPEG_LAYER_III")}
_OPUS_RATES_HZ = (8000, 12000, 16000, 24000, 48000)
_MP3_RATES_HZ = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
SEGMENT_TOLERANCE_S = 0.025
"""A segment may overrun the file end by this much (manifest rounding; lhotse's default tolerance) and is clamped;
a `duration_s` within this of the whole file counts as the whole file."""
_PROBE_BLOCK_BYTES = 1 << 18  # fsspec read-ahead for header probes: one small ranged GET, not the 5 MB default


class AudioError(Exception):
    """Audio that cannot be packed. `reason` is a snake_case code: missing_file, empty_audio, unreadable_audio,
    truncated_audio, segment_out_of_range, unsupported_channels, unreliable_mp3_length."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class AudioInfo:
    """What the index needs about one audio stream; codec is one of flac|wav|opus|mp3|other."""

    duration_s: float
    sample_rate_hz: int
    num_samples: int
    channels: int
    codec: str


@dataclass(frozen=True, kw_only=True, slots=True)
class AudioTarget:
    """How audio is stored in shards."""

    codec: str = "flac"
    """Stored codec: flac (16-bit), wav (PCM_16), opus (Ogg/Opus) or mp3."""
    sample_rate_hz: int = 16000
    """Stored sample rate; opus needs 8000/12000/16000/24000/48000."""
    channels: int = 1
    """Stored channels; 1 downmixes by averaging."""
    keep_original: bool = False
    """Keep whole files in any shard codec byte for byte, whatever their rate and channels (segments and other
    codecs are still transcoded to this target)."""
    verify_decode: bool = True
    """Decode kept-original files fully so a truncated file is rejected here, not in the training loader
    (FLAC: ~2 ms per 10 s of audio). False trusts the headers."""

    def __post_init__(self) -> None:
        if self.codec not in SHARD_CODECS:
            raise ValueError(f"audio codec (--codec) must be one of {SHARD_CODECS}, got {self.codec!r}")
        if self.sample_rate_hz <= 0:
            raise ValueError(f"--sample-rate-hz must be > 0, got {self.sample_rate_hz}")
        if self.codec == "opus" and self.sample_rate_hz not in _OPUS_RATES_HZ:
            raise ValueError(f"--sample-rate-hz {self.sample_rate_hz} is not allowed with opus; use one of "
                             f"{_OPUS_RATES_HZ}")
        if self.codec == "mp3" and self.sample_rate_hz not in _MP3_RATES_HZ:
            raise ValueError(f"--sample-rate-hz {self.sample_rate_hz} is not allowed with mp3; use one of "
                             f"{_MP3_RATES_HZ}")
        if not 1 <= self.channels <= (2 if self.codec in ("opus", "mp3") else 8):
            raise ValueError(f"--channels must be 1..{2 if self.codec in ('opus', 'mp3') else 8} for "
                             f"{self.codec}, got {self.channels}")


# ---- opening --------------------------------------------------------------------------------------------------
def _local_path(path: str) -> str | None:
    if path.startswith("file://"):
        return path[len("file://"):]
    return None if "://" in path else path


@contextmanager
def _open(path: str, storage_options: dict | None, block_size: int | None = None) -> Iterator[Any]:
    """A local path (soundfile opens it itself, fastest) or an open fsspec file object."""
    local = _local_path(path)
    if local is not None:
        if not os.path.isfile(local):
            raise AudioError("missing_file", f"{path} does not exist")
        if os.path.getsize(local) == 0:
            raise AudioError("empty_audio", f"{path} is 0 bytes")
        yield local
        return
    import fsspec  # noqa: PLC0415

    fs, p = fsspec.core.url_to_fs(path, **(storage_options or {}))
    try:
        f = fs.open(p, "rb", **({"block_size": block_size} if block_size else {}))
    except FileNotFoundError as e:
        raise AudioError("missing_file", f"{path} does not exist") from e
    with f:
        if getattr(f, "size", None) == 0:
            raise AudioError("empty_audio", f"{path} is 0 bytes")
        yield f


def _read_bytes(path: str, storage_options: dict | None) -> bytes:
    with _open(path, storage_options) as src:
        if isinstance(src, str):
            with open(src, "rb") as f:
                return f.read()
        return src.read()


def _codec(fmt: str, subtype: str) -> str:
    if fmt == "FLAC":
        return "flac"
    if fmt in ("WAV", "WAVEX"):
        return "wav"
    if fmt == "OGG" and subtype == "OPUS":
        return "opus"
    return "mp3" if fmt == "MP3" else "other"


_SF_ERRORS = (sf.SoundFileError, RuntimeError, ValueError, TypeError, EOFError)


# ---- probe ----------------------------------------------------------------------------------------------------
def probe(path: str, storage_options: dict | None = None) -> AudioInfo:
    """Read headers only (soundfile.info), no decode; MP3 files are additionally frame-walked (module docstring)."""
    with _open(path, storage_options, block_size=_PROBE_BLOCK_BYTES) as src:
        data = None
        if _looks_mp3(path):
            data = src.read() if not isinstance(src, str) else None
        try:
            info = sf.info(io.BytesIO(data) if data is not None else src)
        except _SF_ERRORS as e:
            raise AudioError("unreadable_audio", f"{path}: {e}") from e
    codec = _codec(info.format, info.subtype)
    frames, rate = int(info.frames), int(info.samplerate)
    if frames <= 0 or rate <= 0:
        raise AudioError("empty_audio", f"{path} has {frames} samples")
    if codec == "mp3":
        _check_mp3_length(path, data if data is not None else _read_bytes(path, storage_options), frames)
    return AudioInfo(duration_s=frames / rate, sample_rate_hz=rate, num_samples=frames, channels=int(info.channels),
                     codec=codec)


def _looks_mp3(path: str) -> bool:
    return path.lower().endswith(".mp3")


_MP3_BITRATES_KBPS = {  # (mpeg1?, layer) -> table indexed by the 4-bit bitrate index
    (True, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MP3_BITRATES_KBPS[(False, 3)] = _MP3_BITRATES_KBPS[(False, 2)]
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}  # by version bits


def mp3_walk_samples(data: bytes) -> tuple[int, int] | None:
    """Walk MPEG audio frame headers: (samples incl. encoder delay/padding, samples per frame), or None when the
    stream cannot be walked (free-format bitrate, no frame found). Pure Python, ~1 µs per frame."""
    i = 0
    if data[:3] == b"ID3" and len(data) >= 10:
        i = 10 + ((data[6] << 21) | (data[7] << 14) | (data[8] << 7) | data[9])
    samples = spf = 0
    n = len(data)
    while i + 4 <= n:
        h = int.from_bytes(data[i:i + 4], "big")
        version, layer_bits = (h >> 19) & 3, (h >> 17) & 3
        br_idx, sr_idx, pad = (h >> 12) & 15, (h >> 10) & 3, (h >> 9) & 1
        if (h >> 21) != 0x7FF or version == 1 or layer_bits == 0 or br_idx in (0, 15) or sr_idx == 3:
            break
        layer, mpeg1 = 4 - layer_bits, version == 3
        bitrate = _MP3_BITRATES_KBPS[(mpeg1, layer)][br_idx] * 1000
        rate = _MP3_RATES[version][sr_idx]
        if layer == 1:
            length, spf = (12 * bitrate // rate + pad) * 4, 384
        else:
            spf = 1152 if (layer == 2 or mpeg1) else 576
            length = spf // 8 * bitrate // rate + pad
        if i + length > n:  # a partial last frame decodes to nothing
            break
        samples += spf
        i += length
    return (samples, spf) if samples else None


def _check_mp3_length(path: str, data: bytes, header_frames: int) -> None:
    walked = mp3_walk_samples(data)
    if walked is None:
        log.debug("cannot walk mp3 frames of %s; trusting libsndfile's length", path)
        return
    samples, spf = walked
    slack = 3 * spf + 2400  # the tag frame, encoder delay + padding, one partial frame
    if samples < header_frames - slack:
        raise AudioError("truncated_audio", f"{path}: mp3 tag promises {header_frames} samples, its frames hold "
                                            f"~{samples}")
    if samples > header_frames + slack:
        raise AudioError("unreliable_mp3_length", f"{path}: mp3 frames hold ~{samples} samples but libsndfile "
                                                  f"would decode {header_frames} (VBR mp3 without a Xing/Info "
                                                  "tag); re-encode it, e.g. with lame or ffmpeg")


# ---- encode ---------------------------------------------------------------------------------------------------
def _segment_frames(item: Item, info: AudioInfo) -> tuple[int, int]:
    """(first sample, sample count) of the item within its file; clamps overruns up to SEGMENT_TOLERANCE_S."""
    rate, total = info.sample_rate_hz, info.num_samples
    start = round(item.start_s * rate)
    if item.start_s < 0 or start >= total:
        raise AudioError("segment_out_of_range", f"{item.audio}: start {item.start_s:.3f} s outside the "
                                                 f"{info.duration_s:.3f} s file")
    count = total - start if item.duration_s is None else round(item.duration_s * rate)
    if count <= 0:
        raise AudioError("empty_audio", f"{item.audio}: segment of {item.duration_s} s")
    overrun = start + count - total
    if overrun > SEGMENT_TOLERANCE_S * rate:
        raise AudioError("segment_out_of_range", f"{item.audio}: segment [{item.start_s:.3f}, "
                                                 f"{item.start_s + (item.duration_s or 0):.3f}] s ends past the "
                                                 f"{info.duration_s:.3f} s file")
    count = min(count, total - start)
    if start == 0 and total - count <= SEGMENT_TOLERANCE_S * rate:
        count = total  # the whole file, give or take manifest rounding
    return start, count


def _verify_bytes(data: bytes, info: AudioInfo, where: str) -> None:
    """Decode `data` fully (int16 blocks, little memory) and check it yields the promised sample count."""
    decoded = 0
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            for block in f.blocks(blocksize=1 << 16, dtype="int16"):
                decoded += len(block)
    except _SF_ERRORS as e:
        raise AudioError("truncated_audio" if decoded else "unreadable_audio", f"{where}: {e}") from e
    if decoded != info.num_samples:
        raise AudioError("truncated_audio", f"{where}: header promises {info.num_samples} samples, decode yields "
                                            f"{decoded}")


def _read_segment(src: str | IO[bytes], start: int, count: int, dtype: str, where: str) -> np.ndarray:
    """Decode only [start, start + count) (soundfile seek); a short read means a damaged file and raises."""
    try:
        with sf.SoundFile(src) as f:
            if start:
                f.seek(start)
            x = f.read(count, dtype=dtype, always_2d=True)
    except _SF_ERRORS as e:
        raise AudioError("unreadable_audio", f"{where}: {e}") from e
    if len(x) != count:
        raise AudioError("truncated_audio", f"{where}: expected {count} samples from {start}, decode yields "
                                            f"{len(x)}")
    return x


def _to_int16(x: np.ndarray) -> np.ndarray:
    return np.clip(np.round(x * 32768.0), -32768, 32767).astype(np.int16)


def encode_for_shard(item: Item, info: AudioInfo, target: AudioTarget, storage_options: dict | None = None
                     ) -> tuple[bytes, AudioInfo]:
    """Bytes to store for `item` and the AudioInfo of the stored audio (`info` = probe of `item.audio`).

    Keeps the file's bytes unchanged when the item is the whole file and (codec, rate, channels) match the target,
    or `target.keep_original` and the codec is a shard codec. Otherwise decodes only the segment, downmixes
    (mean over channels) or repeats a mono channel, resamples with torchaudio's windowed-sinc resampler
    (`functional.resample`, default Hann window, 6 zero crossings, rolloff 0.99) and encodes 16-bit to the target
    codec. Without resampling or downmixing samples go through as int16, so a 16-bit source is copied exactly.
    """
    start, count = _segment_frames(item, info)
    whole = start == 0 and count == info.num_samples
    matches = (info.codec, info.sample_rate_hz, info.channels) == (target.codec, target.sample_rate_hz,
                                                                   target.channels)
    if whole and info.codec in SHARD_CODECS and (matches or target.keep_original):
        data = _read_bytes(item.audio, storage_options)
        if target.verify_decode:
            _verify_bytes(data, info, item.audio)
        return data, info

    if info.channels != target.channels and target.channels != 1 and info.channels != 1:
        raise AudioError("unsupported_channels", f"{item.audio}: cannot map {info.channels} channels to "
                                                 f"{target.channels} (only downmix to 1 or repeat a mono channel)")
    resample = info.sample_rate_hz != target.sample_rate_hz
    as_float = resample or (info.channels > 1 and target.channels == 1)
    with _open(item.audio, storage_options) as src:
        x = _read_segment(src, start, count, "float32" if as_float else "int16", item.audio)
    if info.channels > 1 and target.channels == 1:
        x = x.mean(axis=1, keepdims=True)
    elif info.channels == 1 and target.channels > 1:
        x = np.repeat(x, target.channels, axis=1)
    if resample:
        import torch  # noqa: PLC0415 (heavy; only transcoding needs it)
        import torchaudio.functional as taf  # noqa: PLC0415

        # One intra-op thread: packing parallelises over processes, and torch's conv1d with 2 threads on this
        # 2-core machine measured 95 ms vs 1.4 ms (1 thread) for 5 s of 44.1 -> 16 kHz. Restored afterwards.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            y = taf.resample(torch.from_numpy(np.ascontiguousarray(x.T)), info.sample_rate_hz,
                             target.sample_rate_hz)
        finally:
            torch.set_num_threads(threads)
        x = y.T.numpy()
    pcm = _to_int16(x) if as_float else x
    if len(pcm) == 0:
        raise AudioError("empty_audio", f"{item.audio}: segment resamples to 0 samples")
    fmt, subtype = _SF_FORMAT[target.codec]
    buf = io.BytesIO()
    try:
        sf.write(buf, pcm, target.sample_rate_hz, format=fmt, subtype=subtype)
    except _SF_ERRORS as e:  # e.g. an encoder rejecting the rate; AudioTarget validation should prevent it
        raise AudioError("encode_failed", f"{item.audio} -> {target.codec}: {e}") from e
    n = len(pcm)
    return buf.getvalue(), AudioInfo(duration_s=n / target.sample_rate_hz, sample_rate_hz=target.sample_rate_hz,
                                     num_samples=n, channels=pcm.shape[1], codec=target.codec)


def decode(data: bytes, dtype: str = "float32") -> tuple[np.ndarray, int]:
    """Decode one stored audio member: (samples [n] for mono or [n, ch], sample_rate_hz). Raises AudioError."""
    if not data:
        raise AudioError("empty_audio", "0 bytes")
    try:
        x, rate = sf.read(io.BytesIO(data), dtype=dtype, always_2d=False)
    except _SF_ERRORS as e:
        raise AudioError("unreadable_audio", str(e)) from e
    return x, int(rate)


# ---- loader hot path ----------------------------------------------------------------------------------------

class _MemfdDecoder:
    """libsndfile on an in-memory file descriptor, called through soundfile's own cffi handle.

    Why: `sf.SoundFile(io.BytesIO(...))` makes libsndfile read through Python callbacks, and every callback
    takes the GIL, so two decode threads in one process topped out at ~85% of two processes (measured here:
    9,400-9,900 against 11,700 audio-s/s). Copying the member into a memfd (one pwrite, ~10 us per 100 kB) lets
    libsndfile read with plain syscalls, so the whole decode runs without the GIL: 2-3 threads then match two
    processes. The memfd is per thread and per process (a forked DataLoader worker must not share its parent's).
    Costs one file descriptor per decode thread.
    """

    def __init__(self) -> None:
        self.fd = os.memfd_create("shardtrain-decode", os.MFD_CLOEXEC)
        self.pid = os.getpid()
        self.info = _ffi.new("SF_INFO*")

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass

    def decode_into(self, data, out: np.ndarray) -> int:
        n = len(data)
        os.ftruncate(self.fd, n)
        if os.pwrite(self.fd, data, 0) != n:
            raise AudioError("unreadable_audio", "short write to the decode buffer")
        os.lseek(self.fd, 0, os.SEEK_SET)
        info = self.info
        info.format = 0
        h = _snd.sf_open_fd(self.fd, _SFM_READ, info, 0)
        if h == _ffi.NULL:
            raise AudioError("unreadable_audio", _ffi.string(_snd.sf_strerror(_ffi.NULL)).decode("utf-8", "replace"))
        try:
            if info.channels != 1:
                return -int(info.channels)  # caller falls back to the downmixing path
            want = len(out)
            ptr = _ffi.cast(_READF[out.dtype.char][1], out.ctypes.data)
            got = int(_READF[out.dtype.char][0](h, ptr, want))
            if _snd.sf_error(h):
                raise AudioError("unreadable_audio", _ffi.string(_snd.sf_strerror(h)).decode("utf-8", "replace"))
            return got
        finally:
            _snd.sf_close(h)


_tls = threading.local()
_SFM_READ = 0x10
try:  # soundfile's cffi handle on its bundled libsndfile (stable since soundfile 0.10); absent -> BytesIO path
    _snd, _ffi = sf._snd, sf._ffi  # noqa: SLF001
    _READF = {"f": (_snd.sf_readf_float, "float *"), "h": (_snd.sf_readf_short, "short *")}
    FAST_DECODE = hasattr(os, "memfd_create")
except AttributeError:  # pragma: no cover - other soundfile builds
    FAST_DECODE = False


def decode_into(data, out: np.ndarray) -> int:
    """Decode one stored member straight into `out` (a zeroed 1-D float32 or int16 row); returns samples written.

    At most `len(out)` samples are read; fewer means the audio is shorter than the index says (truncated).
    Multi-channel audio is averaged to mono. Raises AudioError for audio libsndfile cannot read. Thread-safe,
    and runs without the GIL on Linux (see _MemfdDecoder); elsewhere it goes through BytesIO.
    """
    if not len(data):
        raise AudioError("empty_audio", "0 bytes")
    if FAST_DECODE and out.flags.c_contiguous and out.dtype.char in _READF:
        dec = getattr(_tls, "dec", None)
        if dec is None or dec.pid != os.getpid():
            dec = _tls.dec = _MemfdDecoder()
        got = dec.decode_into(data, out)
        if got >= 0:
            return got
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            if f.channels == 1 and out.dtype.char in "fh":
                return len(f.read(len(out), dtype=out.dtype.name, out=out))
            mono = f.read(len(out), dtype="float32", always_2d=True).mean(axis=1)
    except _SF_ERRORS as e:
        raise AudioError("unreadable_audio", f"{type(e).__name__}: {e}") from e
    out[:len(mono)] = mono if out.dtype == np.float32 else np.round(mono * 32767).astype(out.dtype)
    return len(mono)
