"""pack/layout.py: the columnar key assignment equals pack/keys.assign_keys, clashes and long ids included."""
from __future__ import annotations

from shardtrain.pack.keys import assign_keys, sanitize_key


def test_columnar_keys_equal_assign_keys():
    import pyarrow as pa

    from shardtrain.pack.layout import assign_keys_columnar

    def columnar(ids):
        return assign_keys_columnar(pa.chunked_array([pa.array(ids)]),
                                    pa.chunked_array([pa.array([sanitize_key(i) for i in ids])])).to_pylist()

    ids = ["a.b/c", "a_b_c", "a/b.c", "ok-1", "x" * 120, "x" * 119 + "y", "", "é", "plain"]
    assert columnar(ids) == [assign_keys(ids)[i] for i in ids]
    clash = assign_keys(["a.b", "a/b"])["a.b"]  # "a_b-<sha8>": an id equal to it clashes on the second level
    ids2 = ["a.b", "a/b", clash]
    assert columnar(ids2) == [assign_keys(ids2)[i] for i in ids2] and len(set(columnar(ids2))) == 3
