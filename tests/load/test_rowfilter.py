"""Load-time row filters (StreamConfig.min_duration_s/max_duration_s/speakers/exclude_speakers) on a real packed
dataset: exactly the kept rows, once per epoch over 2 ranks; the left-out ones counted; a mid-epoch resume with
another filter refused."""
import logging

import numpy as np
import pytest

from shardtrain.format.manifest import open_dataset
from shardtrain.load.config import StreamConfig
from shardtrain.load.errors import StreamError
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.load.mixplan import make_planner
from shardtrain.train.overrides import apply_override
from shardtrain.world import World

from conftest import pack_tones

DURS = [0.3 + 0.17 * ((i * 7) % 23) for i in range(60)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    # the manifest carries speakers spk0..spk2
    return pack_tones(tmp_path_factory.mktemp("filters"), DURS, seed=3, input_name="manifest.jsonl")


def cfg(**kw) -> StreamConfig:
    return StreamConfig(bucket=BucketConfig(max_batch_seconds=8.0, chunk_mb=0.05, num_buckets=4), epochs=2,
                        max_skipped_share=1.0, planner="rows", **kw)


def index(url):
    t = open_dataset(url).read_index(columns=["key", "duration_s", "speaker"])
    return (t.column("key").to_pylist(), np.asarray(t.column("duration_s").to_pylist()),
            t.column("speaker").to_pylist())


def epochs_keys(url, c, world_size=2):
    """{epoch: [keys over all ranks]} and each rank's loader."""
    out, loaders = {}, []
    for r in range(world_size):
        loader = build_loader(url, world=World(rank=r, world_size=world_size), seed=0, cfg=c)
        for batch, st in loader:
            out.setdefault(st["epoch"] if st["step"] else st["epoch"] - 1, []).extend(batch.keys)
        loaders.append(loader)
    return out, loaders


def test_kept_rows_exactly_once_per_epoch_over_two_ranks_and_filtered_counted(dataset, caplog):
    keys, dur, spk = index(dataset)
    c = cfg(min_duration_s=1.0, max_duration_s=3.5, exclude_speakers=("spk1",))
    kept = sorted(k for k, d, s in zip(keys, dur, spk) if 1.0 <= d <= 3.5 and s != "spk1")
    assert 0 < len(kept) <= len(keys) - 10 and "spk1" in spk
    with caplog.at_level(logging.WARNING):
        per_epoch, loaders = epochs_keys(dataset, c)
    assert sorted(per_epoch) == [0, 1]
    for e, got in per_epoch.items():
        assert sorted(got) == kept, f"epoch {e}"
    for loader in loaders:
        assert loader.counters["filtered"] == 2 * (len(keys) - len(kept))
        assert loader.counters["too_long"] == 0
    assert sum("left out of every epoch by the load-time filters" in r.message for r in caplog.records) == 2
    planner = make_planner(dataset, seed=0, cfg=c)  # what `shardtrain plan` and the ledger see
    assert sorted(keys[i] for i in planner.selection(0)[1]) == kept


def test_speakers_include_set_with_overrides(dataset):
    keys, _, spk = index(dataset)
    c = apply_override(apply_override(cfg(), "speakers", "spk0,spk2"), "min_duration_s", "0.5")
    assert c.speakers == ("spk0", "spk2") and c.min_duration_s == 0.5
    planner = make_planner(dataset, seed=0, cfg=c)
    _, dur, _ = index(dataset)
    want = sorted(k for k, s, d in zip(keys, spk, dur) if s in ("spk0", "spk2") and d >= 0.5)
    assert sorted(keys[i] for i in planner.selection(0)[1]) == want
    assert planner.filtered == len(keys) - len(want)


def test_mid_epoch_resume_with_another_filter_refused(dataset):
    c = cfg(max_duration_s=3.0)
    loader = build_loader(dataset, world=World(), seed=0, cfg=c)
    it = iter(loader)
    next(it)
    _, state = next(it)
    assert state["step"] > 0
    with pytest.raises(StreamError, match="load-time filters"):
        build_loader(dataset, world=World(), seed=0, cfg=cfg(max_duration_s=2.0), state=state)
    with pytest.raises(StreamError, match="load-time filters"):
        build_loader(dataset, world=World(), seed=0, cfg=cfg(), state=state)
    same = build_loader(dataset, world=World(), seed=0, cfg=cfg(max_duration_s=3.0), state=state)
    assert same.cursor.step == state["step"]


def test_blocks_planner_refuses_filters_by_name():
    with pytest.raises(ValueError, match="stream.planner=rows"):
        from shardtrain.load.planner import by_blocks
        by_blocks(StreamConfig(planner="blocks", speakers=("a",)), 10, "ds")


def test_all_rows_filtered_is_a_clear_error(dataset):
    with pytest.raises(StreamError, match="load-time filters"):
        build_loader(dataset, world=World(), seed=0, cfg=cfg(speakers=("nobody",)))


def test_mixture_by_rows_selects_only_kept_rows(dataset):
    keys, dur, _ = index(dataset)
    c = cfg(max_duration_s=2.0)
    planner = make_planner([(dataset, 1.0), (dataset, 2.0)], seed=0, cfg=c)
    src, rows = planner.selection(0)
    assert planner.name == "rows" and len(rows) > 0 and set(src.tolist()) == {0, 1}
    assert dur[rows].max() <= 2.0
    assert planner.filtered == 2 * int((dur > 2.0).sum())


def test_elastic_restripe_keeps_the_filter(dataset):
    """2 ranks for 2 steps, then 3 ranks finish the epoch: still exactly the kept rows, once."""
    keys, dur, _ = index(dataset)
    c = StreamConfig(bucket=cfg().bucket, epochs=1, max_skipped_share=1.0, planner="rows", max_duration_s=3.0)
    kept = sorted(k for k, d in zip(keys, dur) if d <= 3.0)
    seen, state = [], None
    for r in range(2):
        loader = build_loader(dataset, world=World(rank=r, world_size=2), seed=0, cfg=c)
        for i, (batch, st) in enumerate(loader):
            seen.extend(batch.keys)
            state = st
            if i == 1:
                break
    for r in range(3):
        seen.extend(k for b in build_loader(dataset, world=World(rank=r, world_size=3), seed=0, cfg=c,
                                            state=state).batches() for k in b.keys)
    assert sorted(seen) == kept
