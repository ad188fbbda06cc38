"""Error rates of transcripts against references: CER/WER, raw and normalised, with the edit split and the worst.

    rows {key, text, reference} | {key, error} -> Score.add -> per utterance: char/word substitutions, insertions,
      deletions, on the normalised texts and on the raw ones
      -> Score.summary(): {utterances, unscored, failed, cer, wer, chars {sub, ins, del, errors, ref}, words {...},
                           raw {cer, wer, chars, words}, missing_chars {char: n}, worst [...]}
    {dataset: summary} -> markdown_table() -> one row per dataset (cells Markdown-escaped)

Normalised = both sides through the model's normaliser (the tokenizer's `normalizer`, train/normalize.py: the one
its training targets went through), so a correct all-caps reference scores 0 against a lower-case model. Raw = as
written, only whitespace runs collapsed (a trailing newline is not an error): what a user comparing strings sees.
CER counts characters including spaces, WER whitespace-separated words; both are corpus-level (summed edits /
summed reference length), not means of per-utterance rates. Edit counts come from one optimal alignment
(rapidfuzz, see train/text.py). "Worst" ranks normalised utterances with errors by character errors, then CER. Rows
without a reference are counted as unscored, rows with an `error` as failed (neither enters a rate).
`missing_chars` counts the normalised reference characters the vocabulary lacks (the model can never emit them).
Cost: microseconds per utterance.
"""
from __future__ import annotations

import heapq
import unicodedata
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from shardtrain.infer.checkpoint_model import TrainedModel
from shardtrain.infer.transcribe import TranscribeConfig, Transcriber, UtteranceSource, has_references
from shardtrain.train.normalize import TextNormConfig, missing_chars
from shardtrain.train.text import edit_ops, normalize_text


class NoReferences(ValueError):
    """An evaluate input holds nothing to score; the message names it (no model is run for nothing)."""


def _zero() -> dict[str, int]:
    return {"sub": 0, "ins": 0, "del": 0, "ref": 0}


def _rate(d: dict[str, int]) -> float:
    return (d["sub"] + d["ins"] + d["del"]) / max(d["ref"], 1)


def _with_errors(d: dict[str, int]) -> dict[str, int]:
    return {**d, "errors": d["sub"] + d["ins"] + d["del"]}


def _accumulate(chars: dict[str, int], words: dict[str, int], ref: str, hyp: str) -> tuple[dict, dict]:
    c, w = edit_ops(ref, hyp), edit_ops(ref.split(), hyp.split())
    for total, ops, n in ((chars, c, len(ref)), (words, w, len(ref.split()))):
        for k in ("sub", "ins", "del"):
            total[k] += ops[k]
        total["ref"] += n
    return c, w


@dataclass(slots=True)
class Score:
    """Running sums for one dataset; `worst_n` utterances kept in a heap. `normalizer`: the model's (None = the
    whitespace-only default); `vocab`: the model's characters, to count reference characters it cannot emit."""

    worst_n: int = 5
    normalizer: TextNormConfig | None = None
    vocab: frozenset[str] | None = None
    utterances: int = 0
    unscored: int = 0
    failed: int = 0
    chars: dict[str, int] = field(default_factory=_zero)
    words: dict[str, int] = field(default_factory=_zero)
    raw_chars: dict[str, int] = field(default_factory=_zero)
    raw_words: dict[str, int] = field(default_factory=_zero)
    missing: dict[str, int] = field(default_factory=dict)
    _worst: list = field(default_factory=list)
    _seq: int = 0

    def add(self, key: str, reference: str | None, hypothesis: str) -> None:
        if reference is None:
            self.unscored += 1
            return
        norm = self.normalizer or TextNormConfig()
        _accumulate(self.raw_chars, self.raw_words, normalize_text(reference), normalize_text(hypothesis))
        ref, hyp = norm.apply(reference), norm.apply(hypothesis)
        c, w = _accumulate(self.chars, self.words, ref, hyp)
        if self.vocab is not None:
            for ch, n in missing_chars([ref], set(self.vocab), TextNormConfig()).items():
                self.missing[ch] = self.missing.get(ch, 0) + n
        self.utterances += 1
        errors = sum(c.values())
        item = (errors, errors / max(len(ref), 1), self._seq,
                {"key": key, "reference": ref, "hypothesis": hyp, "char_errors": errors,
                 "cer": round(errors / max(len(ref), 1), 4), "word_errors": sum(w.values())})
        self._seq += 1
        if not errors:  # a perfect utterance is never among the worst
            return
        if len(self._worst) < self.worst_n:
            heapq.heappush(self._worst, item)
        elif self.worst_n and item[:2] > self._worst[0][:2]:
            heapq.heapreplace(self._worst, item)

    def add_rows(self, rows: Iterable[dict]) -> None:
        for r in rows:
            if "error" in r:
                self.failed += 1
            else:
                self.add(r["key"], r.get("reference"), r["text"])

    def summary(self) -> dict:
        return {"utterances": self.utterances, "unscored": self.unscored, "failed": self.failed,
                "cer": _rate(self.chars), "wer": _rate(self.words),
                "chars": _with_errors(self.chars), "words": _with_errors(self.words),
                "raw": {"cer": _rate(self.raw_chars), "wer": _rate(self.raw_words),
                        "chars": _with_errors(self.raw_chars), "words": _with_errors(self.raw_words)},
                "normalizer": (self.normalizer or TextNormConfig()).to_json(),
                "missing_chars": dict(sorted(self.missing.items(), key=lambda kv: (-kv[1], kv[0]))),
                "worst": [x[3] for x in sorted(self._worst, key=lambda x: (-x[0], -x[1], x[2]))]}


