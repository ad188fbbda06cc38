"""pack/parts.py: an input cut into parts in input order; the concatenation of every part's items is exactly
`sources.iter_items(input)`, whatever the part size, for a folder (listed on the driver, transcripts read where the
part runs), a manifest (parsed on the driver) and a LibriSpeech tree (whole chapters). Real files from make_corpus.
"""
from __future__ import annotations

import pytest

from shardtrain.pack.parts import iter_parts, part_items
from shardtrain.pack.sources import iter_items
from shardtrain.testing.corpus import make_corpus

DURS = [0.3, 0.4, 0.5, 0.6, 0.7]


def _joined(input: str, size: int) -> tuple[list, list]:
    parts = list(iter_parts(input, part_items=size))
    return parts, [x for p in parts for x in part_items(p)]


@pytest.mark.parametrize("size", [1, 2, 1024])
def test_parts_of_a_folder_and_a_manifest_concatenate_to_iter_items(tmp_path, size):
    root = make_corpus(tmp_path / "c", DURS, seed=4)
    (root / "utt-00002.txt").unlink()  # a reject in the middle keeps its place
    folder = root / "dir"
    folder.mkdir()
    for p in root.glob("utt-*"):
        p.rename(folder / p.name)
    parts, got = _joined(str(folder), size)
    assert got == list(iter_items(str(folder))) and len(got) == len(DURS)
    assert [p.index for p in parts] == list(range(len(parts))) == list(range(-(-len(DURS) // size)))
    assert all(p.source_format == "dir" and p.entries and not p.items for p in parts)  # paths only on the driver
    assert [type(x).__name__ for x in got].count("Reject") == 1

    manifest = make_corpus(tmp_path / "m", DURS, seed=4) / "manifest.jsonl"
    parts, got = _joined(str(manifest), size)
    assert got == list(iter_items(str(manifest))) and [x.id for x in got] == [f"utt-{i:05d}" for i in range(5)]
    assert all(p.items and not p.entries and p.source_format != "auto" for p in parts)  # parsed on the driver
    assert [len(p.items) for p in parts][:-1] == [size] * (len(parts) - 1)


def test_librispeech_parts_are_whole_chapters(speech_corpus):
    parts, got = _joined(str(speech_corpus), 64)  # ~1 chapter a part at this size
    assert got == list(iter_items(str(speech_corpus))) and len(got) == 20
    assert all(p.source_format == "librispeech" for p in parts) and len(parts) >= 1
    chapters = [{x.id.rsplit("-", 1)[0] for x in part_items(p)} for p in parts]
    assert all(a.isdisjoint(b) for i, a in enumerate(chapters) for b in chapters[i + 1:])  # no chapter split


def test_split_is_refused_for_anything_but_hugging_face(tmp_path):
    manifest = make_corpus(tmp_path / "m", DURS[:1], seed=4) / "manifest.tsv"
    with pytest.raises(ValueError, match="--split test applies to a Hugging Face DatasetDict"):
        next(iter_parts(str(manifest), split="test"))
