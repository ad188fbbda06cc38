"""Probe input audio headers: duration, rate, channels and codec without decoding (the first stage of pack).

    probe(path) -> AudioInfo(duration_s, sample_rate_hz, num_samples, channels, codec)      headers only

Costs (one core, measured here): a FLAC/WAV/Opus header ~0.05 ms plus the open. Remote audio (any fsspec URL)
is opened through storage.fs_and_path; local paths and `file://` URLs use plain files; `<file>#bytes=A-B`
references read a byte range (audio inside an Arrow file or a Kaldi ark).

MP3 lengths: libsndfile takes the sample count from the Xing/Info (LAME) tag when there is one, and then it is
exact, gapless-corrected. Without the tag it *estimates* the count from the first frame's bitrate and then stops
decoding at that estimate: a VBR file without a tag measured here reported and decoded 78,048 of 160,000 samples,
silently. So `probe` walks the MP3 frame headers (no decode; ~the cost of reading the file) and raises
`AudioError` when the walked length and libsndfile's length disagree by more than a few frames: "truncated_audio"
when the file holds less than the tag promises, "unreliable_mp3_length" when it holds more than libsndfile
would decode.

WAV lengths: libsndfile takes a RIFF/WAVE file's length from the bytes present, not from its `data` chunk's size,
so a WAV cut short (an interrupted copy) opened as a shorter, valid file: half the audio stored under the whole
transcript, silently. So `probe` reads the `data` chunk's declared size (PCM, float, A-law, mu-law and GSM 6.10,
whose frames have a fixed size) and raises "truncated_audio" when the file holds fewer frames than it declares. The
placeholder sizes streaming writers leave (0, 0xFFFFFFFF, >= 0x7FFF0000: ffmpeg or sox writing to a pipe) say
nothing about the length and are not checked.
"""
from __future__ import annotations

import logging
import io
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple

import soundfile as sf
from shardtrain import storage
from shardtrain.format.audioref import local_path, read_byte_range
from shardtrain.format.audio import SF_ERRORS, AudioError, AudioInfo, codec_of
from shardtrain.pack.safeio import MAX_AUDIO_BYTES, InputFileError, check_regular, read_local_bounded

log = logging.getLogger(__name__)

SEGMENT_TOLERANCE_S = 0.025
"""A segment may overrun the file end by this much (manifest rounding; lhotse's default tolerance) and is clamped;
a `duration_s` within this of the whole file counts as the whole file."""
MAX_FRAMES_PER_BYTE = 8192
"""A header claiming more samples than this per byte of file is lying ("implausible_header"), and is refused
before anything allocates for it. The densest real stream is FLAC's: a constant subframe for the largest block
(65,535 samples) still takes >= 8 bytes with its frame header and CRC; Opus needs >= 2 bytes per 120 ms packet
(2,880 samples per byte at 48 kHz); PCM and MP3 lengths come from the data itself. So a 16 KB FLAC may claim at
most ~134 M samples, never the 2^36 (256 GiB as float32) a crafted header can."""
_PROBE_BLOCK_BYTES = 1 << 18  # fsspec read-ahead for header probes: one small ranged GET, not the 5 MB default


# ---- opening --------------------------------------------------------------------------------------------------
def id3v2_bytes(head: bytes) -> int:
    """Length of the ID3v2 tag at the start of `head` (its first 10 bytes suffice), 0 when there is none."""
    if len(head) < 10 or head[:3] != b"ID3" or head[3] == 0xFF or any(b & 0x80 for b in head[6:10]):
        return 0
    return 10 + (head[6] << 21 | head[7] << 14 | head[8] << 7 | head[9]) + (10 if head[5] & 0x10 else 0)


