"""format.audio on float sources, on real files written with soundfile: levels, NaN/Inf, full-scale clipping.
(The limits the writer and the readers share: test_limits.py.)"""
from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from shardtrain.format import audio
from shardtrain.format.audio import AudioError, decode, decode_into, decoded_frames, float_scan

RATE = 16000


def _wav(x: np.ndarray, subtype: str = "FLOAT", fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, RATE, format=fmt, subtype=subtype)
    return buf.getvalue()


def _sine(amplitude: float = 0.25, n: int = RATE) -> np.ndarray:
    return amplitude * np.sin(2 * np.pi * 440 * np.arange(n) / RATE)


@pytest.mark.parametrize("subtype", ["FLOAT", "DOUBLE"])
def test_float_member_decodes_at_its_level_into_int16_and_float32(subtype):
    x = _sine()
    data = _wav(x, subtype)
    i16, f32 = np.zeros(len(x), np.int16), np.zeros(len(x), np.float32)
    assert decode_into(data, i16) == decode_into(data, f32) == len(x)
    np.testing.assert_allclose(f32, x, atol=1e-7)
    np.testing.assert_array_equal(i16, np.clip(np.rint(x * 32768), -32768, 32767).astype(np.int16))
    np.testing.assert_array_equal(decode(data, "int16")[0], i16)


@pytest.mark.parametrize("dtype", [np.float32, np.int16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_float_member_raises_in_every_decode_path(dtype, bad):
    x = _sine()
    x[1234] = bad
    data = _wav(x)
    with pytest.raises(AudioError) as e:
        decode_into(data, np.zeros(len(x), dtype))
    assert e.value.reason == "non_finite_audio" and "1 of 16000" in e.value.detail
    for fn in (decoded_frames, float_scan, decode):
        with pytest.raises(AudioError, match="non_finite_audio"):
            fn(data)
    stereo = _wav(np.stack([x, x], axis=1))  # the downmixing path
    with pytest.raises(AudioError, match="non_finite_audio"):
        decode_into(stereo, np.zeros(len(x), dtype))


def test_float_scan_counts_overs_and_the_loader_clips_them_at_full_scale():
    x = _sine()
    x[100:105] = [1.5, -2.0, 1.01, 0.5, 3.0]
    scan = float_scan(_wav(x))
    assert (scan.frames, scan.samples, scan.clipped) == (RATE, RATE, 4) and scan.peak == pytest.approx(3.0)
    f32, i16 = np.zeros(RATE, np.float32), np.zeros(RATE, np.int16)
    decode_into(_wav(x), f32)
    decode_into(_wav(x), i16)
    assert f32[100:105].tolist() == [1.0, -1.0, 1.0, 0.5, 1.0]
    assert i16[100:105].tolist() == [32767, -32768, 32767, 16384, 32767]


def test_integer_and_flac_members_are_not_float_scanned():
    pcm = (_sine() * 32767).astype(np.int16)
    assert float_scan(_wav(pcm, "PCM_16")) is None and float_scan(_wav(pcm, "PCM_16", "FLAC")) is None
    assert decoded_frames(_wav(pcm, "PCM_24")) == RATE


def test_slow_path_without_memfd_scans_the_same(monkeypatch):
    """Platforms without memfd_create read through soundfile's callbacks: same verdicts."""
    monkeypatch.setattr(audio, "FAST_DECODE", False)  # the platform switch, not product behaviour
    x = _sine()
    x[7] = np.nan
    with pytest.raises(AudioError, match="non_finite_audio"):
        decoded_frames(_wav(x))
    assert float_scan(_wav(_sine())).frames == RATE and decoded_frames(_wav(_sine(), "PCM_16")) == RATE

