"""infer/audio_in.py: the audio transcribe/evaluate read, on real files written with soundfile: segments, stereo
mixed down, byte ranges inside a bigger file, windows that cover the audio exactly once (no sliver of a last
window), and each error's reason (the commands on crafted audio: tests/infer/test_transcribe.py)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import soundfile as sf

from shardtrain.format.audio import AudioError
from shardtrain.infer.audio_in import BLOCK_FRAMES, Utterance, probe, read, window_spans, windows
from shardtrain.testing.corpus import synth_wave

RATE = 16000


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio_in")
    mono = synth_wave(10.0, RATE, seed=1)  # 160,000 frames: more than two decode blocks
    sf.write(root / "mono.flac", mono, RATE, subtype="PCM_16")
    left, right = synth_wave(1.0, RATE, seed=2), synth_wave(1.0, RATE, seed=3)
    sf.write(root / "stereo.wav", np.stack([left, right], 1), RATE, subtype="FLOAT")
    wav = (root / "stereo.wav").read_bytes()
    (root / "ark.bin").write_bytes(b"junk" * 100 + wav + b"tail")
    (root / "empty.wav").write_bytes(b"")
    (root / "noise.wav").write_bytes(os.urandom(4000))
    return root, sf.read(root / "mono.flac", dtype="float32")[0], (left + right) / 2, len(wav)


def test_whole_file_segment_and_stereo(files):
    root, mono, mix, _ = files
    p = probe(Utterance("a", str(root / "mono.flac")))
    assert (p.rate_hz, p.start_frame, p.frames, p.duration_s) == (RATE, 0, 160_000, 10.0)
    x, rate = read(Utterance("a", str(root / "mono.flac")), max_frames=10**9)
    assert rate == RATE and np.array_equal(x, mono) and len(x) > 2 * BLOCK_FRAMES
    seg, _ = read(Utterance("a", str(root / "mono.flac"), start_s=2.5, duration_s=1.0), max_frames=10**9)
    assert np.array_equal(seg, mono[40_000:56_000])
    capped, _ = read(Utterance("a", str(root / "mono.flac")), max_frames=1000)
    assert np.array_equal(capped, mono[:1000])
    st, _ = read(Utterance("s", str(root / "stereo.wav")), max_frames=10**9)
    np.testing.assert_allclose(st, mix, atol=1e-6)


def test_byte_range_inside_another_file(files):
    """`#bytes=START-END` is [START, END): the WAV exactly, inside a Kaldi-ark-like file."""
    root, _, mix, n = files
    x, rate = read(Utterance("k", f"{root}/ark.bin#bytes=400-{400 + n}"), max_frames=10**9)
    assert rate == RATE
    np.testing.assert_allclose(x, mix, atol=1e-6)


def test_windows_cover_the_segment_once(files):
    root, mono, _, _ = files
    got = list(windows(Utterance("a", str(root / "mono.flac"), start_s=1.0), window_frames=50_000))
    assert [len(w) for w, _ in got] == [50_000, 50_000, 44_000] and {r for _, r in got} == {RATE}
    assert np.array_equal(np.concatenate([w for w, _ in got]), mono[16_000:])


def test_a_short_tail_is_never_a_window_of_its_own(files):
    """144,000 frames in windows of 71,990 left a 20-frame last window (fewer feature frames than the model's
    convolutions take: the whole file failed); the tail and the last window are now split into two halves."""
    root, mono, _, _ = files
    got = list(windows(Utterance("a", str(root / "mono.flac"), start_s=1.0), window_frames=71_990))
    assert [len(w) for w, _ in got] == [71_990, 36_005, 36_005]
    assert np.array_equal(np.concatenate([w for w, _ in got]), mono[16_000:])
    assert [b - a for a, b in window_spans(144_000, 71_990)] == [71_990, 36_005, 36_005]  # the datasets' cut
    for total in (1, 999, 1000, 1249, 1250, 1251, 2000, 2001, 2250, 2251, 10_007):
        spans = window_spans(total, 1000)
        assert spans[0][0] == 0 and spans[-1][1] == total and all(a == b for (_, a), (b, _) in zip(spans, spans[1:]))
        assert all(250 < b - a <= 1000 for a, b in spans) or total <= 1000, (total, spans)


@pytest.mark.parametrize("name, start_s, reason", [("none.wav", 0.0, "missing_file"), ("empty.wav", 0.0, "empty_audio"),
                                                   ("noise.wav", 0.0, "unreadable_audio"), (".", 0.0, "not_a_file"),
                                                   ("mono.flac", 20.0, "segment_out_of_range")])
def test_errors_carry_their_reason(files, name, start_s, reason):
    root = files[0]
    with pytest.raises(AudioError) as e:
        read(Utterance("x", str(root / name), start_s=start_s), max_frames=10**9)
    assert e.value.reason == reason
