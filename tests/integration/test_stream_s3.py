"""The loader against a real SeaweedFS server on loopback, including a connection cut mid-shard."""
import pytest

from shardtrain.pack import PackConfig, pack
from shardtrain.plan import BucketConfig
from shardtrain.s3local import DropProxy
from shardtrain.stream import StreamConfig, build_loader
from shardtrain.testing import make_corpus
from shardtrain.world import World

pytestmark = pytest.mark.s3

DURS = [0.5 + 0.3 * ((i * 5) % 17) for i in range(40)]


@pytest.fixture(scope="module")
def local_and_s3(tmp_path_factory, s3):
    root = tmp_path_factory.mktemp("s3stream")
    corpus = make_corpus(root / "corpus", DURS, seed=2)
    bucket = s3.make_bucket("loader-src")
    local = str(root / "ds")
    cfg = dict(input=str(corpus), max_samples_per_shard=10, workers=1, progress=False)
    pack(PackConfig(output=local, **cfg))
    url = f"{bucket}/ds"
    pack(PackConfig(output=url, storage_options=s3.storage_options, **cfg))
    return local, url


def keys_per_batch(url, storage_options=None, **kw):
    cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=10.0, chunk_mb=0.1), epochs=1, **kw)
    loader = build_loader(url, world=World(), seed=0, cfg=cfg, storage_options=storage_options)
    out = [(tuple(b.keys), b.waves.sum().item()) for b, _ in loader]
    return out, loader


def test_s3_stream_equals_local(local_and_s3, s3):
    local, url = local_and_s3
    ref, _ = keys_per_batch(local)
    got, loader = keys_per_batch(url, s3.storage_options)
    assert got == ref
    assert loader.stats()["skipped"] == 0


def test_s3_with_local_cache(local_and_s3, s3, tmp_path):
    local, url = local_and_s3
    ref, _ = keys_per_batch(local)
    got, _ = keys_per_batch(url, s3.storage_options, cache_dir=str(tmp_path / "cache"))
    again, _ = keys_per_batch(url, s3.storage_options, cache_dir=str(tmp_path / "cache"))
    assert got == ref == again
    assert len(list((tmp_path / "cache").glob("*.tar"))) > 0


def test_connection_cut_mid_shard_loses_and_duplicates_nothing(local_and_s3, s3, caplog):
    """s3fs retries a reset read 5 times itself (botocore's own retries are switched off here); 12 cuts in a row
    exhaust it, so the loader's own retry (resume at the byte reached) must carry the read through."""
    local, url = local_and_s3
    ref, _ = keys_per_batch(local)
    port = int(s3.endpoint_url.rsplit(":", 1)[1])
    caplog.set_level("WARNING", logger="shardtrain.storage")
    with DropProxy("127.0.0.1", port, drop_after_bytes=20_000, drops=12) as proxy:
        so = s3.storage_options_for(f"http://127.0.0.1:{proxy.port}")
        # fresh s3fs instance so no pooled connection bypasses the proxy
        so["skip_instance_cache"] = True
        got, loader = keys_per_batch(url, so, retry_backoff_s=0.01)
        assert proxy.drops_done >= 6, "too few cuts to get past s3fs's own retries: the test proves nothing"
    assert any("retry" in r.getMessage() for r in caplog.records), "the loader's own retry never ran"
    assert got == ref
    assert loader.stats()["skipped"] == 0
