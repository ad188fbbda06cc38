"""Transcribe audio files, folders, corpora and shardtrain datasets with a trained model, batched by duration.

    INPUTS: audio file | folder (searched recursively) | UtteranceSource | dataset (manifest.json; local or s3://)
      files, folders -> UtteranceSource (key = file stem, or its path for a stem seen twice; reference =
                        <stem>.txt/.lab or a *.trans.txt line)
      UtteranceSource (what the CLI builds with pack's readers from a Kaldi data dir -- segments and text honoured --,
                       a Common Voice release, a Hugging Face dataset or a tsv/jsonl manifest)
        -> probe headers (audio_in.probe: rate, claimed frames; no decode)
        -> short ones (<= window_seconds): group by rate, sort by duration, batches under max_batch_seconds of
           *padded* audio -> decoded block by block (audio_in.read) -> one forward pass per batch
        -> long ones: decoded and run window by window (audio_in.windows), frame-level best paths concatenated,
           then collapsed (greedy CTC over the whole file): memory is one window, whatever the file's length
      datasets: the training loader itself (one epoch, one rank, every utterance), texts = references; an
           utterance longer than window_seconds (decoded whole by the loader: its samples, bounded by what pack
           admitted) goes through the model window by window as well
      -> one row per utterance: {key, text, duration_s, source[, reference, cer]} or {key, source, error}

Rows come in processing order (per input, shortest first within a sample rate), not input order: sorting by
duration is what keeps padding, and time, low. Every per-utterance failure (unreadable or lying audio, a segment
out of range, a reader's reject, a batch the model failed on) is a row with an `error` field ("reason: detail"),
logged and recorded in `Transcriber.errors` (the CLI exits 1 when there are any); never a traceback.

Windows do not overlap: a word cut by a window border is decoded from two halves with less context each, which
costs a little accuracy at the borders (one border per `window_seconds`). A tail shorter than a quarter window is
never run alone (too few frames for the model's convolutions: the whole file failed); it and the last window are
split into two halves (audio_in.window_spans, the same cut for files and datasets). A model's frame-level outputs are
concatenated across windows before the CTC collapse, so nothing else changes. `cer` in a row is computed after the
model's text normaliser (the tokenizer's, train/normalize.py) on both sides; `reference` is the raw transcript.
Cost: per batch or window one forward pass; decoding runs in the calling thread (inference dominates).
"""
from __future__ import annotations

import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

from shardtrain import storage
from shardtrain.format.audio import AudioError
from shardtrain.format.manifest import open_dataset
from shardtrain.infer.audio_in import Probe, Utterance, probe, read, window_spans, windows
from shardtrain.infer.checkpoint_model import TrainedModel
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.train.normalize import TextNormConfig
from shardtrain.train.text import BLANK, edit_distance, normalize_text
from shardtrain.world import World

log = logging.getLogger(__name__)

AUDIO_EXTS = (".flac", ".wav", ".opus", ".ogg", ".mp3")
REFERENCE_EXTS = (".txt", ".lab")
"""Transcript files beside an audio file (`<stem>.txt`, `<stem>.lab`, any case)."""
MAX_REFERENCE_BYTES = 1 << 20
"""A reference file larger than this (1 MiB) is not a transcript: it is ignored (logged)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TranscribeConfig:
    max_batch_seconds: float = 120.0
    """Padded audio seconds per batch (longest x count); an utterance longer than this goes alone."""
    window_seconds: float = 30.0
    """Audio longer than this is decoded and run window by window (see the module docstring): the bound on
    the samples and activations held at once, whatever the file's length (a 2 h file: 240 windows)."""
    progress: bool = True
    """tqdm bar over audio seconds (only when stderr is a terminal)."""
    storage_options: dict | None = field(default=None, repr=False)  # may hold keys: never in a repr
    """fsspec options for s3:// datasets."""

    def __post_init__(self) -> None:
        if self.max_batch_seconds <= 0:
            raise ValueError("--max-batch-seconds must be > 0")
        if self.window_seconds <= 0:
            raise ValueError("--window-seconds must be > 0")


@dataclass(frozen=True, slots=True)
class UtteranceSource:
    """Utterances of one input (a name for the `source` field), with what its reader rejected: (key, reason)."""

    name: str
    items: Sequence[Utterance]
    rejects: Sequence[tuple[str, str]] = ()


@dataclass(slots=True)
class AudioBatch:
    keys: list[str]
    refs: list[str | None]
    waves: torch.Tensor
    """float32 [B, T], zero-padded."""
    lengths: torch.Tensor
    """int64 [B], samples."""
    rate_hz: int
    source: str


