"""Text side of CTC training: the token vocabulary, greedy CTC decoding, and CER/WER.

    index.parquet "text" column -> CharVocab (blank=0, then every character seen, sorted)
    texts [B] -> encode -> targets [sum(U)] int64 + target_lengths [B]
    log_probs [B, T', V] -> greedy_decode (argmax, collapse repeats, drop blank) -> ids -> decode -> texts
    (hyps, refs) -> edit distances on characters (CER) and whitespace words (WER), through rapidfuzz (C++)

The character vocabulary is built from the training index (one column read, no audio), so a new corpus
needs no tokenizer step. Every tokenizer carries the run's text normaliser (train/normalize.py: Unicode form, case,
punctuation, whitespace) and applies it in `encode` and when building the vocabulary; `to_json` stores it, so a
checkpoint decodes and scores with the normaliser it was trained with (none stored: the legacy whitespace-only one).
Characters missing from the vocabulary (only possible in validation text) are dropped from targets and counted;
training warns about them once per validation set at start (valsets.warn_missing_chars). SentencePiece is optional
(extra `[sentencepiece]`): used only when asked for (`train.tokenizer=sentencepiece`, `train.sentencepiece_model`),
and a clear error names the extra when the package is missing. Its ids are the model's plus one (0 is the blank);
the checkpoint stores the model file's path, so that file must stay readable for resume and inference.
"""
from __future__ import annotations

import base64

import logging
from typing import Protocol, Sequence

import torch
from rapidfuzz.distance import Levenshtein

from shardtrain.train.normalize import TextNormConfig

log = logging.getLogger(__name__)

BLANK = 0


def normalize_text(text: str) -> str:
    """Collapse runs of whitespace and strip the ends (TextNormConfig()'s whole effect); "raw" scores use it."""
    return " ".join(text.split())


class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer. Id 0 is always the CTC blank."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def __len__(self) -> int: ...
    def to_json(self) -> dict: ...
    @property
    def normalizer(self) -> TextNormConfig: ...


class CharVocab:
    """Characters to ids: 0 = CTC blank, 1.. = the sorted characters seen in the training transcripts."""

    def __init__(self, chars: Sequence[str], normalizer: TextNormConfig | None = None) -> None:
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise ValueError("CharVocab needs distinct single characters")
        self.normalizer = normalizer or TextNormConfig()
        self.chars = list(chars)
        self._ids = {c: i + 1 for i, c in enumerate(self.chars)}
        self.unknown_chars = 0
        """Characters dropped by `encode` because they were not in the vocabulary (running count)."""

    @classmethod
    def from_texts(cls, texts: Sequence[str], normalizer: TextNormConfig | None = None) -> "CharVocab":
        norm = normalizer or TextNormConfig()
        seen: set[str] = set()
        for t in texts:
            seen.update(norm.apply(t or ""))
        return cls(sorted(seen), norm)

    @classmethod
    def from_index(cls, url: str, storage_options: dict | None = None,
                   normalizer: TextNormConfig | None = None) -> "CharVocab":
        """Read only the text column of the dataset's index.parquet (no audio is opened)."""
        from shardtrain.format.manifest import open_dataset

        table = open_dataset(url, storage_options).read_index(columns=["text"])
        vocab = cls.from_texts(table.column("text").to_pylist(), normalizer)
        log.info("character vocabulary: %d symbols + blank from %s", len(vocab.chars), url)
        return vocab

    def encode(self, text: str) -> list[int]:
        out = []
        for c in self.normalizer.apply(text):
            i = self._ids.get(c)
            if i is None:
                self.unknown_chars += 1
            else:
                out.append(i)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i - 1] for i in ids if 0 < i <= len(self.chars))

    def __len__(self) -> int:
        return len(self.chars) + 1

    def to_json(self) -> dict:
        return {"kind": "char", "chars": self.chars, "normalizer": self.normalizer.to_json()}


