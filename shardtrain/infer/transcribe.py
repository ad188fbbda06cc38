"""Transcribe audio files, folders and shardtrain datasets with a trained model, batched by duration.

    INPUTS: audio file | folder (searched recursively) | dataset (folder or s3:// prefix with manifest.json)
      files:    soundfile header probe (duration, rate; no decode) -> group by rate, sort by duration
                -> batches under max_batch_seconds of *padded* audio -> decode (format.audio) -> mono float32
      datasets: the training loader itself (one epoch, one rank, every utterance), texts = references
      -> AudioBatch(keys, refs, waves [B, T], lengths [B], rate) -> TrainedModel.log_probs -> greedy CTC
      -> one row per utterance: {key, text, duration_s, source[, reference, cer]}

References: a dataset's index text; for files, `<name>.txt` beside the audio or a LibriSpeech
`<speaker>-<chapter>.trans.txt` in its folder. Rows come in processing order (per input, shortest first
within a sample rate), not input order: sorting by duration is what keeps padding, and time, low.
A file that cannot be read or decoded is skipped, logged and recorded in `Transcriber.errors` (the CLI exits
1 when there are any); a dataset's corrupt samples are counted by the loader the same way.
Cost: per batch one forward pass; decoding files runs in the calling thread (inference dominates).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import soundfile as sf
import torch
from tqdm import tqdm

from shardtrain import storage
from shardtrain.format.audio import AudioError, decode
from shardtrain.format.manifest import open_dataset
from shardtrain.infer.checkpoint_model import TrainedModel
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.train.text import edit_distance, normalize_text
from shardtrain.world import World

log = logging.getLogger(__name__)

AUDIO_EXTS = (".flac", ".wav", ".opus", ".ogg", ".mp3")


@dataclass(frozen=True, kw_only=True, slots=True)
class TranscribeConfig:
    max_batch_seconds: float = 120.0
    """Padded audio seconds per batch (longest x count); an utterance longer than this goes alone."""
    progress: bool = True
    """tqdm bar over audio seconds (only when stderr is a terminal)."""
    storage_options: dict | None = None
    """fsspec options for s3:// datasets."""

    def __post_init__(self) -> None:
        if self.max_batch_seconds <= 0:
            raise ValueError("--max-batch-seconds must be > 0")


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
    path: Path
    duration_s: float
    rate_hz: int


def is_dataset(url: str, storage_options: dict | None = None) -> bool:
    return storage.exists(storage.join(url, "manifest.json"), storage_options)


def audio_files(root: Path) -> list[Path]:
    """Audio files under `root` (or `root` itself), sorted by path."""
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in AUDIO_EXTS and p.is_file())


def reference_for(path: Path, cache: dict[Path, dict[str, str]]) -> str | None:
    """`<stem>.txt` beside the audio, else the LibriSpeech *.trans.txt line of its folder; None when neither."""
    txt = path.with_suffix(".txt")
    if txt.is_file():
        return normalize_text(txt.read_text(encoding="utf-8"))
    folder = path.parent
    if folder not in cache:
        lines: dict[str, str] = {}
        for trans in folder.glob("*.trans.txt"):
            for line in trans.read_text(encoding="utf-8").splitlines():
                key, _, text = line.partition(" ")
                lines[key] = normalize_text(text)
        cache[folder] = lines
    return cache[folder].get(path.stem)


