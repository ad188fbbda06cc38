"""shardtrain.pack.probe, pack.transcode and format.audio: probe, keep-original, transcode and decode on real audio written and read by soundfile."""
from __future__ import annotations

import io
from pathlib import Path

import fsspec
import numpy as np
import pytest
import soundfile as sf

from shardtrain.format.audio import AudioError, AudioInfo, decode
from shardtrain.pack.transcode import AudioTarget, encode_for_shard
from shardtrain.pack.probe import mp3_walk_samples, probe
from shardtrain.pack.sources import Item

FORMATS = {"wav": ("WAV", "PCM_16"), "flac": ("FLAC", "PCM_16"), "opus": ("OGG", "OPUS"),
           "mp3": ("MP3", "MPEG_LAYER_III")}
FREQS_HZ = (220.0, 470.0, 1130.0)  # all below 4 kHz: survive resampling to 8 kHz and lossy codecs


def tone(duration_s: float, rate_hz: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    """Sum of sines (+ a little noise), [n, channels] float32; channel c is phase-shifted so channels differ."""
    t = np.arange(round(duration_s * rate_hz)) / rate_hz
    rng = np.random.default_rng(seed)
    chans = [sum(0.2 * np.sin(2 * np.pi * f * t + c) for f in FREQS_HZ) + 0.01 * rng.standard_normal(len(t))
             for c in range(channels)]
    return np.stack(chans, axis=1).astype(np.float32)


def write(path: Path, x: np.ndarray, rate_hz: int) -> Path:
    fmt, subtype = FORMATS[path.suffix[1:]]
    sf.write(path, x, rate_hz, format=fmt, subtype=subtype)
    return path


def corr(a: np.ndarray, b: np.ndarray) -> float:
    n = min(len(a), len(b))
    return float(np.corrcoef(a[:n], b[:n])[0, 1])


# the Opus encoder only takes 8/12/16/24/48 kHz, so 22.05 and 44.1 kHz are not Opus cases
RATE_CASES = [(c, r) for c in ("wav", "flac", "opus", "mp3") for r in (8000, 22050, 44100, 48000)
              if not (c == "opus" and r in (22050, 44100))]


@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize("codec,rate_hz", RATE_CASES)
def test_probe_formats_rates_channels(tmp_path, codec, rate_hz, channels):
    x = tone(0.7, rate_hz, channels)
    info = probe(str(write(tmp_path / f"a.{codec}", x, rate_hz)))
    assert info == AudioInfo(duration_s=len(x) / rate_hz, sample_rate_hz=rate_hz, num_samples=len(x),
                             channels=channels, codec=codec)


def test_probe_remote_url_matches_local(tmp_path):
    path = write(tmp_path / "a.flac", tone(0.5, 16000), 16000)
    fs = fsspec.filesystem("memory")
    fs.pipe("/probe/a.flac", path.read_bytes())
    assert probe("memory://probe/a.flac") == probe(str(path)) == probe(f"file://{path}")


def test_probe_bad_inputs(tmp_path):
    with pytest.raises(AudioError) as e:
        probe(str(tmp_path / "missing.flac"))
    assert e.value.reason == "missing_file"
    with pytest.raises(AudioError) as e:
        probe("memory://nowhere/missing.flac")
    assert e.value.reason == "missing_file"
    sf.write(tmp_path / "zero.wav", np.zeros((0, 1), np.float32), 16000)
    with pytest.raises(AudioError) as e:
        probe(str(tmp_path / "zero.wav"))
    assert e.value.reason == "empty_audio"
    (tmp_path / "empty.flac").write_bytes(b"")
    with pytest.raises(AudioError) as e:
        probe(str(tmp_path / "empty.flac"))
    assert e.value.reason == "empty_audio"
    (tmp_path / "junk.flac").write_bytes(b"not audio at all" * 100)
    with pytest.raises(AudioError) as e:
        probe(str(tmp_path / "junk.flac"))
    assert e.value.reason == "unreadable_audio"


def _drop_first_mp3_frame(data: bytes) -> bytes:
    """Remove the Xing/Info tag frame that libsndfile writes first (no ID3 tag precedes it)."""
    h = int.from_bytes(data[:4], "big")
    assert h >> 21 == 0x7FF and data[:300].find(b"Xing") > 0
    bitrate = (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)[(h >> 12) & 15] * 1000
    return data[72 * bitrate // 16000 + ((h >> 9) & 1):]  # MPEG-2 layer III at 16 kHz


def test_mp3_length_checks(tmp_path):
    """libsndfile trusts the Xing tag (truncated file) or estimates (no tag, VBR): probe must catch both."""
    x = tone(6.0, 16000)
    x[:, 0] += np.random.default_rng(1).standard_normal(len(x)).astype(np.float32) * 0.2  # noise -> VBR frames
    good = write(tmp_path / "good.mp3", x, 16000)
    assert probe(str(good)).num_samples == len(x)
    samples, spf = mp3_walk_samples(good.read_bytes())
    assert spf == 576 and abs(samples - len(x)) < 3 * spf + 2400
    data = good.read_bytes()
    (tmp_path / "trunc.mp3").write_bytes(data[: len(data) // 2])
    with pytest.raises(AudioError) as e:
        probe(str(tmp_path / "trunc.mp3"))
    assert e.value.reason == "truncated_audio"
    (tmp_path / "notag.mp3").write_bytes(_drop_first_mp3_frame(data))
    assert sf.info(str(tmp_path / "notag.mp3")).frames < 0.8 * len(x)  # the libsndfile behaviour we guard against
    with pytest.raises(AudioError) as e:
        probe(str(tmp_path / "notag.mp3"))
    assert e.value.reason == "unreliable_mp3_length"


def test_keep_original_is_byte_identical(tmp_path):
    flac = write(tmp_path / "a.flac", tone(1.0, 16000), 16000)
    data, info = encode_for_shard(Item("a", str(flac), "t"), probe(str(flac)), AudioTarget())
    assert data == flac.read_bytes() and info == probe(str(flac))
    # keep_original keeps a 44.1 kHz stereo wav as is; a duration within the tolerance still means "whole file"
    wav = write(tmp_path / "b.wav", tone(1.0, 44100, 2), 44100)
    item = Item("b", str(wav), "t", duration_s=0.99)
    data, info = encode_for_shard(item, probe(str(wav)), AudioTarget(keep_original=True))
    assert data == wav.read_bytes() and info.sample_rate_hz == 44100 and info.channels == 2 and info.codec == "wav"


def test_truncated_flac_raises_not_pads(tmp_path):
    flac = write(tmp_path / "a.flac", tone(3.0, 16000), 16000)
    data = flac.read_bytes()
    bad = tmp_path / "bad.flac"
    bad.write_bytes(data[: int(len(data) * 0.7)])
    info = probe(str(bad))  # headers only: the STREAMINFO still promises 3 s
    assert info.num_samples == 48000
    for target in (AudioTarget(), AudioTarget(sample_rate_hz=8000)):  # kept-original path and transcode path
        with pytest.raises(AudioError) as e:
            encode_for_shard(Item("bad", str(bad), "t"), info, target)
        assert e.value.reason in ("truncated_audio", "unreadable_audio")


@pytest.mark.parametrize("codec", ["flac", "wav", "opus", "mp3"])
def test_transcode_44k_stereo_to_16k_mono(tmp_path, codec):
    src_rate, dur = 44100, 1.5
    x = tone(dur, src_rate, 2)
    wav = write(tmp_path / "a.wav", x, src_rate)
    data, info = encode_for_shard(Item("a", str(wav), "t"), probe(str(wav)), AudioTarget(codec=codec))
    assert (info.codec, info.sample_rate_hz, info.channels) == (codec, 16000, 1)
    assert abs(info.num_samples - dur * 16000) <= 1 and info.duration_s == info.num_samples / 16000
    y, rate = decode(data)
    assert rate == 16000 and y.ndim == 1 and len(y) == info.num_samples
    assert sf.info(io.BytesIO(data)).frames == info.num_samples
    ref = tone(dur, 16000, 2).mean(axis=1)  # the same analytic signal sampled at 16 kHz, downmixed
    assert corr(y, ref) > 0.9


def test_segment_is_exact_slice_without_resampling(tmp_path):
    x = tone(2.0, 16000)
    pcm = np.round(x[:, 0] * 32767).astype(np.int16)
    wav = tmp_path / "a.wav"
    sf.write(wav, pcm, 16000, subtype="PCM_16")
    item = Item("seg", str(wav), "t", start_s=0.5, duration_s=0.3)
    data, info = encode_for_shard(item, probe(str(wav)), AudioTarget())
    assert info.num_samples == 4800 and info.codec == "flac"
    y, _ = decode(data, dtype="int16")
    np.testing.assert_array_equal(y, pcm[8000:12800])  # 16-bit in, 16-bit out: bit-exact
    # whole file, other codec, same rate: still bit-exact
    data, _ = encode_for_shard(Item("w", str(wav), "t"), probe(str(wav)), AudioTarget(codec="flac"))
    np.testing.assert_array_equal(decode(data, dtype="int16")[0], pcm)


def test_segment_bounds(tmp_path):
    wav = write(tmp_path / "a.wav", tone(1.0, 16000), 16000)
    info = probe(str(wav))
    for item in (Item("a", str(wav), "t", start_s=1.5, duration_s=0.2),
                 Item("b", str(wav), "t", start_s=0.5, duration_s=0.6)):
        with pytest.raises(AudioError) as e:
            encode_for_shard(item, info, AudioTarget())
        assert e.value.reason == "segment_out_of_range"
    # overrun within tolerance is clamped to the file end
    _, out = encode_for_shard(Item("c", str(wav), "t", start_s=0.5, duration_s=0.51), info, AudioTarget())
    assert out.num_samples == 8000


def test_remote_transcode_and_channel_rules(tmp_path):
    path = write(tmp_path / "a.flac", tone(0.5, 48000, 2), 48000)
    fsspec.filesystem("memory").pipe("/enc/a.flac", path.read_bytes())
    info = probe("memory://enc/a.flac")
    data, out = encode_for_shard(Item("a", "memory://enc/a.flac", "t", start_s=0.1), info, AudioTarget())
    assert (out.sample_rate_hz, out.channels, out.num_samples) == (16000, 1, 6400)
    data, out = encode_for_shard(Item("a", str(path), "t"), probe(str(path)), AudioTarget(channels=2))
    assert out.channels == 2 and decode(data)[0].shape == (8000, 2)
    three = tmp_path / "c.wav"
    sf.write(three, tone(0.2, 16000, 3), 16000)
    with pytest.raises(AudioError) as e:
        encode_for_shard(Item("c", str(three), "t"), probe(str(three)), AudioTarget(channels=2))
    assert e.value.reason == "unsupported_channels"


def test_decode_and_target_validation(tmp_path):
    with pytest.raises(AudioError) as e:
        decode(b"")
    assert e.value.reason == "empty_audio"
    with pytest.raises(AudioError) as e:
        decode(b"RIFF0000WAVEjunk")
    assert e.value.reason == "unreadable_audio"
    y, rate = decode(write(tmp_path / "s.flac", tone(0.1, 8000, 2), 8000).read_bytes())
    assert y.shape == (800, 2) and y.dtype == np.float32 and rate == 8000
    with pytest.raises(ValueError, match="--sample-rate 22050 is not allowed"):
        AudioTarget(codec="opus", sample_rate_hz=22050)
    with pytest.raises(ValueError, match="codec"):
        AudioTarget(codec="aac")


def _flac_bytes(pcm: np.ndarray, rate_hz: int = 16000, fmt: str = "FLAC", subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, pcm, rate_hz, format=fmt, subtype=subtype)
    return buf.getvalue()


def test_decode_into_matches_soundfile_and_reports_bad_audio():
    from shardtrain.format import audio

    assert audio.FAST_DECODE, "the GIL-free memfd decoder should be active on Linux"
    rng = np.random.default_rng(0)
    pcm = (rng.standard_normal(24_000) * 3000).astype(np.int16)
    data = _flac_bytes(pcm)
    ref_f = sf.read(io.BytesIO(data), dtype="float32")[0]
    for dtype, ref in ((np.float32, ref_f), (np.int16, pcm)):
        out = np.zeros(len(pcm), dtype)
        assert audio.decode_into(memoryview(data), out) == len(pcm)
        np.testing.assert_array_equal(out, ref)
    # a row shorter than the file takes only its length; the tail of a longer row stays zero
    out = np.zeros(1000, np.float32)
    assert audio.decode_into(data, out) == 1000 and np.array_equal(out, ref_f[:1000])
    out = np.zeros(len(pcm) + 50, np.float32)
    assert audio.decode_into(data, out) == len(pcm) and not out[len(pcm):].any()
    # truncated: fewer samples than the index promises (the caller reports it)
    out = np.zeros(len(pcm), np.float32)
    try:  # libsndfile either stops short or reports lost sync; never a silent full-length decode
        assert audio.decode_into(data[: len(data) // 2], out) < len(pcm)
    except AudioError as e:
        assert "unreadable_audio" in str(e)
    with pytest.raises(AudioError, match="unreadable_audio"):
        audio.decode_into(b"not audio at all" * 64, np.zeros(100, np.float32))
    with pytest.raises(AudioError, match="empty_audio"):
        audio.decode_into(b"", np.zeros(100, np.float32))
    # stereo falls back to the averaging path
    st = np.stack([pcm, (pcm // 2).astype(np.int16)], axis=1)
    out = np.zeros(len(pcm), np.float32)
    assert audio.decode_into(_flac_bytes(st, fmt="WAV"), out) == len(pcm)
    np.testing.assert_allclose(out, sf.read(io.BytesIO(_flac_bytes(st)), dtype="float32")[0].mean(axis=1), atol=1e-6)


@pytest.mark.parametrize("fmt", ["FLAC", "WAV"])
def test_decode_into_threads_and_fork_do_not_share_buffers(fmt):
    """Each thread (and a forked child) needs its own memfd (WAV: libsndfile), and dr_flac's calls (FLAC) must
    be as thread- and fork-safe: a shared buffer would mix members' bytes."""
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    from shardtrain.format import audio

    rng = np.random.default_rng(1)
    pcms = [(rng.standard_normal(int(n)) * 3000).astype(np.int16) for n in rng.integers(2000, 30000, 64)]
    blobs = [_flac_bytes(p, fmt=fmt) for p in pcms]

    def one(i):
        out = np.zeros(len(pcms[i]), np.int16)
        return audio.decode_into(blobs[i], out) == len(pcms[i]) and np.array_equal(out, pcms[i])

    audio.decode_into(blobs[0], np.zeros(len(pcms[0]), np.int16))  # the parent's thread has a decoder now
    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(one, list(range(64)) * 4))
    ctx = multiprocessing.get_context("fork")  # children inherit the parent's decoder and must not write to it

    def child():
        raise SystemExit(0 if all(one(i) for i in range(64)) else 3)

    procs = [ctx.Process(target=child) for _ in range(2)]
    for p in procs:
        p.start()
    assert all(one(i) for i in range(64))  # the parent decodes at the same time
    for p in procs:
        p.join(60)
        assert p.exitcode == 0


def test_flac_goes_through_dr_flac_bit_identical_to_libsndfile(monkeypatch):
    """The FLAC fast path (dr_flac) writes the same float32 and int16 samples as libsndfile and counts the same
    frames; without miniaudio (DR_FLAC None) libsndfile decodes FLAC as before."""
    from shardtrain.format import audio

    assert audio.DR_FLAC is not None, "miniaudio (a runtime dependency) should provide dr_flac"
    rng = np.random.default_rng(2)
    for n in (1, 4095, 4096, 48_017):
        pcm = (rng.standard_normal(n) * 4000).clip(-32768, 32767).astype(np.int16)
        data = _flac_bytes(pcm)
        for dtype in (np.float32, np.int16):
            fast, ref = np.zeros(n, dtype), np.zeros(n, dtype)
            assert audio.DR_FLAC.decode_into(memoryview(data), fast) == n
            assert audio._decoder().decode_into(data, ref) == n  # libsndfile on a memfd
            assert fast.tobytes() == ref.tobytes()
        assert audio.DR_FLAC.decoded_frames(data) == audio._decoder().decoded_frames(data) == n
    assert audio.DR_FLAC.decode_into(b"RIFF" + bytes(60), np.zeros(10, np.float32)) is None  # not FLAC: refused
    # 24-bit FLAC: the same samples too; stereo FLAC: dr_flac declines (-channels), libsndfile downmixes
    deep = _flac_bytes(pcm.astype(np.int32) << 8, subtype="PCM_24")
    fast, ref = np.zeros(len(pcm), np.float32), np.zeros(len(pcm), np.float32)
    assert audio.DR_FLAC.decode_into(deep, fast) == audio._decoder().decode_into(deep, ref) == len(pcm)
    assert fast.tobytes() == ref.tobytes()
    stereo = _flac_bytes(np.stack([pcm, pcm // 3], axis=1))
    assert audio.DR_FLAC.decode_into(stereo, np.zeros(len(pcm), np.float32)) == -2
    out = np.zeros(len(pcm), np.float32)
    assert audio.decode_into(stereo, out) == len(pcm)
    np.testing.assert_array_equal(out, sf.read(io.BytesIO(stereo), dtype="float32")[0].mean(axis=1))
    monkeypatch.setattr(audio, "DR_FLAC", None)
    out = np.zeros(len(pcm), np.float32)
    assert audio.decode_into(data, out) == len(pcm) and np.array_equal(out, pcm / np.float32(32768))
    assert audio.decoded_frames(data) == len(pcm)


def test_damaged_flac_frames_read_short():
    """A damaged byte anywhere in the audio frames fails that frame's CRC and dr_flac leaves the frame out, so
    the loader's count check and the packer's decode check both see fewer samples than the header claims."""
    from shardtrain.format import audio
    from shardtrain.pack.tailcheck import _metadata_end

    rng = np.random.default_rng(3)
    pcm = (rng.standard_normal(80_000) * 3000).astype(np.int16)
    data = _flac_bytes(pcm)
    start = _metadata_end(data)
    assert start is not None
    for pos in rng.integers(start, len(data), 40):
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        out = np.zeros(len(pcm), np.float32)
        assert audio.decode_into(bytes(bad), out) < len(pcm), pos
        assert audio.decoded_frames(bytes(bad)) < len(pcm), pos


@pytest.mark.parametrize("dtype", ["float32", "int16"])
def test_the_loader_refuses_stored_channels_that_cancel_in_its_mono(dtype):
    """Stored stereo (pack --channels 2) becomes the mean of its channels in a batch; channels in opposite polarity
    would be silence under the transcript: a decode error (`cancelled_downmix`, a counted skip in the loader), while
    ordinary stereo decodes to the mean of its channels."""
    from shardtrain.format.audio import decode_into

    x = tone(0.5, 16000, 1)[:, 0] * 0.5
    for channels, expect_mean in (([x, 0.8 * x], 0.9 * x), ([x, -x], None)):
        buf = io.BytesIO()
        sf.write(buf, np.stack(channels, axis=1), 16000, format="FLAC", subtype="PCM_16")
        out = np.zeros(len(x), dtype)
        if expect_mean is None:
            with pytest.raises(AudioError) as e:
                decode_into(buf.getvalue(), out)
            assert e.value.reason == "cancelled_downmix"
            continue
        assert decode_into(buf.getvalue(), out) == len(x)
        got = out / 32768.0 if dtype == "int16" else out
        assert np.abs(got - expect_mean).max() < 2e-4
