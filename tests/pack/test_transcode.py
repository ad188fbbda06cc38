"""pack/transcode.py: what a shard stores for one item, on real files written with soundfile: a matching whole
FLAC kept byte for byte, a 16-bit WAV copied exactly into FLAC, a segment cut, a stereo file downmixed or one
channel picked, a 44.1 kHz file resampled, a float file at its level, and the refusals (channels, truncation)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from shardtrain.format.audio import AudioError
from shardtrain.pack.config import AudioTarget
from shardtrain.pack.item import Item
from shardtrain.pack.probe import probe
from shardtrain.pack.transcode import encode_for_shard

RATE = 16000


def _tone(seconds: float, rate: int = RATE, amp: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def _encode(path, target=AudioTarget(), **item_kw):
    item = Item(id=path.stem, audio=str(path), text="t", **item_kw)
    data, info = encode_for_shard(item, probe(str(path)), target)
    x, rate = sf.read(io.BytesIO(data), dtype="int16", always_2d=True)
    return data, info, x, rate


def test_matching_flac_is_kept_and_pcm_wav_is_copied_exactly(tmp_path):
    pcm = (_tone(0.5) * 32767).astype(np.int16)
    sf.write(tmp_path / "a.flac", pcm, RATE, subtype="PCM_16")
    data, info, x, _ = _encode(tmp_path / "a.flac")
    assert data == (tmp_path / "a.flac").read_bytes() and info.codec == "flac"  # kept: not re-encoded
    sf.write(tmp_path / "b.wav", pcm, RATE, subtype="PCM_16")
    data, info, x, rate = _encode(tmp_path / "b.wav")
    assert data[:4] == b"fLaC" and (info.codec, info.sample_rate_hz, info.num_samples) == ("flac", RATE, len(pcm))
    np.testing.assert_array_equal(x[:, 0], pcm)  # 16-bit through as int16: lossless
    _, info, x, _ = _encode(tmp_path / "b.wav", start_s=0.1, duration_s=0.2)  # a segment of the file
    np.testing.assert_array_equal(x[:, 0], pcm[1600:4800])
    assert info.num_samples == 3200


def test_stereo_is_downmixed_or_a_channel_picked_and_rates_resampled(tmp_path):
    left, right = _tone(0.5), np.zeros(int(0.5 * RATE), np.float32)
    sf.write(tmp_path / "st.wav", np.stack([left, right], axis=1), RATE, subtype="PCM_16")
    _, info, mixed, _ = _encode(tmp_path / "st.wav")
    _, _, first, _ = _encode(tmp_path / "st.wav", AudioTarget(channel_policy="first"))
    assert info.channels == 1 and mixed.shape == first.shape == (len(left), 1)
    assert np.abs(first).max() == pytest.approx(2 * np.abs(mixed).max(), rel=0.01)  # the mix halves one side
    with pytest.raises(AudioError, match="missing_channel"):
        _encode(tmp_path / "st.wav", AudioTarget(channel_policy="2"))
    with pytest.raises(AudioError, match="unsupported_channels"):
        sf.write(tmp_path / "three.wav", np.zeros((RATE, 3), np.float32), RATE, subtype="PCM_16")
        _encode(tmp_path / "three.wav", AudioTarget(channels=2))
    sf.write(tmp_path / "hi.wav", _tone(0.5, 44100), 44100, subtype="PCM_16")
    _, info, x, rate = _encode(tmp_path / "hi.wav")
    assert rate == RATE and info.sample_rate_hz == RATE and abs(len(x) - RATE // 2) <= 1
    spectrum = np.abs(np.fft.rfft(x[:, 0].astype(np.float64)))
    assert abs(np.argmax(spectrum) * RATE / len(x) - 440) < 5  # the tone survives resampling


def test_float_source_keeps_its_level_and_a_truncated_flac_is_refused(tmp_path):
    sf.write(tmp_path / "f.wav", _tone(0.5, amp=0.25), RATE, subtype="FLOAT")
    _, _, x, _ = _encode(tmp_path / "f.wav")
    assert np.abs(x).max() == pytest.approx(0.25 * 32768, rel=0.01)  # not -1/0/+1 (~90 dB down)
    sf.write(tmp_path / "t.flac", (_tone(2.0) * 32767).astype(np.int16), RATE, subtype="PCM_16")
    full = (tmp_path / "t.flac").read_bytes()
    info = probe(str(tmp_path / "t.flac"))
    (tmp_path / "t.flac").write_bytes(full[: len(full) // 2])  # the header still claims 2 s
    with pytest.raises(AudioError):
        encode_for_shard(Item(id="t", audio=str(tmp_path / "t.flac"), text="t"), info, AudioTarget())


def test_channels_that_cancel_in_the_mix_are_refused_not_stored_as_silence(tmp_path):
    """A stereo file whose channels are in opposite polarity (a miswired balanced cable) mixes to ~0: stored, it
    would be silence under a transcript. The mix is refused with the fix; picking a channel still packs it, and a
    silent file or one with an attenuated (but not inverted) side mixes as before."""
    tone = _tone(0.5)
    sf.write(tmp_path / "anti.wav", np.stack([tone, -tone], axis=1), RATE, subtype="PCM_16")
    with pytest.raises(AudioError) as e:
        _encode(tmp_path / "anti.wav")
    assert e.value.reason == "cancelled_downmix" and "--channels-policy" in e.value.detail
    _, _, first, _ = _encode(tmp_path / "anti.wav", AudioTarget(channel_policy="first"))
    assert np.abs(first).max() == pytest.approx(0.3 * 32768, rel=0.01)
    sf.write(tmp_path / "anti4.wav", np.stack([tone, -tone, tone, -tone], axis=1), RATE, subtype="FLOAT")
    with pytest.raises(AudioError, match="cancelled_downmix"):
        _encode(tmp_path / "anti4.wav")
    sf.write(tmp_path / "quiet.wav", np.zeros((RATE // 2, 2), np.float32), RATE, subtype="PCM_16")
    assert not _encode(tmp_path / "quiet.wav")[2].any()
    sf.write(tmp_path / "soft.wav", np.stack([tone, -0.9 * tone], axis=1), RATE, subtype="PCM_16")
    _, _, soft, _ = _encode(tmp_path / "soft.wav")  # 26 dB down: a real mix, kept
    assert np.abs(soft).max() == pytest.approx(0.05 * 0.3 * 32768, rel=0.05)


def test_gsm_wav_that_libsndfile_cannot_seek_packs_and_loads(tmp_path):
    """GSM 6.10 WAV (telephony corpora): libsndfile cannot seek it, and the seek-based tail check rejected every
    such file as truncated_audio. It is read through in blocks now; a cut one is still truncated_audio."""
    from shardtrain.format.manifest import open_dataset
    from shardtrain.load.reader import read_members
    from shardtrain.pack.packer import PackConfig, pack

    rate = 8000
    x = (0.3 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)).astype(np.float32)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    sf.write(corpus / "a.wav", x, rate, subtype="GSM610")
    (corpus / "a.txt").write_text("a tone\n")
    whole = (corpus / "a.wav").read_bytes()
    (corpus / "cut.wav").write_bytes(whole[: len(whole) // 2])
    (corpus / "cut.txt").write_text("half a tone\n")
    res = pack(PackConfig(input=str(corpus), output=str(tmp_path / "ds"), workers=1, progress=False,
                          audio=AudioTarget(sample_rate_hz=rate)))
    assert res.samples == 1 and dict(res.rejects_by_reason) == {"truncated_audio": 1}, res.rejects_by_reason
    with sf.SoundFile(corpus / "a.wav") as f:
        want = f.read(frames=f.frames, dtype="float32")
    (m,) = list(read_members(open_dataset(str(tmp_path / "ds")), [0]))
    assert m.error is None and len(m.samples) == len(want)
    assert np.abs(m.samples - want).max() < 1e-3  # the GSM decode, stored as 16-bit FLAC
    from shardtrain.format.audio import decode

    got, got_rate = decode(whole)  # a GSM member kept as is (--codec wav): read() needs its frames
    assert got_rate == rate and len(got) == len(want) and np.abs(got - want).max() < 1e-6
