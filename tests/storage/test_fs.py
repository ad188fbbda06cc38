"""storage: URL helpers, atomic writes, piece-wise ranged reads that retry and resume at the byte reached."""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import fsspec
import pytest

from shardtrain import storage


def test_join_and_fs(tmp_path):
    assert storage.join("s3://b/p/", "x.tar") == "s3://b/p/x.tar"
    assert storage.join(str(tmp_path), "a") == f"{tmp_path}/a"
    fs, path = storage.fs_and_path(f"file://{tmp_path}/a")
    assert path.endswith("/a") and storage.is_local(f"file://{tmp_path}") and not storage.is_local("s3://b/k")


def test_atomic_write_leaves_no_temp(tmp_path):
    url = str(tmp_path / "sub" / "m.json")
    storage.atomic_write_bytes(url, b"one")
    storage.atomic_write_bytes(url, b"two")
    assert open(url, "rb").read() == b"two" and os.listdir(tmp_path / "sub") == ["m.json"]
    assert storage.ls_names(str(tmp_path / "sub")) == ["m.json"] and storage.ls_names(str(tmp_path / "no")) == []


def test_read_range_pieces(tmp_path):
    data = os.urandom(100_000)
    p = tmp_path / "blob"
    p.write_bytes(data)
    assert storage.read_range(str(p), 0, None, piece_bytes=4096) == data
    assert storage.read_range(str(p), 12_345, 54_321, piece_bytes=1000) == data[12_345:54_321]
    with pytest.raises(EOFError):
        storage.read_range(str(p), 99_000, 200_000, piece_bytes=4096)
    with pytest.raises(FileNotFoundError):
        storage.read_range(str(tmp_path / "missing"), 0, 10)


def test_fill_range_local_in_place_and_short(tmp_path):
    data = os.urandom(5 * storage.fs.LOCAL_PIECE_BYTES + 123)
    p = tmp_path / "blob"
    p.write_bytes(data)
    out = bytearray(4 * storage.fs.LOCAL_PIECE_BYTES)
    counts = list(storage.fill_range(str(p), 1000, memoryview(out)))
    assert bytes(out) == data[1000:1000 + len(out)]
    assert counts == [storage.fs.LOCAL_PIECE_BYTES, len(out)]  # the first MiB, then the rest at once
    tail = bytearray(1 << 20)  # past the end of the object: ends early with what there is
    got = list(storage.fill_range(str(p), len(data) - 100, memoryview(tail)))
    assert got[-1] == 100 and bytes(tail[:100]) == data[-100:]
    with pytest.raises(FileNotFoundError):
        list(storage.fill_range(str(tmp_path / "missing"), 0, memoryview(bytearray(10))))


def test_map_range_local_views_the_bytes_and_ends_with_the_file(tmp_path):
    data = os.urandom(3 * mmap.ALLOCATIONGRANULARITY + 123)
    p = tmp_path / "blob"
    p.write_bytes(data)
    pins: dict = {}
    view = storage.map_range(str(p), 1000, 2 * mmap.ALLOCATIONGRANULARITY + 7, pins=pins)  # an unaligned start
    assert bytes(view) == data[1000:2 * mmap.ALLOCATIONGRANULARITY + 7] and view.readonly
    assert bytes(storage.map_range(f"file://{p}", len(data) - 100, len(data) + 5000)) == data[-100:]  # past the end
    assert len(storage.map_range(str(p), len(data) + 10, len(data) + 20)) == 0
    assert storage.map_range("s3://bucket/blob", 0, 10) is None  # not local: the caller reads it
    os.mkfifo(tmp_path / "fifo")
    held = os.open(tmp_path / "fifo", os.O_RDWR)  # a writer, so that opening it to read does not block
    try:
        assert storage.map_range(str(tmp_path / "fifo"), 0, 10) is None  # not a regular file: read, not mapped
    finally:
        os.close(held)
    with pytest.raises(FileNotFoundError):
        storage.map_range(str(tmp_path / "missing"), 0, 10)
    p.write_bytes(data[:-1])  # rewritten since the pin: refused, as fill_range refuses it
    with pytest.raises(storage.ObjectChanged):
        storage.map_range(str(p), 0, 10, pins=pins)


