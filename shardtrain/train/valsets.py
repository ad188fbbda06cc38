"""Validation sets: which ones a run has, what each is called, and a start-up check that each one opens.

    TrainConfig.val_data_url + val_extra_urls (repeated `--val-data [NAME=]URL`) + val_names
      -> val_sets(tc) -> (ValSet(name, url), ...)   names unique, fixed for the whole run (metric keys use them)
      -> check_val_sets(sets, storage_options)      reads each manifest.json (a few KB) before any training step
      -> warn_missing_chars(sets, tok, ...)          reads each index's text column once: one warning per set
                                                     naming the characters its normalised targets will lose

A name not given is derived from the URL: its last path component (`s3://b/librispeech/dev-clean` -> `dev-clean`),
with characters other than letters, digits, `_`, `.` and `-` replaced by `_`. When derived names clash, each
clashing one takes in parent components joined by `-` until they differ (`/a/x/shards`, `/b/y/shards` -> `x-shards`,
`y-shards`); what still clashes (a derived name equal to a given one) gets `-2`, `-3`, ... in order. The same URL
twice, or a given name twice, is refused: it is a typo, not two sets.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Protocol, Sequence

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""A validation set name: it becomes part of metric keys (`val/<name>/cer`) and TensorBoard tags."""
_NAMED = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]*)=(.+)", re.S)


class _ValConfig(Protocol):  # the three TrainConfig fields this module reads (no import of config: it imports us)
    @property
    def val_data_url(self) -> str: ...
    @property
    def val_extra_urls(self) -> tuple[str, ...]: ...
    @property
    def val_names(self) -> tuple[str, ...]: ...


@dataclass(frozen=True, slots=True)
class ValSet:
    name: str
    """Unique within the run; metric keys are `val/<name>/<metric>`."""
    url: str


def split_named(arg: str) -> tuple[str, str]:
    """`--val-data` value -> (name or "", url). `NAME=URL` gives the name; a value whose part before the first `=`
    is not a plain name (it holds `/` or `:`, as `s3://b/k=v` does) is all URL. Write `./lang=en` for a local folder
    whose name looks like NAME=..."""
    m = _NAMED.fullmatch(arg)
    return (m.group(1), m.group(2)) if m else ("", arg)


def _components(url: str) -> list[str]:
    path = url.split("://", 1)[-1]
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
    return [re.sub(r"[^A-Za-z0-9_.-]", "_", p) for p in parts] or ["val"]


def derive_names(urls: Sequence[str], names: Sequence[str] = ()) -> tuple[str, ...]:
    """Unique names for `urls` (see the module docstring); `names[i]` non-empty is used as given."""
    if names and len(names) != len(urls):
        raise ValueError(f"train.val_names has {len(names)} names for {len(urls)} validation sets; give one per "
                         "--val-data (\"\" derives it from the URL) or none")
    given = list(names) or [""] * len(urls)
    for i, url in enumerate(urls):
        if not url:
            raise ValueError("an empty validation set URL; every --val-data needs a dataset URL")
        if url.rstrip("/") in (u.rstrip("/") for u in urls[:i]):
            raise ValueError(f"validation set {url} is given twice (--val-data / train.val_extra_urls)")
        if given[i] and not NAME_RE.fullmatch(given[i]):
            raise ValueError(f"validation set name {given[i]!r} ({url}): use letters, digits, '_', '.', '-' "
                             "(it becomes part of metric keys val/<name>/cer)")
        if given[i] and given[i] in given[:i]:
            raise ValueError(f"validation set name {given[i]!r} is given twice; names must be unique")
    parts = [_components(u) for u in urls]
    depth = [1] * len(urls)
    while True:
        cur = [given[i] or "-".join(parts[i][-depth[i]:]) for i in range(len(urls))]
        grow = [i for i, n in enumerate(cur) if cur.count(n) > 1 and not given[i] and depth[i] < len(parts[i])]
        if not grow:
            break
        for i in grow:
            depth[i] += 1
    out: list[str] = []
    for i, n in enumerate(cur):
        k, name = 1, n
        while name in out or (not given[i] and name in given):
            k += 1
            name = f"{n}-{k}"
        out.append(name)
    return tuple(out)


def val_sets(tc: _ValConfig) -> tuple[ValSet, ...]:
    """The run's validation sets in order (empty: validation is off). Raises ValueError naming the field."""
    if not tc.val_data_url:
        if tc.val_extra_urls:
            raise ValueError("train.val_extra_urls needs train.val_data_url (the first --val-data) to be set")
        return ()
    urls = (tc.val_data_url, *tc.val_extra_urls)
    return tuple(ValSet(name=n, url=u) for n, u in zip(derive_names(urls, tc.val_names), urls))


def check_val_sets(sets: Sequence[ValSet], storage_options: dict | None) -> None:
    """Open every validation set's manifest.json (a few KB each) so that a typo or a refused bucket stops the
    run before its first step, in one line naming the URL, instead of at the first validation."""
    from shardtrain.format.manifest import DatasetError, open_dataset

    for s in sets:
        try:
            open_dataset(s.url, storage_options)
        except (DatasetError, OSError, ValueError) as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            raise DatasetError(f"validation set {s.name!r} cannot be opened: {s.url}: {reason} "
                               "(fix or drop that --val-data)") from None


def warn_missing_chars(sets: Sequence[ValSet], tok, storage_options: dict | None) -> dict[str, dict[str, int]]:
    """Log one warning per validation set whose normalised transcripts hold characters the character vocabulary
    lacks (they are dropped from its targets and cost CER), naming them with counts; {set name: {char: count}}.

    Cost: the text column of each set's index (no audio), once at start. Skipped for tokenizers without `chars`
    (SentencePiece maps unknown text to its own unknown piece). A set that cannot be read is left to the check above.
    """
    from shardtrain.format.manifest import DatasetError, open_dataset
    from shardtrain.train.normalize import describe_chars, missing_chars

    chars = getattr(tok, "chars", None)
    out: dict[str, dict[str, int]] = {}
    if chars is None:
        return out
    for s in sets:
        try:
            texts = open_dataset(s.url, storage_options).read_index(columns=["text"]).column("text").to_pylist()
        except (DatasetError, OSError, ValueError) as e:
            log.warning("validation set %r: cannot read its transcripts to check the vocabulary: %s", s.name, e)
            continue
        missing = missing_chars(texts, set(chars), tok.normalizer)
        if missing:
            out[s.name] = missing
            log.warning("validation set %r: %d character(s) of its transcripts are not in the training vocabulary "
                        "and are dropped from its targets (each costs CER): %s", s.name, len(missing),
                        describe_chars(missing))
    return out