class SentencePieceVocab:
    """A trained SentencePiece model; its ids are shifted by one so 0 stays the CTC blank."""

    def __init__(self, model_path: str, normalizer: TextNormConfig | None = None, proto: bytes | None = None) -> None:
        """`proto`: the model's serialized bytes, as a checkpoint stores them (then `model_path` is only a name):
        a checkpoint decodes with the pieces it was trained with even after the .model file was retrained in
        place with the same piece count, which would otherwise change every transcript silently."""
        self.normalizer = normalizer or TextNormConfig()
        try:
            import sentencepiece as spm
        except ImportError as e:  # optional dependency
            raise RuntimeError(
                "train.tokenizer=sentencepiece needs the `sentencepiece` package: pip install "
                "'shardtrain[sentencepiece]' (or use train.tokenizer=char)"
            ) from e
        self.model_path = model_path
        self._sp = (spm.SentencePieceProcessor(model_proto=proto) if proto is not None
                    else spm.SentencePieceProcessor(model_file=model_path))

    def encode(self, text: str) -> list[int]:
        return [i + 1 for i in self._sp.encode(self.normalizer.apply(text))]

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([i - 1 for i in ids if i > 0])

    def __len__(self) -> int:
        return self._sp.get_piece_size() + 1

    def to_json(self) -> dict:
        """With the model itself (base64 of its serialized proto: ~1.4x the .model file, e.g. 330 KB for 5k
        pieces), not only its path."""
        return {"kind": "sentencepiece", "model_path": self.model_path, "normalizer": self.normalizer.to_json(),
                "model_proto_b64": base64.b64encode(self._sp.serialized_model_proto()).decode("ascii")}


def tokenizer_from_json(d: dict) -> Tokenizer:
    """Rebuild the tokenizer stored in a checkpoint, so a resumed run keeps the exact same ids and normaliser
    (a tokenizer stored before normalisers existed gets the legacy whitespace-only one it was trained with)."""
    norm = TextNormConfig.from_json(d.get("normalizer"))
    if d["kind"] == "char":
        return CharVocab(d["chars"], norm)
    if d["kind"] == "sentencepiece":
        proto = d.get("model_proto_b64")  # absent in checkpoints written before it was stored
        return SentencePieceVocab(d["model_path"], norm, base64.b64decode(proto) if proto else None)
    raise ValueError(f"unknown tokenizer kind {d['kind']!r}")


def encode_batch(tok: Tokenizer, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Texts -> (concatenated targets [sum(U)] int64, target_lengths [B] int64), the layout F.ctc_loss takes."""
    ids = [tok.encode(t) for t in texts]
    lengths = torch.tensor([len(x) for x in ids], dtype=torch.int64)
    flat = torch.tensor([i for x in ids for i in x], dtype=torch.int64)
    return flat, lengths


def greedy_decode(log_probs: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    """Best path: argmax per frame, collapse repeats, drop blanks. log_probs [B, T, V], lengths [B].

    One device->host copy of the argmax ids (a sync point); the collapse runs on the CPU.
    """
    best = log_probs.argmax(dim=-1).cpu()
    out = []
    for row, n in zip(best, lengths.cpu().tolist()):
        ids = torch.unique_consecutive(row[:n]).tolist()
        out.append([i for i in ids if i != BLANK])
    return out


def edit_distance(ref: Sequence, hyp: Sequence) -> int:
    """Levenshtein distance (substitutions, insertions, deletions all cost 1) of two strings or token lists.

    rapidfuzz's C++ implementation (bit-parallel): a 500-character pair takes ~10 us here, against 36-69 ms for the
    pure-Python O(len(ref) * len(hyp)) loop it replaced, which ran on the training rank's main thread in validation.
    Word lists work too: any hashable elements compare by equality.
    """
    return Levenshtein.distance(ref, hyp)


def edit_ops(ref: Sequence, hyp: Sequence) -> dict[str, int]:
    """One optimal alignment's {"sub", "ins", "del"} counts; they sum to `edit_distance(ref, hyp)`.

    "ins": in the hypothesis, not the reference; "del": in the reference, missing from the hypothesis. When
    several alignments are optimal, rapidfuzz picks one (the split can differ from other tools; the sum cannot).
    """
    out = {"sub": 0, "ins": 0, "del": 0}
    for op in Levenshtein.editops(ref, hyp):
        out[_OP_NAMES[op.tag]] += 1
    return out


_OP_NAMES = {"replace": "sub", "insert": "ins", "delete": "del"}


def error_counts(refs: Sequence[str], hyps: Sequence[str],
                 normalizer: TextNormConfig | None = None) -> dict[str, int]:
    """Summed edit distances and reference lengths, so ranks can all-reduce them before dividing.

    Both sides pass through `normalizer` (the tokenizer's: the same one its targets were encoded with; None = the
    whitespace-only default). CER counts characters of the normalised text (spaces included); WER counts
    whitespace-separated words.
    """
    norm = normalizer or TextNormConfig()
    c = {"char_errors": 0, "chars": 0, "word_errors": 0, "words": 0}
    for ref, hyp in zip(refs, hyps):
        ref, hyp = norm.apply(ref), norm.apply(hyp)
        c["char_errors"] += edit_distance(ref, hyp)
        c["chars"] += len(ref)
        c["word_errors"] += edit_distance(ref.split(), hyp.split())
        c["words"] += len(ref.split())
    return c
