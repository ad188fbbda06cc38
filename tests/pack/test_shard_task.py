"""pack/shard_task.py: one shard written by a real task from real FLAC, and who writes its done-marker."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from shardtrain.pack.packer import AudioTarget
from shardtrain.testing.corpus import make_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus"), [0.25, 2.0, 0.5], seed=1)


def _one_shard_task(corpus: Path, out: Path, defer_sync: bool):
    from shardtrain.pack.probe import probe
    from shardtrain.pack.shard_task import SampleSpec, ShardTask
    from shardtrain.pack.sources import Item

    samples = []
    for i, path in enumerate(sorted(corpus.glob("*.flac"))[:3]):
        info = probe(str(path))
        samples.append(SampleSpec(key=f"k{i}", item=Item(id=path.stem, audio=str(path), text="t"), info=info,
                                     duration_s=info.duration_s, est_bytes=path.stat().st_size))
    return ShardTask(shard=0, output=str(out), storage_options=None, samples=samples, target=AudioTarget(),
                     fingerprint="f" * 64, defer_sync=defer_sync)


@pytest.mark.parametrize("defer_sync", [False, True])
def test_done_marker_written_only_by_whoever_syncs_the_shard(corpus, tmp_path, defer_sync):
    """A pool's shard task leaves the fsync and the done-marker to the driver (publish_marker), so that a marker
    never exists for a shard that is not yet on disk; a task on its own does both."""
    from shardtrain.pack.shard_task import marker_name, publish_marker, write_shard

    out = tmp_path / "out"
    marker = write_shard(_one_shard_task(corpus, out, defer_sync))
    tar, done = out / marker["info"]["name"], out / "_work" / marker_name(0)
    assert tar.stat().st_size == marker["info"]["bytes"] and marker["info"]["samples"] == 3
    assert done.exists() is not defer_sync
    if defer_sync:
        publish_marker(str(out), None, marker)
    assert json.loads(done.read_text()) == json.loads(json.dumps(marker, sort_keys=True))


@pytest.fixture(scope="module")
def six(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("six"), [0.3, 1.2, 0.5, 0.9, 0.4, 0.7], seed=2)


def _layout_task(corpus: Path, out: Path, reverse: bool):
    """A shard of the six files plus a missing one (an encode reject), in layout order ((duration, key)), or
    reversed: then the slices are out of the stored order and the whole shard must be sorted after encoding."""
    from dataclasses import replace

    from shardtrain.pack.probe import probe
    from shardtrain.pack.shard_task import SampleSpec, ShardTask
    from shardtrain.pack.sources import Item

    samples = []
    for i, path in enumerate(sorted(corpus.glob("*.flac"))):
        info = probe(str(path))
        samples.append(SampleSpec(key=f"k{i}", item=Item(id=path.stem, audio=str(path), text="t"), info=info,
                                  duration_s=info.duration_s, est_bytes=path.stat().st_size))
    gone = replace(samples[0].item, id="gone", audio=str(corpus / "gone.flac"))
    samples.append(replace(samples[0], key="k9", item=gone, duration_s=0.55))
    samples.sort(key=lambda s: (s.duration_s, s.key), reverse=reverse)
    return ShardTask(shard=0, output=str(out), storage_options=None, samples=samples, target=AudioTarget(),
                     fingerprint="f" * 64, defer_sync=True)


@pytest.mark.parametrize("order", ["sorted", "reversed", "late"])
def test_shard_stream_writes_the_bytes_finish_shard_writes(six, tmp_path, order):
    """Slices of two samples come back as spool files in any order: ShardStream appends them as they become
    contiguous (layout order = stored order), or gives up on the first sample out of order (reversed layout:
    at once; "late": after two slices were appended) and sorts the whole shard, reading the appended slices back
    from its partial tar; the tar, its sha256, rows, rejects and marker are finish_shard's either way, and no
    spool or temp file is left."""
    from dataclasses import replace

    from shardtrain.pack.shard_task import ShardStream, encode_slice, finish_shard, spool_slice

    marks = {}
    for name in ("ref", "stream"):
        task = _layout_task(six, tmp_path / name, order == "reversed")
        if order == "late":  # the last two samples swapped: the third slice is out of order
            task = replace(task, samples=task.samples[:4] + task.samples[4:][::-1])
        starts = list(range(0, len(task.samples), 2))
        if name == "ref":
            marks[name] = finish_shard(task, [encode_slice((replace(task, samples=task.samples[a:a + 2]), a))
                                              for a in starts])
            continue
        results = [spool_slice((replace(task, samples=task.samples[a:a + 2]), a)) for a in starts]
        assert all(Path(r[2][0].path).stat().st_size == r[2][0].nbytes for r in results)
        stream = ShardStream(task, starts)
        for shard, first, res in (results[2], results[0], results[3], results[1]):
            stream.add(first, res)
        assert stream.streaming is (order == "sorted") and sorted(stream.base) == ([] if order == "reversed" else
                                                                                  starts[:len(stream.base)])
        if order == "late":
            assert sorted(stream.base) == [0, 2]  # appended before the streaming ended: read back from the tar
        if order == "sorted" and sys.platform.startswith("linux"):  # the disk writes started as it went
            assert stream.tar is not None and 0 < stream.tar.flushed == stream.tar.w.bytes
        marks[name] = stream.finish()
        assert [p.name for p in (tmp_path / name / "_work").iterdir()] == []  # no spool or temp file left behind
    ref, got = marks["ref"], marks["stream"]
    assert [r["reason"] for r in ref["rejects"]] == ["missing_file"] and ref["info"]["samples"] == 6
    assert json.dumps(got, sort_keys=True) == json.dumps(ref, sort_keys=True)
    name = ref["info"]["name"]
    assert (tmp_path / "stream" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


def test_shard_stream_reports_a_lost_spool_file(six, tmp_path):
    """A spool file removed before the driver appends it is an error naming it (never a shard with empty audio),
    raised again by finish, and the partial tar and other spool files are removed."""
    from dataclasses import replace

    from shardtrain.pack.shard_task import PackError, ShardStream, spool_slice

    task = _layout_task(six, tmp_path / "out", False)
    starts = list(range(0, len(task.samples), 2))
    results = [spool_slice((replace(task, samples=task.samples[a:a + 2]), a)) for a in starts]
    lost = results[1][2][0].path
    Path(lost).unlink()
    stream = ShardStream(task, starts)
    stream.add(0, results[0][2])
    with pytest.raises(PackError, match="spool.* is gone"):
        stream.add(2, results[1][2])
    for _, first, res in results[2:]:
        stream.add(first, res)
    with pytest.raises(PackError, match="spool.* is gone"):
        stream.finish()
    assert [p.name for p in (tmp_path / "out" / "_work").iterdir()] == []


def test_what_the_pool_pickles_keeps_every_field():
    """Item, AudioInfo, SampleSpec and MemberOffsets pickle as a tuple of their fields (__reduce__, for speed): a
    field added to the class but not to its __reduce__ would be lost, or shifted into another, on the way to a
    worker; every field here has a value unlike its default and unlike the others."""
    import dataclasses
    import pickle

    from shardtrain.format.audio import AudioInfo
    from shardtrain.format.tar import MemberOffsets
    from shardtrain.pack.item import Item
    from shardtrain.pack.shard_task import SampleSpec

    item = Item(id="a", audio="/x/a.flac", text="t", start_s=1.5, duration_s=2.5, speaker="s", language="en",
                extra=(("k", 1),))
    info = AudioInfo(duration_s=3.5, sample_rate_hz=16000, num_samples=56000, channels=2, codec="flac")
    for obj in (item, info, SampleSpec(key="k", item=item, info=info, duration_s=4.5, est_bytes=7),
                MemberOffsets(offset=1, size=2, audio_offset=3, audio_size=4, json_offset=5, json_size=6)):
        fields = [f.name for f in dataclasses.fields(obj)]
        assert len(obj.__reduce__()[1]) == len(fields), type(obj).__name__
        back = pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        assert type(back) is type(obj) and [getattr(back, f) for f in fields] == [getattr(obj, f) for f in fields]
