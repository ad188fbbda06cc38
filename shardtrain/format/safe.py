"""Terminal-safe text: what the CLI prints of data-derived strings (transcripts, keys, paths, manifest fields).

A dataset, a transcript or a file name is someone else's bytes: an ESC sequence in one can move the cursor,
rewrite earlier lines, set the window title or hide text on the terminal of whoever inspects it. `printable`
keeps ordinary text (any script, any printable Unicode) as it is and escapes the rest the way Python does
(`\\x1b`, `\\n`, `\\u202e`), so what is shown is what is there. Cost: one str.isprintable() per string (~1 us
for a 50-character line, measured on a loaded 2-core box); only non-printable strings pay for the escape (~12 us).
"""
from __future__ import annotations


def _escape(ch: str) -> str:
    return "\\t" if ch == "\t" else ch.encode("unicode_escape", "backslashreplace").decode("ascii")


def printable(text: object, limit: int | None = None) -> str:
    """`text` (str() of it) with every non-printable character escaped (control characters, line and paragraph
    separators, bidi overrides, lone surrogates); cut to `limit` characters with "..." when given."""
    s = text if isinstance(text, str) else str(text)
    if not s.isprintable():
        s = "".join(c if c.isprintable() else _escape(c) for c in s)
    if limit is not None and len(s) > limit:
        s = s[: max(limit - 3, 0)] + "..."
    return s


def printable_lines(text: str) -> str:
    """Multi-line output (a table, a summary) with each line made printable and its line breaks kept."""
    return "\n".join(printable(line) for line in text.split("\n"))
