"""Keep or transcode input audio into what a shard stores (default 16-bit FLAC, 16 kHz, mono).

    encode_for_shard(Item, AudioInfo, AudioTarget) -> (bytes to store, AudioInfo of the stored audio)

Audio keeps its original bytes when it already matches the target codec, rate and channels (and is a whole
file, not a segment); those bytes are read once and, with `AudioTarget.verify_decode`, decoded once to catch
truncation (FLAC ~2 ms per 10 s). Everything else is decoded, cut to its segment, downmixed, resampled with
torchaudio's sinc resampler and encoded with soundfile.

Levels: every source reaches the shard at its own level. Integer PCM (8/16/24/32-bit, any container) is read as
int16 by libsndfile's shifts; float sources (WAV/AIFF/... FLOAT or DOUBLE) are read as float32 and scaled by
32768 here, because libsndfile's float -> int16 read does not scale (a float WAV became -1/0/+1, ~90 dB down).
Float sources are the only ones that can hold NaN/Inf (rejected: `non_finite_audio`) or exceed full scale: such
peaks are clipped, not scaled (scaling would set each file's level by its loudest sample; clipping keeps the level
of everything under full scale and distorts only the overs), with a warning naming the file; when more than
`AudioTarget.max_clipped_share` of the samples are over, the file is rejected (`clipped_audio`): it is mis-scaled
(typically integer values stored as floats, peaks of ~32767.0), and clipping would store a square wave.
"""
from __future__ import annotations

import io
import logging
from typing import IO

import numpy as np
import soundfile as sf

from shardtrain.format.audio import FLOAT_SUBTYPES, SF_ERRORS, AudioError, AudioInfo, FloatScan
from shardtrain.format.audio import downmix, float_peak, float_scan, float_to_int16
from shardtrain.format.codecs import CODECS, SF_FORMAT
from shardtrain.pack.item import Item
from shardtrain.pack.config import AudioTarget, channel_index  # noqa: F401 (AudioTarget: re-exported)
from shardtrain.pack.probe import SEGMENT_TOLERANCE_S, open_audio, read_audio_bytes
from shardtrain.pack.tailcheck import check_decoded, check_tail, seek_tail

log = logging.getLogger(__name__)


# ---- encode ---------------------------------------------------------------------------------------------------
def segment_frames(item: Item, info: AudioInfo) -> tuple[int, int]:
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


def _clip_policy(clipped: int, samples: int, peak: float, target: AudioTarget, where: str) -> int:
    """Reject (`clipped_audio`) a float source with too many samples over full scale; warn for a few. Returns the
    count clipped."""
    if not clipped:
        return 0
    share = clipped / max(samples, 1)
    if share > target.max_clipped_share:
        raise AudioError("clipped_audio", f"{where}: {clipped} of {samples} samples ({share:.1%}) exceed full scale "
                                          f"(peak {peak:.4g}; more than max_clipped_share {target.max_clipped_share:g}):"
                                          " the floats are mis-scaled (integer values stored as float?); rescale to "
                                          "[-1, 1]")
    log.warning("%s: %d float samples past full scale (peak %.4g) clipped at full scale", where, clipped, peak)
    return clipped


def _float_level(x: np.ndarray, target: AudioTarget, where: str) -> int:
    """A float source's samples, in place: NaN/Inf rejected, overs counted (policy) and clipped to [-1, 1].
    Returns the count clipped."""
    peak = float_peak(x, where)
    if peak <= 1.0:
        return 0
    clipped = _clip_policy(int(np.count_nonzero(np.abs(x) > 1.0)), x.size, peak, target, where)
    np.clip(x, -1.0, 1.0, out=x)
    return clipped


def _check_kept_float(scan: FloatScan, info: AudioInfo, target: AudioTarget, where: str) -> int:
    """A float file kept byte for byte: its full read (float_scan) must reach the header's length, and its overs
    pass the clip policy (the loader clips them at full scale). Returns the count the loader will clip."""
    if scan.frames != info.num_samples:
        raise AudioError("truncated_audio", f"{where}: header promises {info.num_samples} samples, decode yields "
                                            f"{scan.frames}")
    return _clip_policy(scan.clipped, scan.samples, scan.peak, target, where)


def _read_segment(src: str | IO[bytes], start: int, count: int, dtype: str, where: str) -> tuple[np.ndarray, bool]:
    """Decode only [start, start + count) (soundfile seek); a short read means a damaged file and raises. The
    segment's tail is decoded first (tailcheck.seek_tail), so a header that lies about the length costs a seek, not an
    allocation of `count` samples. Returns (samples, whether the source is float): a float source is always read as
    float32 (see the module docstring)."""
    try:
        with sf.SoundFile(src) as f:
            is_float = f.subtype in FLOAT_SUBTYPES
            if is_float:
                dtype = "float32"
            if f.seekable():
                seek_tail(f, start + count, where)
                f.seek(start)
                x = f.read(count, dtype=dtype, always_2d=True)
            else:
                x = _read_through(f, start, count, dtype)
    except SF_ERRORS as e:
        raise AudioError("unreadable_audio", f"{where}: {e}") from e
    if len(x) != count:
        raise AudioError("truncated_audio", f"{where}: expected {count} samples from {start}, decode yields "
                                            f"{len(x)}")
    return x, is_float


def _read_through(f: sf.SoundFile, start: int, count: int, dtype: str) -> np.ndarray:
    """[start, start + count) of a file libsndfile cannot seek (GSM 6.10 WAV: telephony corpora), read from the
    beginning in blocks: memory grows with the samples really present, never with what the header claims, so a
    lying header still costs no allocation (the caller's length check then finds it short)."""
    parts, pos = [], 0
    for block in f.blocks(blocksize=1 << 16, dtype=dtype, always_2d=True, frames=start + count):
        if pos + len(block) > start:
            parts.append(block[max(0, start - pos):])
        pos += len(block)
    return np.concatenate(parts) if parts else np.zeros((0, f.channels), dtype)


