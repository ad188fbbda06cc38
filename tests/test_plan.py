"""The planner is pure: these tests simulate up to 256 ranks x 8 workers with no process group and no audio."""
import numpy as np
import pytest

from shardtrain.load.plan import BucketConfig, PlanIndex, batch_cost, consumed_rows, cost_s, estimate_bins, plan_epoch


def fake_index(n: int, seed: int = 0, lo: float = 0.5, hi: float = 20.0, shard_bytes: int = 20_000_000) -> PlanIndex:
    rng = np.random.default_rng(seed)
    d = np.sort(rng.uniform(lo, hi, n))
    size = (d * 19_200).astype(np.int64) + 2048
    off = np.concatenate([[0], np.cumsum(size)[:-1]])
    return PlanIndex(shard=(off // shard_bytes).astype(np.int32), offset=off, size=size, audio_offset=off + 512,
                     audio_size=size - 2048, json_offset=off + size - 512, json_size=np.full(n, 100), duration_s=d,
                     num_samples=(d * 16000).astype(np.int64), channels=np.ones(n, np.int16))


def all_batches(plan):
    return [b for g in plan.groups for c in g for b in c.batches]


def test_estimate_bins_equal_audio_hand_checked():
    # four utterances of 1 s and one of 4 s: half the audio is the 4 s one, so the single edge sits at 4
    assert estimate_bins(np.array([1.0, 1, 1, 1, 4]), 2).tolist() == [4.0]
    assert estimate_bins(np.array([1.0, 2.0]), 1).tolist() == []


def test_quadratic_cost_and_padded_budget():
    cfg = BucketConfig(quadratic_duration_s=10.0, padded_budget=True)
    assert cost_s(np.array([10.0]), cfg).tolist() == [20.0]
    assert batch_cost(np.array([1.0, 3.0]), cfg) == 6.0
    assert batch_cost(np.array([1.0, 3.0]), BucketConfig()) == 4.0


@pytest.mark.parametrize("world_size", [1, 2, 8, 256])
def test_coverage_disjoint_complete_equal_steps_budget(world_size):
    idx = fake_index(20_000)
    cfg = BucketConfig(max_batch_seconds=120.0, max_batch_size=64)
    plan = plan_epoch(idx, seed=3, epoch=1, world_size=world_size, cfg=cfg)
    rows = np.concatenate(all_batches(plan))
    assert len(rows) == len(np.unique(rows)), "a sample is delivered twice"
    assert len(rows) + len(plan.too_long) == len(idx), "a sample is missing"
    # equal steps: every rank's chunk list has the same batch count, group by group
    for g in plan.groups:
        assert len(g) == world_size
        assert len({len(c.batches) for c in g}) == 1
    steps = [sum(len(c.batches) for c in plan.rank_chunks(r)) for r in range(world_size)]
    assert len(set(steps)) == 1 and steps[0] == plan.steps
    for b in all_batches(plan):
        assert batch_cost(idx.duration_s[b], cfg) <= cfg.max_batch_seconds + 1e-9
        assert len(b) <= 64


def test_worker_split_covers_rank_chunks():
    idx = fake_index(5000)
    plan = plan_epoch(idx, seed=0, epoch=0, world_size=256, cfg=BucketConfig(max_batch_seconds=60.0))
    for r in range(256):
        chunks = plan.rank_chunks(r)
        per_worker = [chunks[w::8] for w in range(8)]
        assert sum(len(p) for p in per_worker) == len(chunks)
        got = np.concatenate([c.rows for p in per_worker for c in p])
        want = np.concatenate([c.rows for c in chunks])
        assert sorted(got.tolist()) == sorted(want.tolist())


def test_lock_step_duration_band():
    idx = fake_index(8000)
    plan = plan_epoch(idx, seed=1, epoch=0, world_size=4, cfg=BucketConfig(max_batch_seconds=100.0, num_buckets=10))
    edges = estimate_bins(idx.duration_s, 10)
    for g in plan.groups:
        bands = {int(np.searchsorted(edges, idx.duration_s[c.rows].mean())) for c in g}
        assert max(bands) - min(bands) <= 1, "ranks at one step draw from distant duration bands"


def test_deterministic_and_epoch_dependent():
    idx = fake_index(3000)
    cfg = BucketConfig(max_batch_seconds=80.0)
    a = plan_epoch(idx, seed=7, epoch=2, world_size=2, cfg=cfg)
    b = plan_epoch(idx, seed=7, epoch=2, world_size=2, cfg=cfg)
    c = plan_epoch(idx, seed=7, epoch=3, world_size=2, cfg=cfg)
    assert [x.tolist() for x in all_batches(a)] == [x.tolist() for x in all_batches(b)]
    assert [x.tolist() for x in all_batches(a)] != [x.tolist() for x in all_batches(c)]


def test_padding_efficiency_from_duration_sorted_chunks():
    idx = fake_index(10_000)
    plan = plan_epoch(idx, seed=0, epoch=0, world_size=1, cfg=BucketConfig(max_batch_seconds=200.0))
    real = sum(idx.duration_s[b].sum() for b in all_batches(plan))
    padded = sum(idx.duration_s[b].max() * len(b) for b in all_batches(plan) if len(b))
    assert real / padded > 0.95


def test_too_long_rows_counted_not_silent():
    idx = fake_index(500, lo=1.0, hi=30.0)
    plan = plan_epoch(idx, seed=0, epoch=0, world_size=2, cfg=BucketConfig(max_batch_seconds=25.0))
    assert len(plan.too_long) == int((idx.duration_s > 25.0).sum()) > 0
    rows = np.concatenate(all_batches(plan))
    assert not np.isin(plan.too_long, rows).any()


def test_fewer_samples_than_ranks_is_refused():
    with pytest.raises(ValueError, match="every rank needs at least one"):
        plan_epoch(fake_index(3), seed=0, epoch=0, world_size=4, cfg=BucketConfig())


def test_restripe_rest_of_epoch_exactly_once():
    idx = fake_index(4000)
    cfg = BucketConfig(max_batch_seconds=90.0)
    old = plan_epoch(idx, seed=5, epoch=0, world_size=4, cfg=cfg)
    k = old.steps // 3
    done = consumed_rows(old, k)
    mask = np.zeros(len(idx), bool)
    mask[done] = True
    new = plan_epoch(idx, seed=5, epoch=0, world_size=3, cfg=cfg, exclude=mask)
    rest = np.concatenate(all_batches(new))
    both = np.concatenate([done, rest])
    assert len(both) == len(np.unique(both)) == len(idx) - len(old.too_long)


@pytest.mark.parametrize("world_size", [1, 8])
def test_batches_are_nearly_full(world_size):
    """Chunk counts are chosen per bucket so dealt batches come close to the budget (not 2.1 -> four halves)."""
    idx = fake_index(20_000)
    cfg = BucketConfig(max_batch_seconds=300.0)
    plan = plan_epoch(idx, seed=0, epoch=0, world_size=world_size, cfg=cfg)
    fill = np.mean([idx.duration_s[b].sum() for b in all_batches(plan)]) / cfg.max_batch_seconds
    assert fill > 0.85, f"batches only {fill:.0%} full"