def test_read_range_retries_and_resumes(tmp_path, monkeypatch):
    data = os.urandom(50_000)
    p = tmp_path / "blob"
    p.write_bytes(data)
    fs = fsspec.filesystem("file")
    real = type(fs).cat_file
    calls = []

    def flaky(self, path, start=None, end=None, **kw):
        calls.append(start)
        if len(calls) % 3 == 2:  # every third request fails like a reset connection
            raise ConnectionResetError("connection reset by peer")
        return real(self, path, start=start, end=end, **kw)

    monkeypatch.setattr(type(fs), "cat_file", flaky)
    out = storage.read_range(str(p), 0, 50_000, piece_bytes=10_000, backoff_s=0.001)
    assert out == data
    # each failed piece was re-requested at the byte reached, never from the start
    assert calls == [0, 10_000, 10_000, 20_000, 30_000, 30_000, 40_000]

    def always(self, path, start=None, end=None, **kw):
        raise TimeoutError("timed out")

    monkeypatch.setattr(type(fs), "cat_file", always)
    with pytest.raises(OSError, match="failed after 2 retries"):
        storage.read_range(str(p), 0, 10, retries=2, backoff_s=0.001)


def test_cli_storage_options_take_explicit_keys_from_env():
    """Entry points copy an explicit endpoint + keys from AWS_* variables, so the loader can sign S3 URLs itself;
    real AWS (no endpoint variable) and options given on the command line are left to s3fs."""
    from shardtrain.cli import _parse_storage_options
    from shardtrain.storage.s3http import static_credentials

    env = {"AWS_ACCESS_KEY_ID": "ak", "AWS_SECRET_ACCESS_KEY": "sk", "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
           "AWS_DEFAULT_REGION": "eu-west-1"}
    so = _parse_storage_options(["anon=false"], env)
    assert so == {"anon": False, "key": "ak", "secret": "sk",
                  "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"}}
    creds = static_credentials(so)
    assert creds is not None and creds.region == "eu-west-1" and creds.endpoint == "http://127.0.0.1:9000"
    no_endpoint = {k: v for k, v in env.items() if k != "AWS_ENDPOINT_URL"}
    assert _parse_storage_options([], no_endpoint) == {}
    assert _parse_storage_options(["key=mine"], env) == {"key": "mine"}
    with pytest.raises(SystemExit, match="key=value"):
        _parse_storage_options(["novalue"], env)


def test_errors_sorted_transient_hopeless_and_bugs():
    """Only errors known to be transient are retried: network faults, 5xx, throttling; never 4xx or bugs."""
    import http.client
    import ssl

    from shardtrain.storage.fs import is_transient
    from shardtrain.storage.s3http import HTTPStatusError

    transient = [ConnectionRefusedError(), ConnectionResetError(), TimeoutError(), http.client.IncompleteRead(b""),
                 HTTPStatusError("x", 500), HTTPStatusError("x", 503), HTTPStatusError("x", 429), OSError(5, "EIO")]
    hopeless = [PermissionError(), FileNotFoundError(), HTTPStatusError("x", 400), HTTPStatusError("x", 416),
                EOFError(), ssl.SSLCertVerificationError(), TypeError(), KeyError("k"), AttributeError()]
    assert all(map(is_transient, transient)) and not any(map(is_transient, hopeless))


def test_retry_budget_then_storage_unavailable(tmp_path, monkeypatch):
    """Transient errors are retried (jittered backoff) until the time budget is spent, then StorageUnavailable
    names the URL and the budget; a programming error is raised at once, untouched."""
    import time

    p = tmp_path / "blob"
    p.write_bytes(b"x" * 100)
    fs = fsspec.filesystem("file")
    calls = []

    def down(self, path, start=None, end=None, **kw):
        calls.append(time.monotonic())
        raise ConnectionRefusedError("connection refused")

    monkeypatch.setattr(type(fs), "cat_file", down)
    t0 = time.monotonic()
    with pytest.raises(storage.StorageUnavailable, match=r"blob .*retry budget 0.5 s.*connection refused"):
        storage.read_range(str(p), 0, 10, budget_s=0.5, backoff_s=0.05)
    assert 0.5 <= time.monotonic() - t0 < 1.5 and len(calls) >= 3

    def bug(self, path, start=None, end=None, **kw):
        calls.append(0.0)
        raise TypeError("a bug, not an outage")

    calls.clear()
    monkeypatch.setattr(type(fs), "cat_file", bug)
    with pytest.raises(TypeError, match="a bug"):
        storage.read_range(str(p), 0, 10, backoff_s=5.0)
    assert len(calls) == 1