def encode_for_shard(item: Item, info: AudioInfo, target: AudioTarget, storage_options: dict | None = None, *,
                     notes: dict | None = None) -> tuple[bytes, AudioInfo]:
    """Bytes to store for `item` and the AudioInfo of the stored audio (`info` = probe of `item.audio`).

    Keeps the file's bytes unchanged when the item is the whole file and (codec, rate, channels) match the target,
    or `target.keep_original` and the codec is a shard codec. Otherwise decodes only the segment, downmixes
    (mean over channels) or repeats a mono channel, resamples with torchaudio's windowed-sinc resampler
    (`functional.resample`, default Hann window, 6 zero crossings, rolloff 0.99) and encodes 16-bit to the target
    codec. Without resampling or downmixing samples go through as int16, so a 16-bit source is copied exactly; a
    float source goes through float32 at its true level (module docstring: NaN/Inf and clipping). `notes`, when
    given, receives {"clipped": samples clipped at full scale} for a float source with overs (the shard task
    counts them).
    """
    start, count = segment_frames(item, info)
    whole = start == 0 and count == info.num_samples
    matches = (info.codec, info.sample_rate_hz, info.channels) == (target.codec, target.sample_rate_hz,
                                                                   target.channels)
    if whole and info.codec in CODECS and (matches or target.keep_original):
        data = read_audio_bytes(item.audio, storage_options)
        scan = _kept_float_scan(data, info, item.audio)
        if scan is not None:  # float: always read whole (NaN/Inf, overs), which is also the decode check
            _note_clipped(notes, _check_kept_float(scan, info, target, item.audio))
        elif target.verify_decode:
            check_decoded(data, info, item.audio)
        else:  # still never store a header that lies about its length (the loader would find out mid-epoch)
            check_tail(data, info, item.audio)
        return data, info

    if info.channels != target.channels and target.channels != 1 and info.channels != 1:
        raise AudioError("unsupported_channels", f"{item.audio}: cannot map {info.channels} channels to "
                                                 f"{target.channels} (only downmix to 1 or repeat a mono channel)")
    pick = channel_index(target.channel_policy) if info.channels > 1 and target.channels == 1 else None
    if pick is not None and pick >= info.channels:
        raise AudioError("missing_channel", f"{item.audio}: --channels-policy {target.channel_policy} keeps channel "
                                            f"{pick}, the file has {info.channels}")
    resample = info.sample_rate_hz != target.sample_rate_hz
    as_float = resample or (info.channels > 1 and target.channels == 1 and pick is None)
    with open_audio(item.audio, storage_options) as src:
        x, is_float = _read_segment(src, start, count, "float32" if as_float else "int16", item.audio)
    as_float = as_float or is_float
    if is_float:
        _note_clipped(notes, _float_level(x, target, item.audio))
    if pick is not None:
        x = np.ascontiguousarray(x[:, pick: pick + 1])
    elif info.channels > 1 and target.channels == 1:
        x = downmix(x, item.audio)
    elif info.channels == 1 and target.channels > 1:
        x = np.repeat(x, target.channels, axis=1)
    if resample:
        x = _resample(x, info.sample_rate_hz, target.sample_rate_hz)
    return _encode(float_to_int16(x) if as_float else x, target, item.audio)


def _resample(x: np.ndarray, from_hz: int, to_hz: int) -> np.ndarray:
    """[frames, channels] float32 through torchaudio's windowed-sinc resampler, on one intra-op thread: packing
    parallelises over processes, and torch's conv1d with 2 threads on this 2-core machine measured 95 ms vs 1.4 ms
    (1 thread) for 5 s of 44.1 -> 16 kHz. The thread count is restored afterwards."""
    import torch  # noqa: PLC0415 (heavy; only transcoding needs it)
    import torchaudio.functional as taf  # noqa: PLC0415

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        y = taf.resample(torch.from_numpy(np.ascontiguousarray(x.T)), from_hz, to_hz)
    finally:
        torch.set_num_threads(threads)
    return y.T.numpy()


def _encode(pcm: np.ndarray, target: AudioTarget, where: str) -> tuple[bytes, AudioInfo]:
    """int16 [frames, channels] -> the target codec's bytes and their AudioInfo."""
    if len(pcm) == 0:
        raise AudioError("empty_audio", f"{where}: segment resamples to 0 samples")
    fmt, subtype = SF_FORMAT[target.codec]
    buf = io.BytesIO()
    try:
        sf.write(buf, pcm, target.sample_rate_hz, format=fmt, subtype=subtype)
    except SF_ERRORS as e:  # e.g. an encoder rejecting the rate; AudioTarget validation should prevent it
        raise AudioError("encode_failed", f"{where} -> {target.codec}: {e}") from e
    n = len(pcm)
    return buf.getvalue(), AudioInfo(duration_s=n / target.sample_rate_hz, sample_rate_hz=target.sample_rate_hz,
                                     num_samples=n, channels=pcm.shape[1], codec=target.codec)


def _kept_float_scan(data: bytes, info: AudioInfo, where: str) -> FloatScan | None:
    """float_scan of a kept WAV (None for integer PCM, FLAC and other codecs), its errors naming the file."""
    if info.codec != "wav":
        return None
    try:
        return float_scan(data)
    except AudioError as e:
        raise AudioError(e.reason, f"{where}: {e.detail}") from e


def _note_clipped(notes: dict | None, clipped: int) -> None:
    if notes is not None and clipped:
        notes["clipped"] = clipped
