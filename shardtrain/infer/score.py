"""Error rates of transcripts against references: CER/WER with the edit split, and the worst utterances.

    rows {key, text, reference} -> Score.add -> per utterance: char/word substitutions, insertions, deletions
      -> Score.summary(): {utterances, cer, wer, chars {sub, ins, del, errors, ref}, words {...}, worst [...]}
    {dataset: summary} -> markdown_table() -> one row per dataset

Texts are compared after `normalize_text` (whitespace collapsed; no case folding, as in training). CER counts
characters including spaces, WER whitespace-separated words; both are corpus-level (summed edits / summed
reference length), not means of per-utterance rates. Edit counts come from one optimal alignment (rapidfuzz,
see train/text.py). "Worst" ranks utterances with errors by character errors, then CER. Rows without a reference are
counted as unscored. Cost: microseconds per utterance.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from shardtrain.infer.checkpoint_model import TrainedModel
from shardtrain.infer.transcribe import TranscribeConfig, Transcriber
from shardtrain.train.text import edit_ops, normalize_text


def _zero() -> dict[str, int]:
    return {"sub": 0, "ins": 0, "del": 0, "ref": 0}


@dataclass(slots=True)
class Score:
    """Running sums for one dataset; `worst_n` utterances kept in a heap."""

    worst_n: int = 5
    utterances: int = 0
    unscored: int = 0
    chars: dict[str, int] = field(default_factory=_zero)
    words: dict[str, int] = field(default_factory=_zero)
    _worst: list = field(default_factory=list)
    _seq: int = 0

    def add(self, key: str, reference: str | None, hypothesis: str) -> None:
        if reference is None:
            self.unscored += 1
            return
        ref, hyp = normalize_text(reference), normalize_text(hypothesis)
        c, w = edit_ops(ref, hyp), edit_ops(ref.split(), hyp.split())
        for total, ops, n in ((self.chars, c, len(ref)), (self.words, w, len(ref.split()))):
            for k in ("sub", "ins", "del"):
                total[k] += ops[k]
            total["ref"] += n
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
            self.add(r["key"], r.get("reference"), r["text"])

    def summary(self) -> dict:
        def rate(d: dict[str, int]) -> float:
            return (d["sub"] + d["ins"] + d["del"]) / max(d["ref"], 1)

        return {"utterances": self.utterances, "unscored": self.unscored, "cer": rate(self.chars),
                "wer": rate(self.words),
                "chars": {**self.chars, "errors": self.chars["sub"] + self.chars["ins"] + self.chars["del"]},
                "words": {**self.words, "errors": self.words["sub"] + self.words["ins"] + self.words["del"]},
                "worst": [x[3] for x in sorted(self._worst, key=lambda x: (-x[0], -x[1], x[2]))]}


def evaluate(tm: TrainedModel, urls: Sequence[str], cfg: TranscribeConfig | None = None,
             worst_n: int = 5) -> tuple[dict[str, dict], list[dict]]:
    """({url: summary}, skipped inputs) for each dataset (or folder with references), one pass each."""
    t = Transcriber(tm, cfg or TranscribeConfig())
    out = {}
    for url in urls:
        s = Score(worst_n=worst_n)
        s.add_rows(t.rows([url]))
        out[url] = s.summary()
    return out, t.errors


def markdown_table(results: dict[str, dict]) -> str:
    """| dataset | utts | CER % | sub | ins | del | WER % | sub | ins | del |, then each dataset's worst utterances."""
    lines = ["| dataset | utterances | CER % | char sub | char ins | char del | WER % | word sub | word ins | word del |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for url, s in results.items():
        c, w = s["chars"], s["words"]
        lines.append(f"| {url} | {s['utterances']} | {100 * s['cer']:.2f} | {c['sub']} | {c['ins']} | {c['del']} | "
                     f"{100 * s['wer']:.2f} | {w['sub']} | {w['ins']} | {w['del']} |")
    for url, s in results.items():
        if s["worst"]:
            lines += ["", f"Worst utterances of {url}:", "", "| key | CER % | reference | hypothesis |",
                      "|---|---:|---|---|"]
            lines += [f"| {x['key']} | {100 * x['cer']:.1f} | {x['reference']} | {x['hypothesis']} |"
                      for x in s["worst"]]
    return "\n".join(lines)