@dataclass(frozen=True, slots=True)
class _File:
    path: Path | str
    """The audio reference (ties in duration are broken by it)."""
    duration_s: float
    rate_hz: int
    utt: Utterance | None = field(default=None, compare=False)
    probe: Probe | None = field(default=None, compare=False)


def is_dataset(url: str, storage_options: dict | None = None) -> bool:
    return storage.exists(storage.join(url, "manifest.json"), storage_options)


def audio_files(root: Path) -> list[Path]:
    """Audio files under `root` (or `root` itself), sorted by path; hidden files (`._x.flac`) are skipped."""
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in AUDIO_EXTS and p.is_file()
                  and not p.name.startswith("."))


def _read_small(path: Path) -> str | None:
    """A regular file's text, or None (a FIFO, a folder, or a file over MAX_REFERENCE_BYTES is no transcript)."""
    if not path.is_file():
        return None
    if path.stat().st_size > MAX_REFERENCE_BYTES:
        log.warning("ignored %s as a reference: larger than %d bytes", path, MAX_REFERENCE_BYTES)
        return None
    with open(path, "rb") as f:
        return f.read(MAX_REFERENCE_BYTES).decode("utf-8-sig", errors="replace")


def reference_for(path: Path, cache: dict[Path, dict[str, str]]) -> str | None:
    """`<stem>.txt` / `.lab` (any case) beside the audio, else the LibriSpeech *.trans.txt line of its folder."""
    folder = path.parent
    if folder not in cache:
        lines: dict[str, str] = {}
        siblings = sorted(folder.iterdir())
        for trans in (p for p in siblings if p.name.endswith(".trans.txt")):
            for line in (_read_small(trans) or "").splitlines():
                key, _, text = line.partition(" ")
                lines[key] = normalize_text(text)
        for p in siblings:  # per-file transcripts win over a *.trans.txt line
            if p.suffix.lower() in REFERENCE_EXTS and not p.name.endswith(".trans.txt"):
                lines[f"\0{p.stem}"] = p.name
        cache[folder] = lines
    own = cache[folder].get(f"\0{path.stem}")
    found = _read_small(folder / own) if own is not None else None
    return normalize_text(found) if found is not None else cache[folder].get(path.stem)


def folder_source(root: Path) -> UtteranceSource:
    """An audio file or a folder as utterances (key = file stem, reference when a transcript is found). A stem
    that occurs more than once (a/x.wav, b/x.flac) keys each file by its path under `root` instead, so no two
    rows of the output share a key."""
    cache: dict[Path, dict[str, str]] = {}
    files = audio_files(root)
    stems = Counter(p.stem for p in files)

    def key(p: Path) -> str:
        if stems[p.stem] == 1 or not root.is_dir():
            return p.stem
        return p.relative_to(root).as_posix()

    return UtteranceSource(name=str(root), items=[Utterance(key=key(p), audio=str(p),
                                                            reference=reference_for(p, cache)) for p in files])


def group_files(files: Sequence[_File], max_batch_seconds: float) -> list[list[_File]]:
    """Pure: group by rate, sort by duration, cut when the padded batch (longest x count) would pass the budget."""
    batches: list[list[_File]] = []
    for rate in sorted({f.rate_hz for f in files}):
        cur: list[_File] = []
        for f in sorted((f for f in files if f.rate_hz == rate), key=lambda f: (f.duration_s, str(f.path))):
            if cur and f.duration_s * (len(cur) + 1) > max_batch_seconds:
                batches.append(cur)
                cur = []
            cur.append(f)
        if cur:
            batches.append(cur)
    return batches


