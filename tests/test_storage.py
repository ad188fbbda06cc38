"""storage: URL helpers, atomic writes, piece-wise ranged reads that retry and resume at the byte reached."""
from __future__ import annotations

import os

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