def evaluate(tm: TrainedModel, urls: Sequence[str | UtteranceSource], cfg: TranscribeConfig | None = None,
             worst_n: int = 5) -> tuple[dict[str, dict], list[dict]]:
    """({name: summary}, failed inputs) for each dataset, folder with references or UtteranceSource, one pass each.

    Every input is checked for references before the model runs on any (NoReferences names the first without);
    an input that exists but holds nothing to score is refused, never reported as a 0.00% row."""
    t = Transcriber(tm, cfg or TranscribeConfig())
    resolved = [t.resolve(u) for u in urls]
    for src in resolved:
        if not has_references(src, t.cfg.storage_options):
            name = src if isinstance(src, str) else src.name
            what = ("its index has no transcripts" if isinstance(src, str) else
                    f"{len(src.items)} audio files, none with a transcript (<name>.txt/.lab or *.trans.txt)"
                    if src.items else "no audio files")
            raise NoReferences(f"{name}: nothing to score: {what}; use `shardtrain transcribe` for transcripts alone")
    chars = getattr(tm.tokenizer, "chars", None)
    out = {}
    for src in resolved:
        s = Score(worst_n=worst_n, normalizer=t.normalizer, vocab=frozenset(chars) if chars is not None else None)
        s.add_rows(t.rows([src]))
        out[src if isinstance(src, str) else src.name] = s.summary()
    return out, t.errors


def escape_control(text: str) -> str:
    """Control and format characters (newlines, ESC, bidi overrides, ...) as visible escapes: terminal-safe."""
    return "".join(c if unicodedata.category(c) not in ("Cc", "Cf", "Zl", "Zp") else
                   c.encode("unicode_escape").decode("ascii") for c in str(text))


def md_cell(text: object) -> str:
    """One Markdown table cell: control characters escaped, `|` and backslashes escaped, so a cell stays a cell."""
    return escape_control(str(text).replace("\\", "\\\\")).replace("|", "\\|")


def markdown_table(results: dict[str, dict]) -> str:
    """| dataset | utts | CER % | sub | ins | del | WER % | sub | ins | del | raw CER % | raw WER % | failed |, then each
    dataset's worst utterances; every text cell escaped (md_cell)."""
    lines = ["| dataset | utterances | CER % | char sub | char ins | char del | WER % | word sub | word ins | word del "
             "| raw CER % | raw WER % | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for url, s in results.items():
        c, w, raw = s["chars"], s["words"], s.get("raw", s)
        lines.append(f"| {md_cell(url)} | {s['utterances']} | {100 * s['cer']:.2f} | {c['sub']} | {c['ins']} | "
                     f"{c['del']} | {100 * s['wer']:.2f} | {w['sub']} | {w['ins']} | {w['del']} | "
                     f"{100 * raw['cer']:.2f} | {100 * raw['wer']:.2f} | {s.get('failed', 0)} |")
    for url, s in results.items():
        if s["worst"]:
            lines += ["", f"Worst utterances of {md_cell(url)}:", "", "| key | CER % | reference | hypothesis |",
                      "|---|---:|---|---|"]
            lines += [f"| {md_cell(x['key'])} | {100 * x['cer']:.1f} | {md_cell(x['reference'])} | "
                      f"{md_cell(x['hypothesis'])} |" for x in s["worst"]]
    return "\n".join(lines)
