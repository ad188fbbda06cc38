"""storage.iter_range's direct-HTTP path (presigned URLs over http.client) against a real SeaweedFS on loopback."""
import os
import time

import pytest

from shardtrain.storage import s3http
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
    s3http._signed[(s3http.opts_key(s3.storage_options), path)] = (expired, time.time() + 10_000)  # the cache still believes in it
    got = b"".join(storage.iter_range(url, 0, 1000, s3.storage_options, direct_http=True, retries=0))
    assert got == data[:1000]
    assert s3http._signed[(s3http.opts_key(s3.storage_options), path)][0] != expired


def test_direct_http_reuses_one_connection_per_thread(blob, s3):
    """Consecutive ranged GETs in one thread ride one keep-alive connection (a new TCP connection per piece, or
    a failed reuse that falls back to the retry path, would cost latency on every chunk)."""
    from shardtrain.testing.proxy import DropProxy

    url, data = blob
    port = int(s3.endpoint_url.rsplit(":", 1)[1])
    with DropProxy("127.0.0.1", port, drop_after_bytes=0, drops=0) as proxy:
        so = {**s3.storage_options_for(proxy.endpoint_url), "skip_instance_cache": True}
        for a in range(0, 2_500_000, 500_000):
            got = b"".join(storage.iter_range(url, a, a + 400_000, so, direct_http=True, retries=0))
            assert got == data[a:a + 400_000]
        assert proxy.connections == 1


def test_local_sigv4_is_checked_by_the_server(blob, s3):
    """URLs signed here (no s3fs) are accepted; the same URL signed with a wrong secret is refused, so the
    server really verifies what this module signs."""
    import dataclasses
    import urllib.request

    url, data = blob
    creds = s3http.static_credentials(s3.storage_options)
    assert creds is not None
    path = url.split("://", 1)[1]
    good = s3http.sigv4_presign(creds, path, 600, time.time())
    assert urllib.request.urlopen(good, timeout=10).read() == data
    bad = s3http.sigv4_presign(dataclasses.replace(creds, secret=creds.secret + "x"), path, 600, time.time())
    with pytest.raises(urllib.error.HTTPError, match="403"):
        urllib.request.urlopen(bad, timeout=10)


def test_refused_local_signature_falls_back_to_s3fs(blob, s3, monkeypatch):
    """A server that refuses URLs signed here (injected: a corrupted signature) is read through s3fs's URLs."""
    url, data = blob
    so = {**s3.storage_options, "skip_instance_cache": True}  # own cache key: other tests keep local signing
    real = s3http.sigv4_presign
    monkeypatch.setattr(s3http, "sigv4_presign", lambda *a: real(*a)[:-4] + "0000")
    got = b"".join(storage.iter_range(url, 10, 5000, so, direct_http=True, retries=0))
    assert got == data[10:5000]
    assert s3http.opts_key(so) in s3http._local_rejected


def test_open_ended_reads_and_range_file(blob, s3, tmp_path):
    url, data = blob
    so = s3.storage_options
    # object size a multiple of the piece: the last request finds the end (416), which is not an error
    assert b"".join(storage.iter_range(url, 0, None, so, direct_http=True, piece_bytes=1_000_000)) == data
    assert storage.read_bytes(url, so, direct_http=True) == data
    with storage.open_ranged(url, so, direct_http=True) as f:
        assert f.seek(0, 2) == len(data)
        for a, n in [(0, 10), (2_999_990, 100), (1_500_000, 1_200_000), (5, 0), (123, 4)]:
            f.seek(a)
            assert f.read(n) == data[a:a + n]
            assert f.tell() == min(len(data), a + n)
    with pytest.raises(FileNotFoundError):
        storage.open_ranged(url + ".nope", so, direct_http=True)


@pytest.mark.parametrize("direct", [True, False])
def test_version_is_stable_for_the_same_bytes_and_changes_with_a_rewrite(s3, direct):
    """storage.version (the loader's check that a dataset was not re-packed under a run) through the presigned
    path and through s3fs: equal for repeated asks, different after the object is rewritten (even at the same
    size), FileNotFoundError for a missing object."""
    bucket = s3.make_bucket(f"version-{'direct' if direct else 's3fs'}")
    url = f"{bucket}/manifest.json"
    storage.atomic_write_bytes(url, b'{"a": 1}\n', s3.storage_options)
    kw = dict(direct_http=direct)
    v1 = storage.version(url, s3.storage_options, **kw)
    assert v1 and v1 == storage.version(url, s3.storage_options, **kw)
    storage.atomic_write_bytes(url, b'{"a": 2}\n', s3.storage_options)
    assert storage.version(url, s3.storage_options, **kw) not in ("", v1)
    with pytest.raises(FileNotFoundError):
        storage.version(url + ".missing", s3.storage_options, **kw)
