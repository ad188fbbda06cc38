"""storage.iter_range's direct-HTTP path (presigned URLs over http.client) against a real SeaweedFS on loopback."""
import os
import time

import pytest

from shardtrain import storage

pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def blob(s3):
    bucket = s3.make_bucket("ranges")
    data = os.urandom(3_000_000)
    storage.atomic_write_bytes(f"{bucket}/obj.bin", data, s3.storage_options)
    return f"{bucket}/obj.bin", data


@pytest.mark.parametrize("start,end,piece", [(0, None, 8 << 20), (0, 3_000_000, 700_000), (12_345, 2_000_001, 1 << 20),
                                             (2_999_999, 3_000_000, 64), (100, 100, 1 << 20)])
def test_direct_http_ranges_equal_s3fs(blob, s3, start, end, piece):
    url, data = blob
    kw = dict(piece_bytes=piece, retries=0)
    direct = b"".join(storage.iter_range(url, start, end, s3.storage_options, direct_http=True, **kw))
    via_s3fs = b"".join(storage.iter_range(url, start, end, s3.storage_options, **kw))
    assert direct == via_s3fs == data[start:end]


def test_direct_http_short_object_and_missing_object(blob, s3):
    url, data = blob
    with pytest.raises(EOFError, match="ended at byte 3000000"):
        b"".join(storage.iter_range(url, 2_000_000, 3_500_000, s3.storage_options, direct_http=True, retries=0))
    head = b"".join(storage.iter_range(url, 2_000_000, 3_500_000, s3.storage_options, direct_http=True,
                                       retries=0, allow_short=True))
    assert head == data[2_000_000:]
    t0 = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="HTTP 404"):  # permanent: no retries, no backoff
        b"".join(storage.iter_range(url + ".missing", 0, 10, s3.storage_options, direct_http=True, backoff_s=5))
    assert time.perf_counter() - t0 < 4


def test_direct_http_resigns_an_expired_url(blob, s3):
    """A cached presigned URL that the server rejects (expired) is signed again once, not treated as an error."""
    url, data = blob
    fs, path = storage.fs_and_path(url, s3.storage_options)
    expired = fs.sign(path, expiration=1)
    time.sleep(2.1)
    storage._signed[(storage._opts_key(s3.storage_options), path)] = (expired, time.time() + 10_000)  # the cache still believes in it
    got = b"".join(storage.iter_range(url, 0, 1000, s3.storage_options, direct_http=True, retries=0))
    assert got == data[:1000]
    assert storage._signed[(storage._opts_key(s3.storage_options), path)][0] != expired


def test_direct_http_reuses_one_connection_per_thread(blob, s3):
    """Consecutive ranged GETs in one thread ride one keep-alive connection (a new TCP connection per piece, or
    a failed reuse that falls back to the retry path, would cost latency on every chunk)."""
    from shardtrain.s3local import DropProxy

    url, data = blob
    port = int(s3.endpoint_url.rsplit(":", 1)[1])
    with DropProxy("127.0.0.1", port, drop_after_bytes=0, drops=0) as proxy:
        so = {**s3.storage_options_for(proxy.endpoint_url), "skip_instance_cache": True}
        for a in range(0, 2_500_000, 500_000):
            got = b"".join(storage.iter_range(url, a, a + 400_000, so, direct_http=True, retries=0))
            assert got == data[a:a + 400_000]
        assert proxy.connections == 1
