"""Sample keys that are safe everywhere a key appears: tar member names, webdataset, index rows, file names.

A key is `[A-Za-z0-9_-]{1,80}` (webdataset splits a name at its first dot, so no dots; no slashes). Input ids
that do not fit are sanitised, and any two items that would share a key get a short hash suffix, decided in
input order so the same input always gives the same keys.
"""
from __future__ import annotations

import hashlib
import re


# ---- keys ---------------------------------------------------------------------------------------------------
def _sha8(s: str, n: int = 8) -> str:
    return hashlib.sha1(s.encode("utf-8", "surrogatepass")).hexdigest()[:n]


def sanitize_key(source_id: str) -> str:
    """Map a source id to `[A-Za-z0-9_-]{1,80}`: every other character becomes `_`; ids longer than 80 characters
    keep their first 71 and get `-` + sha1[:8] of the full id, so distinct long ids stay distinct."""
    k = re.sub(r"[^A-Za-z0-9_-]", "_", source_id)
    if not k:
        return "id-" + _sha8(source_id)
    if len(k) > 80:
        return k[:71] + "-" + _sha8(source_id)
    return k


def assign_keys(ids: list[str]) -> dict[str, str]:
    """Collision-free keys for distinct ids, stable for a given set of ids (independent of their order).

    Ids that sanitise to the same key all get `-` + sha1(id)[:8] appended, except an id that already *is* that
    key (it keeps it). A second-level clash (a suffixed key equal to another key) retries with 16 hex digits.
    """
    groups: dict[str, list[str]] = {}
    for i in ids:
        groups.setdefault(sanitize_key(i), []).append(i)
    out: dict[str, str] = {}
    for k, members in groups.items():
        if len(members) == 1:
            out[members[0]] = k
            continue
        for i in members:
            out[i] = k if i == k else k[:71] + "-" + _sha8(i)
    taken: dict[str, str] = {}
    for i in sorted(out):
        k = out[i]
        if k in taken:
            k = sanitize_key(i)[:63] + "-" + _sha8(i, 16)
            if k in taken:
                raise ValueError(f"cannot find a collision-free key for ids {taken.get(k)!r} and {i!r}")
            out[i] = k
        taken[k] = i
    return out
