"""A ranged read is held to the object version it started on: an S3 object replaced while a read of it is being
retried (the connection cut mid-body by the fault proxy, the object overwritten before the retry) is an
ObjectChanged error for that read, never bytes spliced from two versions; a local file replaced or rewritten
under a reader's pins is refused the same way."""
from __future__ import annotations

import os

import pytest

from shardtrain import storage
from shardtrain.testing.proxy import DropProxy

pytestmark = pytest.mark.s3

OLD, NEW = bytes([1]) * (3 << 20), bytes([2]) * (3 << 20)


def test_s3_object_replaced_during_a_retried_read_is_refused_never_spliced(s3, s3_bucket):
    url = f"{s3_bucket}/shard-000000.tar"
    storage.atomic_write_bytes(url, OLD, s3.storage_options)

    def replace(_n: int) -> None:  # in the proxy, before the cut reaches the client: the retry meets NEW
        storage.atomic_write_bytes(url, NEW, s3.storage_options)

    with DropProxy("127.0.0.1", s3.port, drop_after_bytes=1 << 20, drops=1, on_drop=replace) as proxy:
        so = {**s3.storage_options_for(proxy.endpoint_url), "skip_instance_cache": True}
        got = bytearray()
        with pytest.raises(storage.ObjectChanged):
            for piece in storage.iter_range(url, 0, len(OLD), so, direct_http=True, backoff_s=0.01, pins={}):
                got += piece
            raise AssertionError(f"read ended: {proxy.drops_done} cuts, {len(got)} bytes, values {set(got)}")
        assert proxy.drops_done == 1
    assert set(got) <= {1}, "bytes of the new version were delivered after bytes of the old one"
    # a fresh read (a new run) sees the new version whole
    assert storage.read_range(url, 0, len(NEW), s3.storage_options, direct_http=True) == NEW


def test_local_file_replaced_under_its_pins_is_refused(tmp_path):
    path = tmp_path / "shard-000000.tar"
    path.write_bytes(OLD)
    pins: dict = {}
    out = memoryview(bytearray(1024))
    assert list(storage.fill_range(str(path), 0, out, pins=pins))[-1] == 1024 and set(out) == {1}
    tmp = tmp_path / "new.tar"
    tmp.write_bytes(NEW)
    os.replace(tmp, path)  # what a re-pack does: a new file renamed over the old one
    with pytest.raises(storage.ObjectChanged):
        list(storage.fill_range(str(path), 1024, out, pins=pins))
