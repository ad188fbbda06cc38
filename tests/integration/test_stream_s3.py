"""The loader against a real SeaweedFS server on loopback, including a connection cut mid-shard."""
import pytest

from shardtrain.storage import s3http
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.load.plan import BucketConfig
from shardtrain.testing.proxy import DropProxy
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.testing.corpus import make_corpus
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


def _signed_paths() -> set[str]:
    return {path for _, path in s3http._signed}


@pytest.mark.parametrize("direct_http", [True, False], ids=["direct-http", "s3fs"])
def test_s3_stream_equals_local(local_and_s3, s3, direct_http):
    local, url = local_and_s3
    ref, _ = keys_per_batch(local)
    s3http._signed.clear()
    got, loader = keys_per_batch(url, s3.storage_options, s3_direct_http=direct_http)
    assert got == ref
    assert loader.stats()["skipped"] == 0
    # the path under test really ran: presigned URLs exist only when shards are read over direct HTTP
    assert len({p for p in _signed_paths() if p.endswith(".tar")}) == (4 if direct_http else 0)


def test_direct_http_loader_never_starts_s3fs(local_and_s3, s3):
    """With explicit keys and endpoint, the loader signs URLs itself: a fresh process streams the whole epoch
    from S3 without importing s3fs (whose start-up is ~0.3 s of a loader's time to first batch)."""
    import json
    import subprocess
    import sys

    local, url = local_and_s3
    ref, _ = keys_per_batch(local)
    code = (
        "import sys, json\n"
        "from shardtrain.load.plan import BucketConfig\n"
        "from shardtrain.load.loader import StreamConfig, build_loader\n"
        "from shardtrain.world import World\n"
        "cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=10.0, chunk_mb=0.1), epochs=1)\n"
        "loader = build_loader(sys.argv[1], world=World(), seed=0, cfg=cfg, storage_options=json.loads(sys.argv[2]))\n"
        "out = [[list(b.keys), b.waves.sum().item()] for b, _ in loader]\n"
        "print(json.dumps({'batches': out, 's3fs': 's3fs' in sys.modules, 'botocore': 'botocore' in sys.modules}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, url, json.dumps(s3.storage_options)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(tuple(k), v) for k, v in res["batches"]] == ref
    assert not res["s3fs"] and not res["botocore"]


def test_s3_with_local_cache(local_and_s3, s3, tmp_path):
    local, url = local_and_s3
    ref, _ = keys_per_batch(local)
    got, _ = keys_per_batch(url, s3.storage_options, cache_dir=str(tmp_path / "cache"))
    again, _ = keys_per_batch(url, s3.storage_options, cache_dir=str(tmp_path / "cache"))
    assert got == ref == again
    assert len(list((tmp_path / "cache").glob("*.tar"))) > 0


@pytest.mark.parametrize("direct_http", [True, False], ids=["direct-http", "s3fs"])
def test_connection_cut_mid_shard_loses_and_duplicates_nothing(local_and_s3, s3, caplog, direct_http):
    """A proxy resets the first 12 connections after 20 kB each. Through s3fs (which retries a reset read 5
    times itself; botocore's retries are off here) that exhausts s3fs, so the loader's own retry (resume at
    the byte reached) must carry the read; over direct HTTP every reset is the loader's to retry."""
    local, url = local_and_s3
    ref, _ = keys_per_batch(local)
    port = int(s3.endpoint_url.rsplit(":", 1)[1])
    caplog.set_level("WARNING", logger="shardtrain.storage")
    with DropProxy("127.0.0.1", port, drop_after_bytes=20_000, drops=12) as proxy:
        so = s3.storage_options_for(f"http://127.0.0.1:{proxy.port}")
        # fresh s3fs instance so no pooled connection bypasses the proxy
        so["skip_instance_cache"] = True
        got, loader = keys_per_batch(url, so, retry_backoff_s=0.01, s3_direct_http=direct_http)
        assert proxy.drops_done >= 6, "too few cuts to get past s3fs's own retries: the test proves nothing"
    assert any("retry" in r.getMessage() for r in caplog.records), "the loader's own retry never ran"
    assert got == ref
    assert loader.stats()["skipped"] == 0
