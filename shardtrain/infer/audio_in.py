"""Reading the audio that transcribe/evaluate are given, with memory bounded by what is read, never by a header.

    Utterance(key, audio ref, reference, start_s, duration_s)     what any input becomes (a file, a Kaldi segment,
                                                                   a Common Voice clip, an HF row, a manifest line)
      -> probe(u): header only (rate, channels, the frames it *claims*), for planning batches
      -> read(u, max_frames) / windows(u, window_frames): decoded block by block (BLOCK_FRAMES at a time) into
         mono float32, stopping at the segment's end, at the end of the data, or at max_frames

Why blocks: soundfile.read preallocates the frame count the header states, so a 16 KB FLAC whose STREAMINFO claims
2^36 samples asks for 256 GiB before a sample is decoded; reading blocks allocates only what the file really
holds. Why windows: a model's memory grows with the input (attention is quadratic in it), so audio longer than
one window is decoded and run window by window (transcribe.py), holding about one window of samples at a time
(at most 1.25: a short tail is split with the last window, see window_spans): memory is bounded by the window,
whatever the file's length. Audio references are what pack's sources produce: a local path, an fsspec URL, or
`<file>#bytes=START-END` (audio inside an Arrow file or a Kaldi ark), read with one ranged
read bounded by format.audioref.MAX_RANGE_BYTES. Only regular files are opened (a FIFO would hang the run). Errors are AudioError
with a snake_case reason; the caller records them per utterance.
"""
from __future__ import annotations

import io
import os
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import soundfile as sf

from shardtrain import storage
from shardtrain.format.audio import SF_ERRORS, AudioError
from shardtrain.format.audioref import local_path, read_byte_range

BLOCK_FRAMES = 1 << 16
"""Frames decoded per soundfile read (~4 s at 16 kHz): the unit of allocation while reading."""


@dataclass(frozen=True, slots=True)
class Utterance:
    """One thing to transcribe; `reference` None = no transcript known (it is then not scored)."""

    key: str
    audio: str
    reference: str | None = None
    start_s: float = 0.0
    duration_s: float | None = None
    """Segment length; None = to the end of the file."""


@dataclass(frozen=True, slots=True)
class Probe:
    rate_hz: int
    start_frame: int
    frames: int
    """Frames the header claims for the segment: a claim, not a promise (reading stops at the real end)."""

    @property
    def duration_s(self) -> float:
        return self.frames / self.rate_hz


@contextmanager
def open_sound(ref: str, storage_options: dict | None = None) -> Iterator[sf.SoundFile]:
    """A soundfile reader on `ref` (header parsed, nothing decoded). Raises AudioError."""
    try:
        data = read_byte_range(ref, storage_options)
        if data is not None:
            src: object = io.BytesIO(data)
            with sf.SoundFile(src) as snd:
                yield snd
            return
        local = local_path(ref)
        if local is not None:
            _check_regular(local)
            with sf.SoundFile(local) as snd:
                yield snd
            return
        fs, path = storage.fs_and_path(ref, storage_options)
        with fs.open(path, "rb") as f, sf.SoundFile(f) as snd:
            yield snd
    except FileNotFoundError as e:
        raise AudioError("missing_file", f"{ref} does not exist") from e
    except SF_ERRORS as e:
        raise AudioError("unreadable_audio", f"{ref}: {e}") from e
    except OSError as e:
        raise AudioError("unreadable_audio", f"{ref}: {type(e).__name__}: {e}") from e


def _check_regular(path: str) -> None:
    st = os.stat(path)  # FileNotFoundError -> missing_file
    if not stat.S_ISREG(st.st_mode):
        raise AudioError("not_a_file", f"{path} is not a regular file")
    if st.st_size == 0:
        raise AudioError("empty_audio", f"{path} is 0 bytes")