@contextmanager
def open_audio(path: str, storage_options: dict | None, block_size: int | None = None) -> Iterator[Any]:
    """A local path (soundfile opens it itself, fastest), an open fsspec file object, or the bytes of a
    `#bytes=START-END` reference in a BytesIO.

    An MP3 that starts with an ID3v2 tag comes as a BytesIO of the audio after the tag: libmpg123 prints "error:"
    lines on stderr for tags valid files carry (a COMM or TXXX frame without a description), from inside
    libsndfile where no flag quiets it, and redirecting fd 2 would silence the probe threads' neighbours too.
    The tag is metadata only (samples, rate and the Xing/LAME length tag are in the MPEG frames), so the audio
    is unchanged; errors in the frames themselves still print and fail as before. Cost: the file read into
    memory, which the MP3 length check does anyway."""
    with _open_audio(path, storage_options, block_size) as src:
        if not _looks_mp3(path):
            yield src
            return
        if isinstance(src, str):
            with open(src, "rb") as f:
                head = f.read(10)
        elif isinstance(src, io.BytesIO):
            head = src.getvalue()[:10]
        else:
            head = src.read(10)
            src.seek(0)
        skip = id3v2_bytes(head)
        if not skip:
            yield src
            return
        if isinstance(src, io.BytesIO):
            data = src.getvalue()
        else:
            with (open(src, "rb") if isinstance(src, str) else nullcontext(src)) as f:
                data = f.read(MAX_AUDIO_BYTES + 1)
        if len(data) > MAX_AUDIO_BYTES:
            raise InputFileError("too_large", path, f"more than the {MAX_AUDIO_BYTES} bytes allowed")
        yield io.BytesIO(data[skip:])


@contextmanager
def _open_audio(path: str, storage_options: dict | None, block_size: int | None = None) -> Iterator[Any]:
    ranged = read_byte_range(path, storage_options)
    if ranged is not None:
        yield io.BytesIO(ranged)
        return
    local = local_path(path)
    if local is not None:
        try:
            size = check_regular(local)  # a FIFO or a device is refused before anything opens it
        except FileNotFoundError as e:
            raise AudioError("missing_file", f"{path} does not exist") from e
        if size == 0:
            raise AudioError("empty_audio", f"{path} is 0 bytes")
        yield local
        return
    fs, p = storage.fs_and_path(path, storage_options)
    try:
        f = fs.open(p, "rb", **({"block_size": block_size} if block_size else {}))
    except FileNotFoundError as e:
        raise AudioError("missing_file", f"{path} does not exist") from e
    with f:
        if getattr(f, "size", None) == 0:
            raise AudioError("empty_audio", f"{path} is 0 bytes")
        yield f


def read_audio_bytes(path: str, storage_options: dict | None) -> bytes:
    """The whole file, at most safeio.MAX_AUDIO_BYTES of it (larger: InputFileError "too_large")."""
    with open_audio(path, storage_options) as src:
        if isinstance(src, str):
            return read_local_bounded(src, MAX_AUDIO_BYTES)
        if isinstance(src, io.BytesIO):
            return src.getvalue()
        data = src.read(MAX_AUDIO_BYTES + 1)
        if len(data) > MAX_AUDIO_BYTES:
            raise InputFileError("too_large", path, f"more than the {MAX_AUDIO_BYTES} bytes allowed")
        return data


# ---- probe ----------------------------------------------------------------------------------------------------
def probe(path: str, storage_options: dict | None = None) -> AudioInfo:
    """Read headers only (soundfile.info), no decode; MP3 files are additionally frame-walked (module docstring)."""
    with open_audio(path, storage_options, block_size=_PROBE_BLOCK_BYTES) as src:
        data = None
        if _looks_mp3(path) or isinstance(src, io.BytesIO):  # a byte range is in memory already
            data = src.read() if not isinstance(src, str) else None
        nbytes = len(data) if data is not None else \
            os.path.getsize(src) if isinstance(src, str) else int(getattr(src, "size", 0) or 0)
        info: Any = _flac_streaminfo(src) if isinstance(src, str) else None
        codec = "flac"
        if info is None:
            try:
                info = sf.info(io.BytesIO(data) if data is not None else src)
            except SF_ERRORS as e:
                raise AudioError("unreadable_audio", f"{path}: {e}") from e
            codec = codec_of(info.format, info.subtype)
    frames, rate = int(info.frames), int(info.samplerate)
    if frames <= 0 or rate <= 0:
        raise AudioError("empty_audio", f"{path} has {frames} samples")
    if nbytes and frames > nbytes * MAX_FRAMES_PER_BYTE:
        raise AudioError("implausible_header", f"{path}: header claims {frames} samples in {nbytes} bytes "
                                               f"(more than {MAX_FRAMES_PER_BYTE} per byte)")
    if codec == "mp3":
        _check_mp3_length(path, data if data is not None else read_audio_bytes(path, storage_options), frames)
    if codec == "wav" and getattr(info, "subtype", None) in _WAV_SAMPLE_BYTES:
        _check_wav_length(path, src if data is None else io.BytesIO(data), frames,
                          int(info.channels) * _WAV_SAMPLE_BYTES[info.subtype],
                          _WAV_GSM_SLACK_BYTES if info.subtype == "GSM610" else _WAV_SLACK_BYTES)
    return AudioInfo(duration_s=frames / rate, sample_rate_hz=rate, num_samples=frames, channels=int(info.channels),
                     codec=codec)


