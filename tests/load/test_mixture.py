"""Mixture planning is pure: shares, no repeat before a dataset is exhausted, and every plan_epoch property
(equal steps, exactly once, elastic re-stripe, 256 ranks) on the mixed virtual rows. No audio, no processes."""
import numpy as np
import pytest

from shardtrain.load.mixture import gather_index, select_epoch
from shardtrain.load.padding import bucket_phase
from shardtrain.load.plan import BucketConfig, _bucket_ranges, consumed_rows, plan_epoch

from test_plan import all_batches, fake_index

SEED = 11


def three():
    """A large read-speech set, a small accented one, a medium conversational one (different lengths)."""
    return [fake_index(20_000, seed=1, lo=2.0, hi=20.0), fake_index(600, seed=2, lo=1.0, hi=8.0),
            fake_index(5_000, seed=3, lo=0.5, hi=12.0)]


WEIGHTS = [1.0, 1.0, 2.0]


def test_each_dataset_fills_its_weight_share_of_every_epoch():
    idx = three()
    durs = [i.duration_s for i in idx]
    total = sum(float(d.sum()) for d in durs)
    for epoch in (0, 1, 7):
        mix = select_epoch(durs, WEIGHTS, seed=SEED, epoch=epoch)
        want = total * np.array(WEIGHTS) / sum(WEIGHTS)
        longest = np.array([d.max() for d in durs])
        assert np.all(np.abs(mix.seconds - want) <= longest + 1e-6), (mix.seconds, want)
        dv = np.array([durs[s][r] for s, r in zip(mix.source, mix.row)])
        assert np.all(np.diff(dv) >= 0)


@pytest.mark.parametrize("source", [0, 1, 2])
def test_every_sample_once_before_any_repeat(source):
    """Concatenating epochs gives each dataset's stream: within each pass of n rows, all n distinct."""
    idx = three()
    durs = [i.duration_s for i in idx]
    n = len(durs[source])
    stream = np.concatenate([np.sort(select_epoch(durs, WEIGHTS, seed=SEED, epoch=e).row[
        select_epoch(durs, WEIGHTS, seed=SEED, epoch=e).source == source]) for e in range(6)])
    # the stream order inside an epoch is lost by sorting, so check counts instead: after k full passes every
    # row was seen k or k+1 times, never k+2 (no row comes back before all others had their turn)
    counts = np.bincount(stream, minlength=n)
    assert counts.max() - counts.min() <= 1, np.bincount(counts)
    if source == 1:  # the small, heavily weighted set repeats ...
        assert counts.min() >= 2
    if source == 0:  # ... the large one (a quarter of its audio per epoch) comes round once in 4 epochs
        assert counts.max() == 2 and (counts == 1).any()


def test_large_dataset_epochs_are_disjoint_until_exhausted():
    idx = three()
    durs = [i.duration_s for i in idx]
    seen = [set(select_epoch(durs, WEIGHTS, seed=SEED, epoch=e).row[
        select_epoch(durs, WEIGHTS, seed=SEED, epoch=e).source == 0].tolist()) for e in range(3)]
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2])


def test_pure_and_seeded():
    durs = [i.duration_s for i in three()]
    a, b = select_epoch(durs, WEIGHTS, seed=SEED, epoch=3), select_epoch(durs, WEIGHTS, seed=SEED, epoch=3)
    c = select_epoch(durs, WEIGHTS, seed=SEED + 1, epoch=3)
    assert np.array_equal(a.row, b.row) and np.array_equal(a.source, b.source)
    assert not (len(a.row) == len(c.row) and np.array_equal(a.row, c.row))


def test_bad_weights_and_empty_datasets_are_refused():
    durs = [i.duration_s for i in three()]
    with pytest.raises(ValueError, match="positive"):
        select_epoch(durs, [1.0, 0.0, 1.0], seed=0, epoch=0)
    with pytest.raises(ValueError, match="hold no audio"):
        select_epoch(durs + [np.zeros(0)], [1, 1, 1, 1], seed=0, epoch=0)


@pytest.mark.parametrize("world_size", [1, 8, 256])
def test_mixture_plan_equal_steps_exactly_once_lock_step(world_size):
    idx = three()
    mix = select_epoch([i.duration_s for i in idx], WEIGHTS, seed=SEED, epoch=2)
    v = gather_index(idx, mix)
    cfg = BucketConfig(max_batch_seconds=120.0)
    plan = plan_epoch(v, seed=SEED, epoch=2, world_size=world_size, cfg=cfg)
    rows = np.concatenate(all_batches(plan))
    assert len(rows) == len(np.unique(rows)) == len(v) - len(plan.too_long)
    assert {sum(len(c.batches) for c in plan.rank_chunks(r)) for r in range(world_size)} == {plan.steps}
    # a shard id names one dataset's shard: the gathered offsets are that dataset's
    for s in (0, 1, 2):
        m = mix.source == s
        assert np.array_equal(v.offset[m], idx[s].offset[mix.row[m]])
    assert len(np.unique(v.shard[mix.source == 1])) and set(v.shard[mix.source == 1]).isdisjoint(v.shard[mix.source == 0])
    bucket_of = np.full(len(v), -1)
    phase = bucket_phase(SEED, 2)  # this epoch's bucket edges (they move every epoch)
    for b, rows_b in enumerate(_bucket_ranges(np.flatnonzero(v.duration_s <= 120.0), v.duration_s, cfg, world_size,
                                              phase)):
        bucket_of[rows_b] = b
    for g in plan.groups:  # lock-step: at every step all ranks draw from one duration bucket, whatever dataset
        assert len({int(bucket_of[r]) for c in g for r in c.rows}) == 1


def test_mixture_elastic_restripe_rest_of_epoch_exactly_once():
    idx = three()
    mix = select_epoch([i.duration_s for i in idx], WEIGHTS, seed=SEED, epoch=1)
    v = gather_index(idx, mix)
    cfg = BucketConfig(max_batch_seconds=90.0)
    old = plan_epoch(v, seed=SEED, epoch=1, world_size=8, cfg=cfg)
    done = consumed_rows(old, old.steps // 3)
    mask = np.zeros(len(v), bool)
    mask[done] = True
    new = plan_epoch(v, seed=SEED, epoch=1, world_size=3, cfg=cfg, exclude=mask)
    both = np.concatenate([done, np.concatenate(all_batches(new))])
    assert len(both) == len(np.unique(both)) == len(v) - len(old.too_long)
    assert len({sum(len(c.batches) for c in new.rank_chunks(r)) for r in range(3)}) == 1
