"""Generated tone corpora, shared by tests, benchmarks and the demo: nothing downloaded, nothing committed.

`synth_wave` / `make_corpus`: speech-like tones (harmonics + vibrato + syllable envelope + a little noise) in any
codec soundfile writes (wav, flac, opus, mp3), with pseudo-sentence transcripts. Milliseconds per file, no system
tools, byte-deterministic for wav/flac (see `make_corpus` for opus/mp3). Manifests (`manifest.tsv`,
`manifest.jsonl`) have the columns path, text, speaker; `path` is relative to the folder holding the manifest.
Real speech (espeak-ng) is in speech.py.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import soundfile as sf


log = logging.getLogger(__name__)

# soundfile (format, subtype) and file extension per codec name; "ogg" is an alias of opus (Ogg container).
_FORMATS = {
    "wav": ("WAV", "PCM_16", "wav"),
    "flac": ("FLAC", "PCM_16", "flac"),
    "opus": ("OGG", "OPUS", "opus"),
    "ogg": ("OGG", "OPUS", "opus"),
    "mp3": ("MP3", "MPEG_LAYER_III", "mp3"),
}
_OPUS_RATES_HZ = (8000, 12000, 16000, 24000, 48000)

_WORDS = {
    "adj": "quiet bright little old young green cold warm heavy gentle silent early happy narrow distant "
           "simple strange golden wooden broken careful honest patient steady".split(),
    "noun": "river garden window captain morning letter village teacher station mountain kitchen shadow "
            "doctor engine island market pocket summer harbour lantern forest student bridge painter".split(),
    "verb": "watched carried followed opened painted found remembered answered crossed visited cleaned "
            "described noticed reached gathered borrowed lifted".split(),
    "prep": "near behind beside under across above toward past".split(),
    "adv": "slowly quickly quietly suddenly carefully again never always".split(),
    "name": "anna thomas mary james helen peter clara william sarah george".split(),
}
_TEMPLATES = (
    "the {adj} {noun} {verb} the {noun} {prep} the {noun}",
    "{name} {verb} a {adj} {noun} {adv}",
    "we {verb} the {noun} {prep} the {adj} {noun} and then we {verb} it {adv}",
    "{name} said that the {noun} was {adj}",
    "it was {adj} when {name} {verb} the {noun}",
    "they {adv} {verb} the {adj} {noun} {prep} the old {noun} by the {noun}",
    "the {noun} is {adj}",
    "{name} and {name} {verb} the {noun} {prep} a {adj} {noun} before the {noun} was {adj} again",
    "don't forget the {adj} {noun}",
)


def synth_wave(duration_s: float, sample_rate_hz: int = 16000, seed: int = 0) -> np.ndarray:
    """Speech-like mono float32 wave of round(duration_s * rate) samples, peak about 0.3.

    A gliding f0 (90-240 Hz, 3% vibrato, slow intonation drift) with 5 decaying harmonics, shaped by a 3-5 Hz
    syllable envelope, plus noise at -35 dB: codecs and features behave roughly as on speech, not as on a pure
    sine. Deterministic in (duration_s, sample_rate_hz, seed).
    """
    if duration_s < 0 or sample_rate_hz <= 0:
        raise ValueError(f"synth_wave: duration_s must be >= 0 and sample_rate_hz > 0, got {duration_s}, "
                         f"{sample_rate_hz}")
    rng = np.random.default_rng(seed)
    n = int(round(duration_s * sample_rate_hz))
    t = np.arange(n) / sample_rate_hz
    f0 = rng.uniform(90, 240)
    vibrato = 1 + 0.03 * np.sin(2 * np.pi * rng.uniform(4, 7) * t + rng.uniform(0, 2 * np.pi))
    drift = 1 + 0.08 * np.sin(2 * np.pi * rng.uniform(0.2, 0.6) * t + rng.uniform(0, 2 * np.pi))
    phase = 2 * np.pi * np.cumsum(f0 * vibrato * drift) / sample_rate_hz
    wave = np.zeros(n)
    for k in range(1, 6):
        wave += rng.uniform(0.5, 1.0) / k * np.sin(k * phase + rng.uniform(0, 2 * np.pi))
    wave *= 0.25 + 0.75 * np.abs(np.sin(np.pi * rng.uniform(3, 5) * t + rng.uniform(0, np.pi)))
    peak = np.abs(wave).max() if n else 1.0
    wave = 0.3 * wave / max(peak, 1e-9) + 0.005 * rng.standard_normal(n)
    fade = min(n // 2, int(0.01 * sample_rate_hz))
    if fade:
        ramp = np.linspace(0.0, 1.0, fade)
        wave[:fade] *= ramp
        wave[n - fade:] *= ramp[::-1]
    return wave.astype(np.float32)


def pseudo_sentence(rng: np.random.Generator) -> str:
    """A plain English sentence from built-in templates, normalised like LibriSpeech."""
    template = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))]
    text = re.sub(r"\{(\w+)\}", lambda m: str(rng.choice(_WORDS[m.group(1)])), template)
    return librispeech_text(text)


SPOKEN_CHARS_PER_S = 20.0
"""Characters a second the generated transcripts stay under (read speech runs ~15): pack rejects transcripts no
CTC model could align (`impossible_target`), so a corpus pairing 0.2 s of audio with a 90-character sentence
would lose its short clips."""


def fit_words(text: str, duration_s: float) -> str:
    """The leading words of `text` that a speaker could say in `duration_s` (SPOKEN_CHARS_PER_S, at least one)."""
    budget = max(20.0, SPOKEN_CHARS_PER_S * duration_s)
    words = text.split()
    out = words[:1]
    for w in words[1:]:
        if len(" ".join(out)) + 1 + len(w) > budget:
            break
        out.append(w)
    return " ".join(out)


def librispeech_text(text: str) -> str:
    """LibriSpeech-style transcript: UPPERCASE letters, in-word apostrophes and single spaces only."""
    text = re.sub(r"[^A-Z']+", " ", text.upper())
    words = (w.strip("'") for w in text.split())
    return " ".join(w for w in words if w)


def _sub_seed(seed: int, i: int) -> int:
    return int(np.random.SeedSequence([seed, i]).generate_state(1)[0])


def write_manifests(root: Path, rows: Sequence[tuple[str, str, str]]) -> None:
    """`manifest.tsv` (header + path, text, speaker) and `manifest.jsonl` in `root`; paths relative to root."""
    with open(root / "manifest.tsv", "w", encoding="utf-8") as f:
        f.write("path\ttext\tspeaker\n")
        for path, text, speaker in rows:
            f.write(f"{path}\t{text}\t{speaker}\n")
    with open(root / "manifest.jsonl", "w", encoding="utf-8") as f:
        for path, text, speaker in rows:
            f.write(json.dumps({"path": path, "text": text, "speaker": speaker}, sort_keys=True) + "\n")


def make_corpus(
    dir: str | os.PathLike,
    durations_s: Sequence[float],
    *,
    sample_rate_hz: int = 16000,
    fmt: str = "flac",
    channels: int = 1,
    seed: int = 0,
    text_fn: Callable[[int], str] | None = None,
) -> Path:
    """Write `utt-00000.<ext>` + `utt-00000.txt` per duration, plus manifest.tsv/.jsonl; returns the folder.

    fmt: wav | flac | opus (alias ogg; Ogg container, extension .opus) | mp3. wav and flac are byte-identical for
    the same arguments; opus/mp3 decode to a slightly different length (codec pre-skip/padding) and their bytes
    depend on the libsndfile build. Speakers cycle spk0..spk2. Transcripts are pseudo-sentences cut to what could be
    said in the clip (fit_words); text_fn(i) overrides them.
    """
    if fmt not in _FORMATS:
        raise ValueError(f"make_corpus: fmt must be one of {sorted(_FORMATS)}, got {fmt!r}")
    major, subtype, ext = _FORMATS[fmt]
    if ext == "opus" and sample_rate_hz not in _OPUS_RATES_HZ:
        raise ValueError(f"make_corpus: opus needs sample_rate_hz in {_OPUS_RATES_HZ}, got {sample_rate_hz}")
    if channels < 1:
        raise ValueError("make_corpus: channels must be >= 1")
    root = Path(dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, duration_s in enumerate(durations_s):
        sub = _sub_seed(seed, i)
        chans = [synth_wave(duration_s, sample_rate_hz, seed=sub + c) for c in range(channels)]
        wave = chans[0] if channels == 1 else np.stack(chans, axis=1)
        name = f"utt-{i:05d}"
        sf.write(root / f"{name}.{ext}", wave, sample_rate_hz, format=major, subtype=subtype)
        text = text_fn(i) if text_fn is not None else fit_words(pseudo_sentence(np.random.default_rng(sub)),
                                                                 duration_s)
        text = " ".join(text.split())  # no tabs/newlines: they would break the TSV
        (root / f"{name}.txt").write_text(text + "\n", encoding="utf-8")
        rows.append((f"{name}.{ext}", text, f"spk{i % 3}"))
    write_manifests(root, rows)
    log.info("make_corpus: %d %s files, %.1f s of audio in %s", len(rows), ext, float(sum(durations_s)), root)
    return root
