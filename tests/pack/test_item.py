"""pack/item.py: the line and row helpers every input reader shares (the readers themselves:
tests/pack/test_sources.py, test_corpora.py, test_metadata.py)."""
from __future__ import annotations

import csv
import io

from shardtrain.pack.item import Item, Reject, opt_str, split_lines, table_rows


def test_split_lines_only_at_newline():
    text = "a\tone\u2028two\r\nb\tform\x0cfeed\rcr\nc\tnel\u0085x"
    assert split_lines(text) == ["a\tone\u2028two", "b\tform\x0cfeed\rcr", "c\tnel\u0085x"]
    assert len(text.splitlines()) == 7  # what str.splitlines would have made of it
    assert split_lines("x\n") == ["x", ""]


def test_opt_str():
    assert opt_str(None) is None and opt_str("") is None and opt_str(0) == "0" and opt_str("spk") == "spk"


def test_table_rows_skips_blank_rows_and_rejects_wrong_field_counts():
    reader = csv.reader(io.StringIO("a.wav,hello\n\n , \nb.wav,too,many\nc.wav,bye\n"))
    got = list(table_rows(reader, "m.csv", ["path", "text"]))
    assert got[0] == ("m.csv:1", {"path": "a.wav", "text": "hello"})
    assert got[1] == Reject("m.csv:4", "m.csv:4", "bad_row: line 4 has 3 fields, header has 2")
    assert got[2] == ("m.csv:5", {"path": "c.wav", "text": "bye"}) and len(got) == 3


def test_item_is_frozen_with_defaults():
    it = Item(id="x", audio="/a/x.flac", text="hi")
    assert (it.start_s, it.duration_s, it.speaker, it.extra) == (0.0, None, None, ())
    try:
        it.text = "other"  # type: ignore[misc]
    except AttributeError:
        pass
    else:
        raise AssertionError("Item must be immutable")
