"""A weighted mixture of a local dataset and one on a real SeaweedFS server: shares, repeats, exact and
elastic resume, per-dataset audio seconds (build_loader([...]) with real packed shards and real decoding)."""
from collections import Counter

import numpy as np
import pytest

from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus
from shardtrain.world import World

pytestmark = pytest.mark.s3

BIG = [1.0 + 0.1 * ((i * 7) % 21) for i in range(24)]  # local, ~48 s
SMALL = [1.0 + 0.25 * (i % 4) for i in range(6)]       # on S3, ~10.5 s: weight 1 of 2 -> repeated ~2.8x an epoch


@pytest.fixture(scope="module")
def mixture(tmp_path_factory, s3):
    root = tmp_path_factory.mktemp("mix")
    big = make_corpus(root / "big", BIG, seed=3, text_fn=lambda i: f"big {i}")
    small = make_corpus(root / "small", SMALL, seed=4, text_fn=lambda i: f"small {i}")
    pack(PackConfig(input=str(big), output=str(root / "big-ds"), max_samples_per_shard=8, workers=1, progress=False))
    url = f"{s3.make_bucket('mix-src')}/small"
    pack(PackConfig(input=str(small), output=url, max_samples_per_shard=4, workers=1, progress=False,
                    storage_options=s3.storage_options))
    return [(str(root / "big-ds"), 1.0), (url, 1.0)], s3.storage_options


def run(sources, so, *, world=World(), state=None, n=None, epochs=3):
    cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=8.0, chunk_mb=0.2), epochs=epochs)
    loader = build_loader(sources, world=world, seed=5, cfg=cfg, state=state, storage_options=so)
    out = []
    for batch, st in loader:
        out.append(((batch.epoch, tuple(batch.texts)), round(float(batch.waves.sum()), 3), st))
        if n is not None and len(out) == n:
            break
    return out, loader


def test_mixture_shares_repeats_and_seconds(mixture):
    sources, so = mixture
    out, loader = run(sources, so)
    total = sum(BIG) + sum(SMALL)
    for epoch in range(3):
        texts = [t for (e, ts), _, _ in out if e == epoch for t in ts]
        small = [int(t.split()[1]) for t in texts if t.startswith("small")]
        big = [int(t.split()[1]) for t in texts if t.startswith("big")]
        assert abs(sum(SMALL[i] for i in small) - total / 2) <= max(SMALL) + 1e-6
        assert abs(sum(BIG[i] for i in big) - total / 2) <= max(BIG) + 1e-6
        if epoch == 0:  # the big set fills an epoch with 0.6 of itself: no repeats ...
            assert len(big) == len(set(big))
        assert max(Counter(small).values()) >= 2  # ... the small one repeats inside an epoch
    # every sample of a dataset once before any repeats: over the run, counts differ by at most one
    for name, durs in (("small", SMALL), ("big", BIG)):
        counts = Counter(int(t.split()[1]) for (_, ts), _, _ in out for t in ts if t.startswith(name))
        assert len(counts) == len(durs) and max(counts.values()) - min(counts.values()) <= 1
    seen = {name: sum(durs[int(t.split()[1])] for (_, ts), _, _ in out for t in ts if t.startswith(name))
            for name, durs in (("big", BIG), ("small", SMALL))}
    assert out[-1][2]["counters"]["dataset_seconds"] == pytest.approx([seen["big"], seen["small"]], abs=0.01)
    assert loader.stats()["skipped"] == 0


def test_mixture_exact_and_elastic_resume(mixture):
    sources, so = mixture
    full, _ = run(sources, so)
    k = 5
    head, _ = run(sources, so, n=k)
    rest, _ = run(sources, so, state=head[-1][2])
    assert [x[:2] for x in head + rest] == [x[:2] for x in full]  # bit-exact: same batches, same samples
    assert rest[-1][2]["counters"]["dataset_seconds"] == pytest.approx(full[-1][2]["counters"]["dataset_seconds"])
    # elastic: the rest of epoch 0 on 2 ranks holds exactly what the 1-rank run had left of it
    parts = [run(sources, so, world=World(rank=r, world_size=2), state=head[-1][2], epochs=1)[0] for r in range(2)]
    assert len({len(p) for p in parts}) == 1  # equal steps
    got = sorted(t for p in parts for (e, ts), _, _ in p for t in ts)
    want = sorted(t for (e, ts), _, _ in full[k:] if e == 0 for t in ts)
    assert got == want and np.isfinite([w for p in parts for _, w, _ in p]).all()