def _segment(u: Utterance, snd: sf.SoundFile) -> Probe:
    rate = int(snd.samplerate)
    if rate <= 0:
        raise AudioError("unreadable_audio", f"{u.audio}: sample rate {rate}")
    start = int(round(u.start_s * rate))
    claimed = max(int(snd.frames), 0)
    if start and start >= claimed:
        raise AudioError("segment_out_of_range", f"{u.audio}: segment starts at {u.start_s} s, the audio claims "
                                                 f"{claimed / rate:.3f} s")
    frames = claimed - start if u.duration_s is None else int(round(u.duration_s * rate))
    return Probe(rate_hz=rate, start_frame=start, frames=max(frames, 0))


def probe(u: Utterance, storage_options: dict | None = None) -> Probe:
    """Header only: rate and the frames claimed for the segment (for planning). Raises AudioError."""
    with open_sound(u.audio, storage_options) as snd:
        return _segment(u, snd)


def _blocks(snd: sf.SoundFile, p: Probe, limit: int) -> Iterator[np.ndarray]:
    """Mono float32 blocks of the segment, at most `limit` frames in all, stopping at the real end of the data."""
    done = 0
    try:
        if p.start_frame:
            snd.seek(p.start_frame)
        left = min(p.frames, limit)
        while left > 0:
            x = snd.read(min(BLOCK_FRAMES, left), dtype="float32", always_2d=True)
            if not len(x):
                return
            yield x[:, 0].copy() if x.shape[1] == 1 else x.mean(axis=1, dtype=np.float32)
            done += len(x)
            left -= len(x)
            if len(x) < min(BLOCK_FRAMES, left + len(x)):
                return  # a short read: the data ended before the header said it would
    except SF_ERRORS as e:
        # libsndfile reads past the real end of a file whose header claims more frames than it holds, then fails
        if p.start_frame + done < snd.frames:
            raise AudioError("header_mismatch", f"{snd.name}: the header claims {snd.frames} frames, decoding failed "
                                                f"after {p.start_frame + done} ({e})") from e
        raise AudioError("unreadable_audio", f"{snd.name}: {e}") from e


def read(u: Utterance, max_frames: int, storage_options: dict | None = None) -> tuple[np.ndarray, int]:
    """(mono float32 samples, rate) of the segment, at most `max_frames` of them. Raises AudioError."""
    with open_sound(u.audio, storage_options) as snd:
        p = _segment(u, snd)
        parts = list(_blocks(snd, p, max_frames))
    x = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    if not len(x):
        raise AudioError("empty_audio", f"{u.audio}: no samples decoded")
    return x, p.rate_hz


def window_spans(total: int, window_frames: int) -> list[tuple[int, int]]:
    """[start, end) of each window over `total` frames: whole windows, except that a tail shorter than a quarter
    window is never run alone (a few ms of audio is fewer feature frames than a model's convolutions need, and
    made a 30.01 s file fail whole): the last window and such a tail are split into two near-equal halves.
    Every window is at most `window_frames`; each is over a quarter window unless `total` itself is shorter."""
    spans, start = [], 0
    while total - start > window_frames + window_frames // 4:
        spans.append((start, start + window_frames))
        start += window_frames
    rest = total - start
    if rest > window_frames:
        spans += [(start, start + rest - rest // 2), (start + rest - rest // 2, total)]
    elif rest > 0:
        spans.append((start, total))
    return spans


def windows(u: Utterance, window_frames: int, storage_options: dict | None = None) -> Iterator[tuple[np.ndarray, int]]:
    """Successive (mono float32 window, rate) of the segment, cut as `window_spans` cuts it (decided while
    streaming: a window is yielded once more than 1.25 windows are buffered). Holds at most 1.25 windows (plus
    one block) in memory. Raises AudioError (possibly after some windows were yielded)."""
    with open_sound(u.audio, storage_options) as snd:
        p = _segment(u, snd)
        buf: list[np.ndarray] = []
        have = 0
        for block in _blocks(snd, p, p.frames):
            buf.append(block)
            have += len(block)
            while have > window_frames + window_frames // 4:
                whole = np.concatenate(buf)
                yield whole[:window_frames], p.rate_hz
                rest = whole[window_frames:]
                buf, have = ([rest] if len(rest) else []), len(rest)
        if have:
            whole = np.concatenate(buf)
            for a, b in window_spans(have, window_frames):
                yield whole[a:b], p.rate_hz
