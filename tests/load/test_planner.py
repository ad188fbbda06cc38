"""One Loader, one planner seam (issue 20): rows, blocks, and weighted mixtures (by rows and by blocks) answer the
same interface and keep the same invariants, on two small packed datasets with real audio: exactly once, equal
steps, budget, exact resume, elastic re-stripe, the skip share; a corrupt member of a mixture is one skip."""
import json
import logging
import os
import shutil

import numpy as np
import pytest

from shardtrain.format.manifest import open_dataset
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.load.reader import StreamError
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus
from shardtrain.world import World

BUDGET = 6.0
DURS_A = [0.3 + 0.17 * ((i * 7) % 23) for i in range(60)]
DURS_B = [0.4 + 0.21 * ((i * 5) % 17) for i in range(36)]
PLANNERS = ["rows", "blocks", "mixture", "mixture-blocks"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("seam")
    out = []
    for name, durs, seed in (("a", DURS_A, 1), ("b", DURS_B, 2)):
        corpus = make_corpus(root / f"corpus-{name}", durs, seed=seed)
        pack(PackConfig(input=str(corpus), output=str(root / name), max_samples_per_shard=8, workers=1,
                        progress=False))
        out.append(str(root / name))
    return out


def hours(url):
    return float(np.sum(open_dataset(url).read_index(columns=["duration_s"]).column(0).to_numpy()))


def sources_for(kind, packed):
    """What build_loader takes; mixture weights equal to the datasets' audio, so an epoch is one pass of each
    (exactly once is then checkable per dataset row)."""
    return packed[0] if kind in ("rows", "blocks") else [(u, hours(u)) for u in packed]


def config(kind, cache, **kw):
    planner = {"rows": "rows", "blocks": "blocks", "mixture": "rows", "mixture-blocks": "auto"}[kind]
    kw.setdefault("max_skipped_share", 1.0)
    return StreamConfig(bucket=BucketConfig(max_batch_seconds=BUDGET, chunk_mb=0.05, num_buckets=3),
                        epochs=kw.pop("epochs", 1), planner=planner, block_plan_min_rows=50, block_s=3.0,
                        index_cache_dir=str(cache), **kw)


def make(kind, packed, cache, world=World(), state=None, src=None, **kw):
    return build_loader(src or sources_for(kind, packed), world=world, seed=4, cfg=config(kind, cache, **kw),
                        state=state)


def durations(packed):
    return [open_dataset(u).read_index(columns=["duration_s"]).column(0).to_numpy() for u in packed]


def planned(loader, epoch, world_size, rank, chain=(), step=0):
    """[(sources, dataset rows)] per batch of `rank`, from the planner alone (no audio)."""
    view = loader.planner.epoch(epoch, world_size, chain)
    out = []
    for rc in view.chunks(rank, step):
        for b in rc.chunk.batches[max(0, step - rc.first_step):]:
            rows, src = rc.origin(b)
            out.append((src, rows))
    return view.steps, out


def pairs(batches):
    return [(int(s), int(r)) for src, rows in batches for s, r in zip(src, rows)]


def expected_pairs(kind, packed):
    n = [len(DURS_A), len(DURS_B)]
    return sorted((d, r) for d in range(1 if kind in ("rows", "blocks") else 2) for r in range(n[d]))


@pytest.mark.parametrize("kind", PLANNERS)
@pytest.mark.parametrize("world_size", [1, 3])
def test_exactly_once_equal_steps_budget(kind, world_size, packed, tmp_path):
    loader = make(kind, packed, tmp_path)
    assert loader.planner.name == ("rows" if kind in ("rows", "mixture") else "blocks")
    durs = durations(packed)
    per_rank = [planned(loader, 0, world_size, r) for r in range(world_size)]
    steps = {s for s, _ in per_rank} | {len(b) for _, b in per_rank}
    assert len(steps) == 1, "every rank yields the planner's steps"
    got = sorted(p for _, b in per_rank for p in pairs(b))
    assert got == expected_pairs(kind, packed)
    for _, batches in per_rank:
        for src, rows in batches:
            assert sum(durs[s][r] for s, r in zip(src, rows)) <= BUDGET + 1e-9


@pytest.mark.parametrize("kind", PLANNERS)
def test_elastic_restripe_from_any_rank_view(kind, packed, tmp_path):
    """Steps done under 2 ranks, the rest under 3: the planner answers both, and the epoch is still exactly once."""
    loader = make(kind, packed, tmp_path)
    k = 2
    done = [p for r in range(2) for p in pairs(planned(loader, 0, 2, r)[1][:k])]
    rest = [planned(loader, 0, 3, r, chain=((2, k),)) for r in range(3)]
    assert len({len(b) for _, b in rest}) == 1
    later = [p for _, b in rest for p in pairs(b)]
    assert sorted(done + later) == expected_pairs(kind, packed)


@pytest.mark.parametrize("kind", PLANNERS)
def test_a_resume_on_more_ranks_than_rows_left_ends_the_epoch_there(kind, packed, tmp_path):
    """One rank trained all but its last batch, then the run resumes on more ranks than that batch holds rows:
    the rest cannot be dealt in equal steps, so it is left out like the equal-steps tail (the epoch ends for every
    rank, the next one is whole) instead of a ValueError on every rank at iteration time."""
    loader = make(kind, packed, tmp_path)
    steps, batches = planned(loader, 0, 1, 0)
    last = len(batches[-1][1])
    more = last + 1
    rest = [planned(loader, 0, more, r, chain=((1, steps - 1),)) for r in range(more)]
    assert all(s == 0 and not b for s, b in rest)
    nxt = [planned(loader, 1, more, r) for r in range(more)]
    assert len({s for s, _ in nxt}) == 1 and sorted(p for _, b in nxt for p in pairs(b)) == expected_pairs(kind,
                                                                                                           packed)


def keys_of(batches):
    return [tuple(b.keys) for b in batches]


@pytest.mark.parametrize("kind", PLANNERS)
def test_resume_is_exact_and_batches_say_where_they_came_from(kind, packed, tmp_path):
    full, states = [], []
    loader = make(kind, packed, tmp_path, epochs=2)
    for b, st in loader:
        full.append(b)
        states.append(st)
    index_keys = [open_dataset(u).read_index(columns=["key"]).column(0).to_pylist() for u in packed]
    for b in full:  # Batch.rows / sources: each utterance's row in its dataset's index
        assert b.rows.dtype == np.int64 and len(b.rows) == len(b.sources) == len(b)
        assert [index_keys[s][r] for s, r in zip(b.sources.tolist(), b.rows.tolist())] == list(b.keys)
    for k in (1, len(full) // 2, len(full) - 2):
        state = json.loads(json.dumps(states[k - 1]))
        rest = [b for b, _ in make(kind, packed, tmp_path, epochs=2, state=state)]
        assert keys_of(rest) == keys_of(full[k:])
        assert [float(b.waves.sum()) for b in rest] == [float(b.waves.sum()) for b in full[k:]]
    if kind.startswith("mixture"):  # per-dataset seconds from the chunks themselves
        secs = loader.stats()["dataset_seconds"]
        want = [sum(float(b.durations_s[b.sources == d].sum()) for b in full) for d in range(2)]
        assert secs == pytest.approx(want) and min(secs) > 0


def corrupt(url, dst, n=1):
    """A copy of `url` whose first n audio members (of distinct rows) libsndfile refuses; their keys."""
    shutil.copytree(url, dst)
    idx = open_dataset(str(dst)).read_index().to_pylist()
    bad = []
    for row in idx[5:5 + n]:
        with open(dst / f"shard-{row['shard']:06d}.tar", "r+b") as f:
            f.seek(row["audio_offset"] + 100)
            f.write(os.urandom(min(4000, row["audio_size"] - 120)))
            f.seek(row["audio_offset"])
            f.write(b"XXXX")
        bad.append(row["key"])
    return str(dst), bad


@pytest.mark.parametrize("kind", ["mixture", "mixture-blocks"])
def test_mixture_with_a_corrupt_member_counts_one_skip(kind, packed, tmp_path):
    url, bad = corrupt(packed[1], tmp_path / "b-bad")
    src = [(packed[0], hours(packed[0])), (url, hours(url))]
    loader = make(kind, packed, tmp_path / "cache", src=src)
    batches = [b for b, _ in loader]
    stats = loader.stats()
    assert stats["skipped"] == 1 and stats["skipped_keys"][0]["key"] == bad[0]
    assert stats["skipped_keys"][0]["shard"].startswith("d1/")
    assert sum(len(b) for b in batches) == len(DURS_A) + len(DURS_B) - 1


@pytest.mark.parametrize("kind", PLANNERS)
def test_skip_share_stops_every_planner(kind, packed, tmp_path):
    url, _ = corrupt(packed[0], tmp_path / "a-bad", n=4)
    src = url if kind in ("rows", "blocks") else [(url, hours(url)), (packed[1], hours(packed[1]))]
    with pytest.raises(StreamError, match="max_skipped_share"):
        for _ in make(kind, packed, tmp_path / "cache", src=src, max_skipped_share=0.02):
            pass
    loader = make(kind, packed, tmp_path / "cache", src=src, max_skipped_share=0.2)
    for _ in loader:
        pass
    assert loader.stats()["skipped"] == 4


def test_mixture_above_the_block_threshold_plans_by_blocks_and_logs_it(packed, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="shardtrain.load.planner"):
        loader = make("mixture-blocks", packed, tmp_path)
    assert loader.planner.name == "blocks" and len(loader.planner.blocks) == 2
    assert any("planning by blocks" in r.getMessage() for r in caplog.records)
    small = build_loader(packed, world=World(), seed=0, cfg=StreamConfig(block_plan_min_rows=10_000))
    assert small.planner.name == "rows"


def test_bucket_fields_the_block_planner_ignores_are_refused(packed, tmp_path):
    with pytest.raises(ValueError, match="stream.bucket.padded_budget"):
        StreamConfig(planner="blocks", bucket=BucketConfig(padded_budget=True))
    with pytest.raises(ValueError, match="stream.bucket.bins_s.*planner=rows"):  # auto switches to blocks
        build_loader(packed[0], world=World(), seed=0, cfg=StreamConfig(
            planner="auto", block_plan_min_rows=10, index_cache_dir=str(tmp_path), bucket=BucketConfig(bins_s=(2.0,))))


def test_default_loader_runs_one_epoch_and_stops(packed):
    loader = build_loader(packed[0], world=World(), seed=0, cfg=StreamConfig(bucket=BucketConfig(max_batch_seconds=8)))
    batches = [b for b, _ in loader]
    assert {b.epoch for b in batches} == {0} and sum(len(b) for b in batches) == len(DURS_A)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["step"] == 0
    endless = build_loader(packed[0], world=World(), seed=0,
                           cfg=StreamConfig(bucket=BucketConfig(max_batch_seconds=8), epochs=None))
    it = iter(endless)
    steps = endless.steps_per_epoch(0) + endless.steps_per_epoch(1)  # epochs may differ by a step or two
    assert steps == len(batches) + endless.steps_per_epoch(1)
    assert max(next(it)[0].epoch for _ in range(steps + 1)) == 2


def test_epoch_boundary_state_resumes_under_new_budgets(packed, tmp_path):
    """The trainer may change budgets between epochs by rebuilding the loader; mid-epoch it may not."""
    states = [st for _, st in make("rows", packed, tmp_path)]
    assert (states[-1]["epoch"], states[-1]["step"]) == (1, 0)
    table = ((1.0, 9.0), (3.0, 5.0))
    new = StreamConfig(bucket=BucketConfig(max_batch_seconds=BUDGET, chunk_mb=0.05, budget_table=table), epochs=2,
                       planner="rows")
    rest = [b for b, _ in build_loader(packed[0], world=World(), seed=4, cfg=new, state=states[-1])]
    assert {b.epoch for b in rest} == {1} and sum(len(b) for b in rest) == len(DURS_A)
    with pytest.raises(StreamError, match="mid-epoch"):
        build_loader(packed[0], world=World(), seed=4, cfg=new, state=states[0])


@pytest.mark.parametrize("resume_at", [0, 1])
def test_first_chunk_is_read_one_batch_at_a_time(packed, tmp_path, resume_at):
    """The stream starts (and resumes) with one-batch reads: the first batch waits for one batch's decode."""
    from shardtrain.load.loader import _schedule

    cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=BUDGET, num_buckets=1))  # chunks of 4 batches
    loader = build_loader(packed[0], world=World(), seed=0, cfg=cfg)
    state = None
    if resume_at:
        it = iter(loader)
        state = next(it)[1]
        it.close()
    loader = build_loader(packed[0], world=World(), seed=0, cfg=cfg, state=state)
    items = list(_schedule(loader.planner, loader.world, loader.cfg, loader.cursor))
    chunk = loader.planner.epoch(0, 1).chunks(0, resume_at)
    first = next(chunk)
    n = len(first.chunk.batches) - (resume_at - first.first_step)
    assert n >= 1 and [len(i.rc.chunk.batches) for i in items[:n]] == [1] * n
    assert [i.first_step for i in items[:n + 1]] == list(range(resume_at, resume_at + n + 1))
    assert len(items[n].rc.chunk.batches) > 1  # later chunks are read whole