def plan_file_batches(files: Sequence[_File], max_batch_seconds: float) -> list[list[_File]]:
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
    """Runs a TrainedModel over inputs; `errors` collects every input or sample that was skipped."""

    def __init__(self, tm: TrainedModel, cfg: TranscribeConfig) -> None:
        self.tm, self.cfg = tm, cfg
        self.errors: list[dict] = []

    def rows(self, inputs: Sequence[str]) -> Iterator[dict]:
        """One dict per utterance, in processing order (see the module docstring)."""
        for url in inputs:
            if is_dataset(url, self.cfg.storage_options):
                batches, total_s = self._dataset_batches(url)
            elif storage.is_local(url) and Path(url).exists():
                batches, total_s = self._file_batches(Path(url))
            else:
                raise FileNotFoundError(f"{url}: neither an audio file, a folder, nor a dataset (no manifest.json)")
            bar = tqdm(total=round(total_s, 1), unit="audio-s", desc=Path(url.rstrip("/")).name or url,
                       disable=not self.cfg.progress or not sys.stderr.isatty())
            try:
                for b in batches:
                    yield from self._run(b)
                    bar.update(round(float(b.lengths.sum()) / b.rate_hz, 1))
            finally:
                bar.close()

    def _run(self, b: AudioBatch) -> Iterator[dict]:
        hyps = self.tm.transcribe(b.waves, b.lengths, b.rate_hz)
        for key, ref, hyp, n in zip(b.keys, b.refs, hyps, b.lengths.tolist()):
            row: dict = {"key": key, "text": hyp, "duration_s": round(n / b.rate_hz, 4), "source": b.source}
            if ref is not None:
                ref = normalize_text(ref)
                row["reference"] = ref
                row["cer"] = edit_distance(ref, normalize_text(hyp)) / max(len(ref), 1)
            yield row

    def _file_batches(self, root: Path) -> tuple[Iterator[AudioBatch], float]:
        files = []
        for p in audio_files(root):
            try:
                info = sf.info(str(p))
                files.append(_File(path=p, duration_s=float(info.duration), rate_hz=int(info.samplerate)))
            except (sf.SoundFileError, RuntimeError) as e:
                self._error(str(p), "unreadable_audio", str(e))
        if not files:  # e.g. a dataset folder whose manifest.json is missing (an unfinished pack): say so
            self._error(str(root), "no_audio", f"no readable {'/'.join(AUDIO_EXTS)} files, and no manifest.json "
                                               "(not a dataset)")
        plan = plan_file_batches(files, self.cfg.max_batch_seconds)
        return self._load_files(plan, str(root)), sum(f.duration_s for f in files)

    def _load_files(self, plan: list[list[_File]], source: str) -> Iterator[AudioBatch]:
        refs_cache: dict[Path, dict[str, str]] = {}
        for group in plan:
            clips, keys, refs = [], [], []
            for f in group:
                try:
                    x, _ = decode(f.path.read_bytes())
                except (AudioError, OSError) as e:
                    self._error(str(f.path), "unreadable_audio", str(e))
                    continue
                clips.append(torch.from_numpy(np.ascontiguousarray(x.mean(axis=1) if x.ndim > 1 else x)))
                keys.append(f.path.stem)
                refs.append(reference_for(f.path, refs_cache))
            if clips:
                yield AudioBatch(keys=keys, refs=refs, waves=torch.nn.utils.rnn.pad_sequence(clips, batch_first=True),
                                 lengths=torch.tensor([len(c) for c in clips]), rate_hz=group[0].rate_hz,
                                 source=source)

    def _dataset_batches(self, url: str) -> tuple[Iterator[AudioBatch], float]:
        ds = open_dataset(url, self.cfg.storage_options)
        longest = max((s.max_duration_s for s in ds.shards), default=0.0)
        # every utterance must fit a batch (the loader leaves out longer ones): widen the budget when needed
        bucket = BucketConfig(max_batch_seconds=max(self.cfg.max_batch_seconds, longest + 1e-3), padded_budget=True,
                              num_buckets=min(30, max(1, len(ds.shards))))
        loader = build_loader(url, world=World(), seed=0, cfg=StreamConfig(bucket=bucket, epochs=1),
                              storage_options=self.cfg.storage_options)
        return self._loader_batches(loader, url), float(ds.totals.get("seconds", 0.0))

    def _loader_batches(self, loader, url: str) -> Iterator[AudioBatch]:
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
                self._error(url, "skipped_sample", str(k))
            if stats["skipped"] > len(stats["skipped_keys"]):
                self._error(url, "skipped_sample", f"{stats['skipped'] - len(stats['skipped_keys'])} more")

    def _error(self, where: str, reason: str, detail: str) -> None:
        log.warning("skipped %s: %s (%s)", where, reason, detail)
        self.errors.append({"input": where, "reason": reason, "detail": detail})


def transcribe(tm: TrainedModel, inputs: Sequence[str], cfg: TranscribeConfig | None = None) -> tuple[list[dict], list[dict]]:
    """Convenience: (rows, errors) of a whole run in memory."""
    t = Transcriber(tm, cfg or TranscribeConfig())
    return list(t.rows(inputs)), t.errors


__all__ = ["TranscribeConfig", "Transcriber", "transcribe", "plan_file_batches", "is_dataset", "AudioBatch"]
