"""pack/nothing.py: the one line a pack that accepted nothing stops with (counts, top reasons with an example, the
hint for the most common cause), from the real packer on real inputs and from the message builder on reject rows."""
from __future__ import annotations

import pytest

from shardtrain.pack.nothing import NothingAccepted, nothing_accepted_message
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.pack.shard_task import PackError
from shardtrain.testing.corpus import make_corpus


def test_a_folder_without_transcripts_names_the_table_beside_it(tmp_path):
    corpus = make_corpus(tmp_path / "c", [0.3, 0.4, 0.5], seed=1)
    root = tmp_path / "audio"  # the FLAC files, no x.txt, and a table under a name pack does not look for
    root.mkdir()
    for p in corpus.glob("*.flac"):
        p.rename(root / p.name)
    (root / "labels.csv").write_text("file,sentence\n")
    with pytest.raises(NothingAccepted) as e:
        pack(PackConfig(input=str(root), output=str(tmp_path / "out"), workers=1, progress=False))
    msg = str(e.value)
    assert isinstance(e.value, PackError) and not (tmp_path / "out" / "manifest.json").exists()
    assert msg.startswith(f"no utterance accepted from {root} (3 rejects: missing_transcript x3 (e.g. ")
    assert "the folder holds labels.csv: pass it as INPUT" in msg and msg.endswith("no dataset written")


def test_message_ranks_reasons_and_hints_at_the_top_one():
    rejects = [{"reason": "missing_audio", "path": f"/a/{i}.wav"} for i in range(3)] + \
              [{"reason": "too_short", "detail": "0.1 s < 0.2 s"}] + [{"reason": "empty_transcript", "id": "x\x1b"}]
    msg = nothing_accepted_message("m.tsv", "tsv", rejects)
    assert "(5 rejects: missing_audio x3 (e.g. /a/0.wav); too_short x1 (e.g. 0.1 s < 0.2 s); " \
           "empty_transcript x1 (e.g. x\\x1b))" in msg  # the example printed escaped
    assert "relative audio paths are read against the manifest's folder" in msg
    assert "--audio-column COL" in nothing_accepted_message("m.tsv", "tsv", rejects[-1:])
    assert "the input listed no utterance" in nothing_accepted_message("empty.tsv", "tsv", [])
    bare = nothing_accepted_message(str(tmp := "/nonexistent/dir"), "dir", [{"reason": "missing_transcript"}])
    assert tmp in bare and "a folder of audio needs x.txt beside x.wav" in bare
