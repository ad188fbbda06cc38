"""Transcript normalisation: one frozen config, applied the same way wherever text meets the model.

    raw transcript (index.parquet "text", a .txt, a Kaldi `text` line; stored as written, never normalised at pack)
      -> TextNormConfig.apply: Unicode form (NFC) -> case (lower) -> punctuation (to spaces, apostrophes kept)
         -> whitespace runs collapsed, ends stripped
      -> vocabulary building, training targets, validation targets, CER/WER (train/text.py, infer/score.py)

Where it lives: `RunConfig.text` (the pipeline chooses it; `--set text.case=keep` edits it); the tokenizer built
for a run carries a copy (`Tokenizer.normalizer`, written into vocab.json / the checkpoint / the ONNX metadata), so
transcribe, evaluate and an exported model score with exactly the normaliser the vocabulary was built with.
Checkpoints written before this existed hold none and get `TextNormConfig()`, which is what they were trained with:
whitespace collapsed, nothing else (no Unicode composition, case kept, punctuation kept).

Punctuation is every character of a Unicode `P*` category (`.,;:!?-"()` and their typographic forms); it becomes a
space (so `well-known` -> `well known`, not `wellknown`), except the characters of `keep` (default the apostrophe,
so `don't` stays one word). With "'" kept, the typographic apostrophes U+2019 and U+02BC become "'" first, so one
spoken word has one spelling. Symbols (`$`, `%`, `+`) are not punctuation and stay. Cost: measured 40-80 us per
100 characters of mixed ASCII/non-ASCII text on the loaded 2-core dev machine (~6x the whitespace-only collapse;
most of it `str.translate` over a per-character table filled lazily), against milliseconds of audio decode per
utterance; once per utterance in training, validation and scoring.
"""
from __future__ import annotations

import dataclasses
import unicodedata
from dataclasses import dataclass

UNICODE_FORMS = ("", "NFC", "NFKC")
CASES = ("keep", "lower", "upper")
PUNCTUATION = ("keep", "strip")
_APOSTROPHES = {0x2019: "'", 0x02BC: "'"}


@dataclass(frozen=True, kw_only=True, slots=True)
class TextNormConfig:
    """How transcripts are normalised before tokenising and scoring. The default is the legacy behaviour
    (whitespace only); `SPEECH` below is what the shipped pipelines use."""

    unicode: str = ""
    """"" (as written), "NFC" (composed: `e` + U+0301 -> `é`, one symbol) or "NFKC" (also folds compatibility
    forms: ligatures, full-width letters, superscripts)."""
    case: str = "keep"
    """"keep", "lower" or "upper" (str.lower/upper; not casefold, which turns `ß` into `ss`)."""
    punctuation: str = "keep"
    """"keep", or "strip": every Unicode punctuation character except those in `keep` becomes a space."""
    keep: str = "'"
    """Punctuation kept when punctuation="strip" (default the apostrophe)."""

    def __post_init__(self) -> None:
        if self.unicode not in UNICODE_FORMS:
            raise ValueError(f"text.unicode must be one of {UNICODE_FORMS}, got {self.unicode!r}")
        if self.case not in CASES:
            raise ValueError(f"text.case must be one of {CASES}, got {self.case!r}")
        if self.punctuation not in PUNCTUATION:
            raise ValueError(f"text.punctuation must be one of {PUNCTUATION}, got {self.punctuation!r}")

    def apply(self, text: str) -> str:
        """The normalised transcript (see the module docstring for the order of the steps)."""
        if self.unicode:
            text = unicodedata.normalize(self.unicode, text)  # type: ignore[arg-type]  # checked in __post_init__
        if self.case == "lower":
            text = text.lower()
        elif self.case == "upper":
            text = text.upper()
        if self.punctuation == "strip":
            text = text.translate(_table(self.keep))
        return " ".join(text.split())

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict | None) -> "TextNormConfig":
        """None (a tokenizer or checkpoint from before normalisers) -> the legacy default."""
        return cls(**d) if d else cls()


SPEECH = TextNormConfig(unicode="NFC", case="lower", punctuation="strip", keep="'")
"""What speech recipes do and the shipped pipelines use: NFC, lower case, punctuation stripped except apostrophes,
whitespace collapsed."""


class _StripTable(dict):
    """str.translate table: punctuation -> " " unless kept; filled one code point at a time on first sight."""

    def __init__(self, keep: str) -> None:
        super().__init__()
        self.keep = keep
        if "'" in keep:
            self.update(_APOSTROPHES)

    def __missing__(self, cp: int) -> str:
        ch = chr(cp)
        out = " " if unicodedata.category(ch).startswith("P") and ch not in self.keep else ch
        self[cp] = out
        return out


_TABLES: dict[str, _StripTable] = {}


def _table(keep: str) -> _StripTable:
    t = _TABLES.get(keep)
    if t is None:
        t = _TABLES[keep] = _StripTable(keep)
    return t


def missing_chars(texts, known: set[str], norm: TextNormConfig) -> dict[str, int]:
    """{character: occurrences} of the normalised `texts` that `known` lacks (spaces never count)."""
    out: dict[str, int] = {}
    for t in texts:
        for c in norm.apply(t or ""):
            if c not in known and c != " ":
                out[c] = out.get(c, 0) + 1
    return out


def describe_chars(counts: dict[str, int], limit: int = 20) -> str:
    """`'ß' (U+00DF) x4, ...`, most frequent first; the repr shows invisible characters as escapes."""
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    out = ", ".join(f"{c!r} (U+{ord(c):04X}) x{n}" for c, n in top[:limit])
    return out + (f", and {len(top) - limit} more" if len(top) > limit else "")
