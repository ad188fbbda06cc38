"""Run a model written by `shardtrain export` with ONNX Runtime and numpy alone: no torch, no torchaudio.

    OUT.onnx (metadata: tokenizer JSON, feature config, input kind)
      -> OnnxRecognizer(path): waves [B, T] float32 (numpy, or anything np.asarray takes) at any rate + lengths [B]
           -> resample to the model's rate (numpy FFT, per utterance; identity when the rates match)
           -> zero-pad to >= MIN_SAMPLES -> session.run -> log_probs [B, T', V], out_lengths [B]
           -> greedy CTC (argmax, collapse repeats, drop blank 0) -> texts

A deployment box needs `pip install onnxruntime numpy` and this file's package; importing this module never
imports torch (tests/infer/test_checkpoint_model.py runs it with `import torch` made to fail). Resampling here is an FFT
band-limit (the trainer's is torchaudio's windowed sinc): transcripts match at the model's own rate, and differ
only by resampling noise elsewhere. Cost: one session.run per call plus an argmax over [B, T', V].

    from shardtrain.infer.onnx_runtime import OnnxRecognizer
    rec = OnnxRecognizer("model.onnx")
    wave, rate = soundfile.read("utt.flac", dtype="float32")   # [T] mono or [T, C]: channels are averaged
    print(rec.transcribe(wave[None, :], np.array([len(wave)]), rate))
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Sequence

import numpy as np

MIN_SAMPLES = 4000
"""Shortest waves width the graph was exported for (0.25 s at 16 kHz): shorter batches are zero-padded to it."""
BLANK = 0


class _Chars:
    def __init__(self, chars: Sequence[str]) -> None:
        self.chars = list(chars)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i - 1] for i in ids if 0 < i <= len(self.chars))


class _Pieces:
    def __init__(self, d: dict) -> None:
        """The exported tokenizer's own pieces (`model_proto_b64`) when stored, else its model file."""
        import base64

        import sentencepiece as spm

        proto = d.get("model_proto_b64")
        self._sp = (spm.SentencePieceProcessor(model_proto=base64.b64decode(proto)) if proto
                    else spm.SentencePieceProcessor(model_file=d["model_path"]))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([i - 1 for i in ids if i > 0])


def tokenizer_decoder(d: dict) -> Any:
    """The exported tokenizer JSON (train.text's `to_json`) as something with .decode(ids) -> str."""
    if d.get("kind") == "char":
        return _Chars(d["chars"])
    if d.get("kind") == "sentencepiece":
        return _Pieces(d)
    raise ValueError(f"unknown tokenizer kind {d.get('kind')!r}")


def greedy_ids(log_probs: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    """Best path per utterance: argmax per frame, collapse repeats, drop blanks."""
    best = np.asarray(log_probs).argmax(axis=-1)
    out: list[list[int]] = []
    for row, n in zip(best, np.asarray(lengths).tolist()):
        row = row[: int(n)]
        if len(row) == 0:
            out.append([])
            continue
        keep = np.concatenate(([True], row[1:] != row[:-1]))
        out.append([int(i) for i in row[keep] if i != BLANK])
    return out


def resample_np(waves: np.ndarray, lengths: np.ndarray, orig_hz: int, new_hz: int) -> tuple[np.ndarray, np.ndarray]:
    """Padded batch [B, T] at orig_hz -> [B, T'] at new_hz, each utterance band-limited by FFT on its own length
    (new length ceil(len * new / orig), as the trainer's resampler gives)."""
    if orig_hz == new_hz:
        return waves, lengths
    g = math.gcd(int(orig_hz), int(new_hz))
    new_lengths = np.array([math.ceil(int(n) * (new_hz // g) / (orig_hz // g)) for n in lengths], np.int64)
    out = np.zeros((waves.shape[0], int(new_lengths.max(initial=0))), np.float32)
    for i, (n, m) in enumerate(zip(lengths.tolist(), new_lengths.tolist())):
        if n == 0 or m == 0:
            continue
        spec = np.fft.rfft(waves[i, :n].astype(np.float64))
        keep = min(len(spec), m // 2 + 1)
        out[i, :m] = np.fft.irfft(spec[:keep], m) * (m / n)
    return out, new_lengths


class OnnxRecognizer:
    """An exported model in ONNX Runtime: raw waves in (numpy), log-probs and greedy transcripts out."""

    def __init__(self, path: str | os.PathLike, *, providers: list[str] | None = None, threads: int = 0) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), opts, providers=providers or ["CPUExecutionProvider"])
        meta = self.session.get_modelmeta().custom_metadata_map
        if "shardtrain.tokenizer" not in meta:
            raise ValueError(f"{path}: not exported by `shardtrain export` (no shardtrain.tokenizer metadata)")
        self.tokenizer = tokenizer_decoder(json.loads(meta["shardtrain.tokenizer"]))
        self.features: dict = json.loads(meta.get("shardtrain.features", "{}"))
        self.input_kind = meta.get("shardtrain.input", "waves")
        self.path = str(path)

    @property
    def sample_rate_hz(self) -> int:
        return int(self.features.get("sample_rate_hz", 16000))

    def log_probs(self, waves: Any, lengths: Any, rate_hz: int) -> tuple[np.ndarray, np.ndarray]:
        """waves [B, T] (or [T], or [B, T, channels], averaged to mono as the trainer's decoder does) float at
        `rate_hz` -> (log_probs [B, T', V], out_lengths [B]) as numpy. numpy arrays, lists and CPU torch tensors
        are all taken (np.asarray)."""
        if self.input_kind != "waves":
            raise ValueError(f"{self.path} takes features, not audio (exported with --no-features)")
        w = np.asarray(waves, dtype=np.float32)
        if w.ndim == 1:
            w = w[None, :]
        elif w.ndim == 3:  # [B, T, channels]: soundfile's multichannel [T, C] under `wave[None, :]`: downmix
            w = w.mean(axis=2, dtype=np.float32)
        n = np.asarray(lengths, dtype=np.int64).reshape(-1)
        w, n = resample_np(w, n, int(rate_hz), self.sample_rate_hz)
        if w.shape[1] < MIN_SAMPLES:
            w = np.pad(w, ((0, 0), (0, MIN_SAMPLES - w.shape[1])))
        lp, ol = self.session.run(None, {"waves": np.ascontiguousarray(w, np.float32), "lengths": n})
        return lp, ol

    def transcribe(self, waves: Any, lengths: Any, rate_hz: int) -> list[str]:
        lp, ol = self.log_probs(waves, lengths, rate_hz)
        return [self.tokenizer.decode(ids) for ids in greedy_ids(lp, ol)]
