"""Real speech for the demo and tests: espeak-ng voices speaking fortune or template sentences.

`synth_speech_corpus`: varied voices, speeds and pitches, 16 kHz mono FLAC in the LibriSpeech layout or flat,
with transcripts normalised like LibriSpeech (UPPERCASE, apostrophes, spaces) and TSV/JSONL manifests. A model can
actually learn from it, which is what the demo needs. About 2,000 short utterances per ~30-60 s on 2 cores
(espeak-ng is ~10 ms per sentence; resampling + FLAC encode ~2 ms). Needs Debian's espeak-ng (and fortunes for
varied text); missing tools raise with the apt-get line to run.
"""
from __future__ import annotations

import io
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
from shardtrain.testing.corpus import _sub_seed, pseudo_sentence, write_manifests
from shardtrain.testing.corpus import librispeech_text


log = logging.getLogger(__name__)


# ---- real speech with espeak-ng ------------------------------------------------------------------------------
_PREFERRED_VOICES = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-us-nyc", "en-gb-x-gbclan",
                     "en-gb-x-gbcwmd")
_VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m7", "f1", "f2", "f3", "f4", "f5")
_FORTUNE_DIR = Path("/usr/share/games/fortunes")
_ESPEAK_RATE_HZ = 22050


@dataclass(frozen=True, kw_only=True, slots=True)
class _Utt:
    rel_path: str
    text: str
    speaker: str
    voice: str
    speed_wpm: int
    pitch: int


def _espeak() -> str:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("espeak-ng not found: install with apt-get install espeak-ng, "
                           "or use make_corpus for tone audio")
    return exe


def _available_voices(exe: str) -> tuple[list[str], list[str]]:
    """(base voices, variants) from the preferred lists that this espeak-ng has (mbrola voices excluded)."""
    out = subprocess.run([exe, "--voices=en"], capture_output=True, text=True, check=True).stdout
    langs = {cols[1] for cols in (line.split() for line in out.splitlines()[1:])
             if len(cols) >= 5 and not cols[4].startswith("mb/")}
    voices = [v for v in _PREFERRED_VOICES if v in langs] or ["en"]
    out = subprocess.run([exe, "--voices=variant"], capture_output=True, text=True, check=True).stdout
    files = {line.split()[-1].rsplit("/", 1)[-1] for line in out.splitlines()[1:] if line.split()}
    return voices, [v for v in _VARIANTS if v in files]


def load_fortune_sentences(max_words: int = 18) -> list[str]:
    """Short plain-ASCII fortunes (attributions cut), normalised; [] when the fortunes package is absent."""
    if not _FORTUNE_DIR.is_dir():
        return []
    out: set[str] = set()
    for path in sorted(_FORTUNE_DIR.iterdir()):
        if path.suffix or not path.is_file():  # skip .dat/.u8 and the off/ folder
            continue
        try:
            raw = path.read_text(encoding="ascii")
        except (UnicodeDecodeError, OSError):
            continue
        for fortune in raw.split("\n%\n"):
            body = fortune.split("--")[0]
            if re.search(r"[^A-Za-z ,.;:!?'\"\n-]", body) or re.search(r"\n\s", body):
                continue  # digits, symbols, code, verse indentation: not plain spoken text
            text = librispeech_text(body)
            if 3 <= len(text.split()) <= max_words:
                out.add(text)
    return sorted(out)


