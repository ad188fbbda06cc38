"""pack/shard_task.py: one shard written by a real task from real FLAC, and who writes its done-marker."""
from __future__ import annotations

import json
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