def test_shard_cache_concurrent_readers_and_streaming(tmp_path):
    """8 threads read random ranges of 6 shards through a cache that holds ~2 of them, so eviction runs all the
    time: every read returns the right bytes (eviction never deletes a file between 'cached' and 'open'). A
    miss streams the shard to disk: peak Python memory stays far below the shard's size."""
    import random
    import threading

    from shardtrain.storage.cache import ShardCache

    size = 300_000
    shards = {f"s{i}.tar": bytes([i]) * 7 + os.urandom(size - 7) for i in range(6)}
    fetches: list[str] = []

    def fetch(name):
        def pieces():
            fetches.append(name)
            data = shards[name]
            for a in range(0, len(data), 50_000):
                yield data[a:a + 50_000]
        return pieces

    cache = ShardCache(str(tmp_path / "c"), max_bytes=2 * size + 10)
    errors: list[BaseException] = []

    def reader(seed):
        rnd = random.Random(seed)
        try:
            for _ in range(60):
                name = rnd.choice(list(shards))
                a = rnd.randrange(size)
                b = min(size, a + rnd.randrange(1, 40_000))
                got = b"".join(cache.read(name, "ab" * 8, size, fetch(name), a, b, piece_bytes=8192))
                assert got == shards[name][a:b], (name, a, b)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(fetches) > 6, "eviction never ran: the test proves nothing"
    assert sum(os.path.getsize(p) for p in (tmp_path / "c").glob("*.tar")) <= 3 * size

    # a miss streams to disk: by the time the fetch yields piece k, pieces < k are already in the temp file
    big = os.urandom(1 << 20)
    stream = ShardCache(str(tmp_path / "big"), max_bytes=1 << 30)
    on_disk: list[int] = []

    def pieces():
        for _ in range(16):
            tmp = [p for p in (tmp_path / "big").iterdir() if ".tmp" in p.name]
            on_disk.append(tmp[0].stat().st_size if tmp else 0)
            yield big

    with stream.open("big.tar", "cd" * 8, 16 << 20, pieces) as f:
        assert os.fstat(f.fileno()).st_size == 16 << 20
    assert on_disk == [k << 20 for k in range(16)], "the shard was held in memory before being written"


def test_local_version_changes_with_a_rewrite_and_not_with_a_read(tmp_path):
    p = tmp_path / "manifest.json"
    storage.atomic_write_bytes(str(p), b"one\n")
    v = storage.version(str(p))
    p.read_bytes()
    assert storage.version(str(p)) == v
    storage.atomic_write_bytes(str(p), b"two\n")  # same size, a new inode
    assert storage.version(str(p)) != v
    with pytest.raises(FileNotFoundError):
        storage.version(str(tmp_path / "missing.json"))


def test_local_path_is_the_path_fsspec_uses(tmp_path, monkeypatch):
    """pathlib code and fsspec calls on one URL reach one file: file:// stripped, ~ expanded, relative made absolute."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert storage.local_path("file:///a b/é+1") == "/a b/é+1"
    assert storage.local_path("~/run") == str(tmp_path / "home" / "run")
    assert storage.local_path("rel/run") == str(tmp_path / "rel" / "run")
    storage.atomic_write_bytes("~/x.bin", b"1")
    assert Path(storage.local_path("~/x.bin")).read_bytes() == b"1"
    with pytest.raises(ValueError, match="not a local path"):
        storage.local_path("s3://bkt/run")


@pytest.mark.parametrize("direct_http", [True, False], ids=["direct-http", "s3fs"])
def test_s3_object_shorter_than_the_range_ends_the_same_on_both_paths(s3, s3_bucket, direct_http):
    """Through s3fs, the request for the bytes past a short object's end (HTTP 416) raised OSError(EINVAL) where
    the direct path and local files end the read (allow_short) or raise EOFError: the loader stopped the stream
    on a truncated S3 shard ("unexpected storage error") instead of skipping its cut rows as truncated_shard."""
    url, so = f"{s3_bucket}/short.bin", s3.storage_options
    storage.atomic_write_bytes(url, b"12345", so)
    kw = dict(direct_http=direct_http, retries=0)
    assert storage.read_range(url, 3, 10, so, allow_short=True, **kw) == b"45"
    assert storage.read_range(url, 7, 10, so, allow_short=True, **kw) == b""
    with pytest.raises(EOFError, match="ended at byte 5, expected 10"):
        storage.read_range(url, 3, 10, so, **kw)
    out = bytearray(8)
    assert list(storage.fill_range(url, 2, memoryview(out), so, **kw)) == [3] and out[:3] == b"345"