def _utterance_specs(n: int, seed: int, layout: str, voices: list[str], variants: list[str],
                     sentences: list[str]) -> list[_Utt]:
    """Pure: speakers (voice, variant, speed, pitch), chapters, texts and paths for n utterances."""
    rng = np.random.default_rng(seed)
    n_speakers = max(1, min(40, round(math.sqrt(n))))
    speaker_ids = sorted(int(x) for x in rng.choice(np.arange(100, 10000), n_speakers, replace=False))
    speakers = []
    for k, sid in enumerate(speaker_ids):
        voice = voices[k % len(voices)]
        if variants:
            voice += "+" + variants[int(rng.integers(len(variants)))]
        chapters = sorted(int(x) for x in rng.choice(np.arange(1000, 100000), 2, replace=False))
        speakers.append((str(sid), voice, int(rng.integers(140, 181)), int(rng.integers(30, 71)), chapters))
    per_speaker = [len(range(k, n, n_speakers)) for k in range(n_speakers)]
    counters: dict[tuple[int, int], int] = {}
    utts = []
    for i in range(n):
        k, j = i % n_speakers, i // n_speakers
        spk, voice, speed, pitch, chapters = speakers[k]
        chapter = chapters[min(1, 2 * j // max(1, per_speaker[k]))]  # first half of a speaker's utts: chapter 0
        u = counters[(k, chapter)] = counters.get((k, chapter), -1) + 1
        urng = np.random.default_rng(_sub_seed(seed, i))
        if sentences:
            text = sentences[int(urng.integers(len(sentences)))]
        else:
            text = pseudo_sentence(urng)
        utt_id = f"{spk}-{chapter}-{u:04d}"
        rel = f"{spk}/{chapter}/{utt_id}.flac" if layout == "librispeech" else f"{utt_id}.flac"
        speed = int(np.clip(speed + urng.integers(-10, 11), 130, 190))
        utts.append(_Utt(rel_path=rel, text=text, speaker=spk, voice=voice, speed_wpm=speed, pitch=pitch))
    return utts


def _speak(exe: str, utt: _Utt, root: Path, sample_rate_hz: int) -> float:
    """espeak-ng -> WAV bytes on stdout -> resample -> 16-bit FLAC; returns the duration in seconds."""
    import torch
    import torchaudio.functional as AF

    # lowercase for espeak: it spells out short all-caps words as acronyms ("US" -> "U S")
    cmd = [exe, "-v", utt.voice, "-s", str(utt.speed_wpm), "-p", str(utt.pitch), "--stdout", utt.text.lower()]
    proc = subprocess.run(cmd, capture_output=True, check=False)
    if proc.returncode != 0 or len(proc.stdout) < 100:
        raise RuntimeError(f"espeak-ng failed for {utt.rel_path} ({' '.join(cmd[:7])}): "
                           f"{proc.stderr.decode(errors='replace')[-500:]}")
    wave, rate = sf.read(io.BytesIO(proc.stdout), dtype="float32")
    if wave.ndim > 1:
        wave = wave.mean(axis=1)
    if rate != sample_rate_hz:
        wave = AF.resample(torch.from_numpy(wave), rate, sample_rate_hz).numpy()
    out = root / utt.rel_path
    out.parent.mkdir(parents=True, exist_ok=True)
    sf.write(out, np.clip(wave, -1.0, 1.0), sample_rate_hz, format="FLAC", subtype="PCM_16")
    return len(wave) / sample_rate_hz


def _write_transcripts(root: Path, utts: list[_Utt], layout: str) -> None:
    """LibriSpeech `<spk>-<chapter>.trans.txt` files or one `.txt` per utterance, plus manifest.tsv/.jsonl."""
    if layout == "librispeech":
        chapters: dict[Path, list[str]] = {}
        for u in utts:
            p = root / u.rel_path
            chapters.setdefault(p.parent / f"{p.parent.parent.name}-{p.parent.name}.trans.txt", []).append(
                f"{p.stem} {u.text}")
        for trans, lines in chapters.items():
            trans.write_text("\n".join(sorted(lines)) + "\n", encoding="utf-8")
    else:
        for u in utts:
            (root / u.rel_path).with_suffix(".txt").write_text(u.text + "\n", encoding="utf-8")
    write_manifests(root, [(u.rel_path, u.text, u.speaker) for u in utts])


def synth_speech_corpus(
    dir: str | os.PathLike,
    n: int,
    *,
    seed: int = 0,
    workers: int = 2,
    layout: str = "librispeech",
    sample_rate_hz: int = 16000,
    progress: bool = True,
    text_source: str = "auto",
) -> Path:
    """n utterances of espeak-ng speech as mono 16-bit FLAC with transcripts; returns the folder.

    layout "librispeech": DIR/<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac + <speaker>-<chapter>.trans.txt;
    layout "flat": DIR/<id>.flac + DIR/<id>.txt. Both write DIR/manifest.tsv and manifest.jsonl.
    About sqrt(n) speakers (at most 40), each a voice+variant with its own pitch and base speed (130-190 wpm),
    two chapters per speaker. text_source: "auto" (fortunes when /usr/share/games/fortunes exists, else
    built-in templates), "fortunes" or "builtin" (the same text on every machine, for reproducible tests).
    Deterministic for a given machine's espeak-ng and text source. Cost: ~15-30 ms per utterance per worker.
    """
    if layout not in ("librispeech", "flat"):
        raise ValueError(f"synth_speech_corpus: layout must be 'librispeech' or 'flat', got {layout!r}")
    if text_source not in ("auto", "fortunes", "builtin"):
        raise ValueError(f"synth_speech_corpus: text_source must be auto|fortunes|builtin, got {text_source!r}")
    if n < 1 or workers < 1:
        raise ValueError("synth_speech_corpus: n and workers must be >= 1")
    exe = _espeak()
    t0 = time.perf_counter()
    voices, variants = _available_voices(exe)
    sentences = [] if text_source == "builtin" else load_fortune_sentences()
    if text_source == "fortunes" and not sentences:
        raise RuntimeError(f"text_source='fortunes' but no usable fortunes under {_FORTUNE_DIR} "
                           "(apt-get install fortunes)")
    utts = _utterance_specs(n, seed, layout, voices, variants, sentences)
    root = Path(dir)
    root.mkdir(parents=True, exist_ok=True)

    from tqdm import tqdm

    bar = tqdm(total=n, unit="utt", desc="espeak-ng", disable=not progress or not sys.stderr.isatty())
    total_s = 0.0
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for seconds in pool.map(lambda u: _speak(exe, u, root, sample_rate_hz), utts):
            total_s += seconds
            bar.update(1)
    bar.close()

    _write_transcripts(root, utts, layout)
    elapsed = time.perf_counter() - t0
    log.info("synth_speech_corpus: %d utterances, %.2f h of audio, %d speakers in %.1f s (%.0f utt/s) -> %s",
             n, total_s / 3600, len({u.speaker for u in utts}), elapsed, n / elapsed, root)
    return root