class _StreamInfo(NamedTuple):
    frames: int
    samplerate: int
    channels: int


def _flac_streaminfo(path: str) -> _StreamInfo | None:
    """A local FLAC file's length, rate and channels from its STREAMINFO block (the first 42 bytes), or None
    for anything else (then soundfile.info decides). ~10 us instead of ~80 us for soundfile.info, which opens a
    decoder: a third of a kept-FLAC scan's CPU. The content is checked later against this claim (the decode check,
    or the tail check with --no-decode-check); the bit depths libsndfile reads are the only ones accepted here."""
    with open(path, "rb") as f:
        head = f.read(42)
    if len(head) < 42 or head[:4] != b"fLaC" or head[4] & 0x7F or head[5:8] != b"\x00\x00\x22":
        return None
    v = int.from_bytes(head[18:26], "big")
    rate, channels, bits, total = v >> 44, ((v >> 41) & 7) + 1, ((v >> 36) & 31) + 1, v & ((1 << 36) - 1)
    if not rate or not total or bits not in (8, 16, 24):
        return None
    return _StreamInfo(total, rate, channels)


_WAV_SAMPLE_BYTES = {"PCM_U8": 1, "PCM_S8": 1, "PCM_16": 2, "PCM_24": 3, "PCM_32": 4, "FLOAT": 4, "DOUBLE": 8,
                     "GSM610": 65 / 320,
                     "ALAW": 1, "ULAW": 1}
"""Bytes per sample of the WAV subtypes whose frames have a fixed size (the ones the length check applies to;
GSM 6.10: 65-byte blocks of 320 samples)."""
_WAV_HEAD_BYTES = 1 << 16
"""How far into a WAV the `data` chunk header is looked for (past that, e.g. a huge LIST chunk: not checked)."""
_WAV_GSM_SLACK_BYTES = 130
"""GSM 6.10's slack: two 65-byte blocks (640 samples, 80 ms at 8 kHz); 1 KB of GSM is 5,000 samples."""
_WAV_SLACK_BYTES = 1024
"""A `data` size at most this much past the bytes present is a writer's miscount (some count the header in it, or
a pad byte), not a cut: ~32 ms of 16 kHz 16-bit mono. An interrupted copy loses far more."""
_WAV_UNKNOWN_SIZE = 0x7FFF0000
"""A `data` size from here up (or 0) is a streaming writer's placeholder, not a length."""


def wav_declared_bytes(head: bytes) -> int | None:
    """The size a RIFF/WAVE header's `data` chunk declares, None when `head` is not RIFF/WAVE, the chunk does not
    start inside it, or the size is a streaming writer's placeholder."""
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    pos = 12
    while pos + 8 <= len(head):
        size = int.from_bytes(head[pos + 4:pos + 8], "little")
        if head[pos:pos + 4] == b"data":
            return None if size == 0 or size >= _WAV_UNKNOWN_SIZE else size
        pos += 8 + size + (size & 1)
    return None


def _check_wav_length(path: str, src: Any, frames: int, frame_bytes: float, slack_bytes: int) -> None:
    """Raise AudioError("truncated_audio") when a WAV holds fewer frames than its `data` chunk declares
    (libsndfile's `frames` counts the frames present; module docstring)."""
    if isinstance(src, str):
        with open(src, "rb") as f:
            head = f.read(_WAV_HEAD_BYTES)
    else:
        src.seek(0)
        head = src.read(_WAV_HEAD_BYTES)
        src.seek(0)
    declared = wav_declared_bytes(head)
    if declared is not None and declared - frames * frame_bytes > slack_bytes:
        raise AudioError("truncated_audio", f"{path}: data chunk declares {int(declared // frame_bytes)} samples, the "
                                            f"file holds {frames}")


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