class Transcriber:
    """Runs a TrainedModel over inputs; `errors` collects every input or utterance that failed."""

    def __init__(self, tm: TrainedModel, cfg: TranscribeConfig) -> None:
        self.tm, self.cfg = tm, cfg
        self.errors: list[dict] = []
        self.normalizer: TextNormConfig = getattr(tm.tokenizer, "normalizer", None) or TextNormConfig()

    def resolve(self, x: str | UtteranceSource) -> str | UtteranceSource:
        """A dataset URL stays a URL (the loader reads it); a local file or folder becomes an UtteranceSource."""
        if isinstance(x, UtteranceSource) or is_dataset(x, self.cfg.storage_options):
            return x
        if storage.is_local(x) and Path(x).exists():
            return folder_source(Path(x))
        raise FileNotFoundError(f"{x}: neither an audio file, a folder, nor a dataset (no manifest.json)")

    def rows(self, inputs: Sequence[str | UtteranceSource]) -> Iterator[dict]:
        """One dict per utterance, in processing order (see the module docstring)."""
        for x in inputs:
            src = self.resolve(x)
            if isinstance(src, str):
                batches, total_s, name = self._dataset_batches(src), self._dataset_seconds(src), src
            else:
                name = src.name
                for key, reason in src.rejects:
                    code, _, detail = reason.partition(": ")
                    yield self._error(name, key, code, detail)
                if not src.items:
                    yield self._error(name, name, "no_audio", f"no readable {'/'.join(AUDIO_EXTS)} files, and no "
                                                              "manifest.json (not a dataset)")
                    continue
                planned = list(self._probe(src))
                total_s = sum(f.duration_s for f in planned if isinstance(f, _File))
                batches = self._source_batches(src, planned)
            bar = tqdm(total=round(min(total_s, 1e9), 1), unit="audio-s", desc=Path(name.rstrip("/")).name or name,
                       disable=not self.cfg.progress or not sys.stderr.isatty())
            try:
                for b in batches:
                    if isinstance(b, dict):
                        yield b
                        continue
                    yield from self._run(b)
                    bar.update(round(float(b.lengths.sum()) / b.rate_hz, 1))
            finally:
                bar.close()

    # ---- files and corpora ------------------------------------------------------------------------------------
    def _probe(self, src: UtteranceSource) -> Iterator[_File | dict]:
        for u in src.items:
            try:
                p = probe(u, self.cfg.storage_options)
            except AudioError as e:
                yield self._error(src.name, u.key, e.reason, e.detail, u)
                continue
            yield _File(path=u.audio, duration_s=p.duration_s, rate_hz=p.rate_hz, utt=u, probe=p)

    def _source_batches(self, src: UtteranceSource, planned: list[_File | dict]) -> Iterator[AudioBatch | dict]:
        yield from (x for x in planned if isinstance(x, dict))  # probe failures first
        files = [x for x in planned if isinstance(x, _File)]
        short = [f for f in files if f.duration_s <= self.cfg.window_seconds]
        for group in group_files(short, self.cfg.max_batch_seconds):
            clips, keys, refs = [], [], []
            for f in group:
                assert f.utt is not None
                try:
                    x, _ = read(f.utt, max_frames=int(self.cfg.window_seconds * f.rate_hz) + 1,
                                storage_options=self.cfg.storage_options)
                except AudioError as e:
                    yield self._error(src.name, f.utt.key, e.reason, e.detail, f.utt)
                    continue
                clips.append(torch.from_numpy(x))
                keys.append(f.utt.key)
                refs.append(f.utt.reference)
            if clips:
                yield AudioBatch(keys=keys, refs=refs, waves=torch.nn.utils.rnn.pad_sequence(clips, batch_first=True),
                                 lengths=torch.tensor([len(c) for c in clips]), rate_hz=group[0].rate_hz,
                                 source=src.name)
        for f in sorted((f for f in files if f.duration_s > self.cfg.window_seconds), key=lambda f: str(f.path)):
            assert f.utt is not None
            yield self._windowed(src.name, f.utt, f.rate_hz)

    def _windowed(self, source: str, u: Utterance, rate_hz: int) -> dict:
        """One long utterance read from its file window by window (one window of samples in memory)."""
        win = windows(u, max(1, int(self.cfg.window_seconds * rate_hz)), self.cfg.storage_options)
        return self._windowed_row(source, u.key, u.reference, win, u)

    def _windowed_row(self, source: str, key: str, ref: str | None, win: Iterator[tuple[np.ndarray, int]],
                      u: Utterance | None = None) -> dict:
        """Per-frame best ids of each window concatenated, then one CTC collapse: greedy CTC over the whole."""
        best: list[torch.Tensor] = []
        samples, rate = 0, 1
        try:
            for x, rate in win:
                lp, ol = self.tm.log_probs(torch.from_numpy(x)[None], torch.tensor([len(x)]), rate)
                best.append(lp[0, : int(ol[0])].argmax(dim=-1).cpu())
                samples += len(x)
        except AudioError as e:
            return self._error(source, key, e.reason, e.detail, u)
        except RuntimeError as e:  # the model failed on a window (out of memory, ...): this utterance only
            return self._error(source, key, "model_failed", f"{type(e).__name__}: {e}", u)
        if not samples:
            return self._error(source, key, "empty_audio", "no samples decoded", u)
        ids = torch.unique_consecutive(torch.cat(best)).tolist() if best else []
        return self._row(key, ref, self.tm.tokenizer.decode([i for i in ids if i != BLANK]), samples / rate, source)

    # ---- datasets ---------------------------------------------------------------------------------------------
    def _dataset_seconds(self, url: str) -> float:
        return float(open_dataset(url, self.cfg.storage_options).totals.get("seconds", 0.0))

    def _dataset_batches(self, url: str) -> Iterator[AudioBatch | dict]:
        ds = open_dataset(url, self.cfg.storage_options)
        longest = max((s.max_duration_s for s in ds.shards), default=0.0)
        # every utterance must fit a batch (the loader leaves out longer ones): widen the budget when needed
        bucket = BucketConfig(max_batch_seconds=max(self.cfg.max_batch_seconds, longest + 1e-3), padded_budget=True,
                              num_buckets=min(30, max(1, len(ds.shards))))
        loader = build_loader(url, world=World(), seed=0, cfg=StreamConfig(bucket=bucket, epochs=1),
                              storage_options=self.cfg.storage_options)
        it = iter(loader)
        try:
            for batch, _ in it:
                if len(batch) == 0:
                    continue
                waves = batch.waves.float() / 32768.0 if batch.waves.dtype == torch.int16 else batch.waves
                yield AudioBatch(keys=list(batch.keys), refs=[t or None for t in batch.texts], waves=waves,
                                 lengths=batch.lengths, rate_hz=batch.sample_rate_hz, source=url)
        finally:
            it.close()
        stats = loader.stats()
        for k in stats["skipped_keys"]:
            yield self._error(url, str(k), "skipped_sample", "the loader could not decode it")
        if stats["skipped"] > len(stats["skipped_keys"]):
            yield self._error(url, url, "skipped_sample", f"{stats['skipped'] - len(stats['skipped_keys'])} more")

    # ---- rows -------------------------------------------------------------------------------------------------
    def _run(self, b: AudioBatch) -> Iterator[dict]:
        win = max(1, int(self.cfg.window_seconds * b.rate_hz))
        if int(b.lengths.max()) > win:  # a dataset's long utterance (decoded whole by the loader): windows too
            for i, (key, ref) in enumerate(zip(b.keys, b.refs)):
                wave = b.waves[i, : int(b.lengths[i])].float().contiguous()
                yield self._windowed_row(b.source, key, ref, ((wave[s:e].numpy(), b.rate_hz)
                                                              for s, e in window_spans(len(wave), win)))
            return
        try:
            hyps = self.tm.transcribe(b.waves, b.lengths, b.rate_hz)
        except RuntimeError as e:  # out of memory, ...: every utterance of the batch is recorded, the run goes on
            for key in b.keys:
                yield self._error(b.source, key, "model_failed", f"{type(e).__name__}: {e}")
            return
        for key, ref, hyp, n in zip(b.keys, b.refs, hyps, b.lengths.tolist()):
            yield self._row(key, ref, hyp, n / b.rate_hz, b.source)

    def _row(self, key: str, ref: str | None, hyp: str, duration_s: float, source: str) -> dict:
        row: dict = {"key": key, "text": hyp, "duration_s": round(duration_s, 4), "source": source}
        if ref is not None:
            n_ref, n_hyp = self.normalizer.apply(ref), self.normalizer.apply(hyp)
            row["reference"] = normalize_text(ref)
            row["cer"] = edit_distance(n_ref, n_hyp) / max(len(n_ref), 1)
        return row

    def _error(self, source: str, key: str, reason: str, detail: str, u: Utterance | None = None) -> dict:
        log.warning("skipped %s (%s): %s (%s)", key, source, reason, detail)
        where = u.audio if u is not None else source if key == source else f"{source}: {key}"
        self.errors.append({"input": where, "reason": reason, "detail": detail})
        row: dict = {"key": key, "source": source, "error": f"{reason}: {detail}" if detail else reason}
        if u is not None and u.reference is not None:
            row["reference"] = normalize_text(u.reference)
        return row


def transcribe(tm: TrainedModel, inputs: Sequence[str | UtteranceSource],
               cfg: TranscribeConfig | None = None) -> tuple[list[dict], list[dict]]:
    """Convenience: (rows, errors) of a whole run in memory; failed utterances are rows with an `error` field."""
    t = Transcriber(tm, cfg or TranscribeConfig())
    return list(t.rows(inputs)), t.errors


def has_references(src: str | UtteranceSource, storage_options: dict | None = None) -> bool:
    """Whether anything in `src` can be scored (a dataset: one non-empty text in its index; costs that column)."""
    if isinstance(src, UtteranceSource):
        return any(u.reference for u in src.items)
    texts = open_dataset(src, storage_options).read_index(columns=["text"]).column("text")
    return any(bool(t) for t in texts.to_pylist())


__all__ = ["TranscribeConfig", "Transcriber", "transcribe", "group_files", "is_dataset", "AudioBatch",
           "UtteranceSource", "Utterance", "has_references", "folder_source"]
