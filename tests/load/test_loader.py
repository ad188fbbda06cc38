"""Loader.restart: the closed loop's re-plan at an epoch boundary (train/trainer.py) on a real packed dataset.
Restarted with a new budget table from a boundary state, the loader yields what a loader built afresh with that
table from that state yields, every batch within the new table's budgets, and a state taken after the restart
resumes the same continuation."""
import hashlib
from itertools import islice

import pytest

from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig, batch_budget_s, batch_cost
from shardtrain.load.reader import StreamError
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus
from shardtrain.world import World

DURS = [0.3 + 0.17 * ((i * 7) % 23) for i in range(60)]
OLD = BucketConfig(max_batch_seconds=8.0, chunk_mb=0.05, num_buckets=4)
NEW = BucketConfig(max_batch_seconds=8.0, chunk_mb=0.05, num_buckets=4, budget_table=((1.5, 3.0), (5.0, 5.0)))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("restart")
    corpus = make_corpus(root / "corpus", DURS, seed=3)
    pack(PackConfig(input=str(corpus), output=str(root / "ds"), max_samples_per_shard=8, workers=1, progress=False))
    return str(root / "ds")


def stream(bucket: BucketConfig) -> StreamConfig:
    return StreamConfig(bucket=bucket, epochs=None, max_skipped_share=1.0)


def seen(pairs) -> list[tuple]:
    """(epoch, step, keys, sha1 of the waves) per batch."""
    return [(b.epoch, b.step, tuple(b.keys), hashlib.sha1(b.waves.numpy().tobytes()).hexdigest()) for b, _ in pairs]


def to_boundary(loader):
    """Read epoch 0; returns the state of its last batch (cursor: epoch 1, step 0) and epoch 1's first batch."""
    it = iter(loader)
    last = None
    for batch, state in it:
        if batch.epoch == 1:
            it.close()
            return last, batch
        last = state
    raise AssertionError("the stream ended")


def test_restart_with_a_new_table_plans_from_the_boundary_and_continues_deterministically(dataset):
    world = World()
    loader = build_loader(dataset, world=world, seed=5, cfg=stream(OLD))
    state, first_old = to_boundary(loader)
    assert (state["epoch"], state["step"]) == (1, 0)
    loader.restart(stream(NEW), {**state, "chain": []})
    assert loader.stats()["batches"] == state["counters"]["batches"]  # the counters come from the state
    it = iter(loader)
    got = list(islice(it, 8))
    it.close()
    assert [(e, s) for e, s, _, _ in seen(got)] == [(1, s) for s in range(8)]
    # what a loader built afresh with the new table from the same state yields
    fresh = build_loader(dataset, world=world, seed=5, cfg=stream(NEW), state=state)
    it = iter(fresh)
    assert seen(islice(it, 8)) == seen(got)
    it.close()
    # planned with the new table: every batch within the budget of its longest utterance, and not the old plan
    raw = BucketConfig(max_batch_seconds=1e9)
    for batch, _ in got:
        d = batch.durations_s.numpy()
        assert batch_cost(d, raw) <= batch_budget_s(float(d.max()), NEW) + 1e-6
    assert tuple(got[0][0].keys) != tuple(first_old.keys)
    # continuing: the state after the 3rd restarted batch resumes at the 4th
    again = build_loader(dataset, world=world, seed=5, cfg=stream(NEW), state=got[2][1])
    it = iter(again)
    assert seen(islice(it, 5)) == seen(got[3:])
    it.close()


def test_restart_mid_epoch_with_a_new_table_is_refused(dataset):
    loader = build_loader(dataset, world=World(), seed=5, cfg=stream(OLD))
    it = iter(loader)
    _, mid = next(it)
    it.close()
    assert mid["step"] == 1
    with pytest.raises(StreamError, match="mid-epoch"):
        loader.restart(stream(NEW), mid)
