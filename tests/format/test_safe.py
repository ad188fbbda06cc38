"""format/safe.py: data-derived text made terminal-safe (the CLI output it protects:
tests/format/test_trust_format.py)."""
from __future__ import annotations

from shardtrain.format.safe import printable, printable_lines


def test_ordinary_text_unchanged_control_characters_escaped():
    for ok in ("hello world", "Grüße, 你好, مرحبا", "tab-free: a b"):
        assert printable(ok) == ok
    assert printable("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert printable("x\ny\tz") == "x\\ny\\tz"
    assert printable("evil\u202etxt.exe") == "evil\\u202etxt.exe"
    assert printable("line\u2028sep") == "line\\u2028sep"
    assert printable(12) == "12"


def test_limit_and_lines():
    assert printable("abcdefghij", limit=6) == "abc..." and printable("abc", limit=6) == "abc"
    assert printable("\x07" * 10, limit=8) == "\\x07\\..."  # the escaped text is what is cut
    assert printable_lines("ok\nbad\x1b]0;title\x07\n") == "ok\nbad\\x1b]0;title\\x07\n"
