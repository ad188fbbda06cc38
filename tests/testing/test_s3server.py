"""testing/s3server.py: the loopback SeaweedFS S3 server the S3 tests use: s3fs round trips, credentials for
subprocesses, start failures reported with the log, bucket capacity."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest


@pytest.mark.s3
def test_s3_round_trip_with_s3fs(s3, s3_bucket):
    fs = s3.fs()
    data = np.random.default_rng(0).bytes(3 << 20)
    fs.pipe(f"{s3_bucket}/dir/blob.bin", data)
    fs.pipe(f"{s3_bucket}/dir/small.txt", b"hello")
    assert sorted(fs.ls(f"{s3_bucket}/dir")) == [f"{s3_bucket[5:]}/dir/blob.bin", f"{s3_bucket[5:]}/dir/small.txt"]
    assert fs.cat_file(f"{s3_bucket}/dir/blob.bin") == data
    assert fs.cat_file(f"{s3_bucket}/dir/blob.bin", start=1_000_000, end=1_000_100) == data[1_000_000:1_000_100]
    with fs.open(f"{s3_bucket}/dir/blob.bin", "rb", block_size=1 << 20) as f:
        f.seek(2_500_000)
        assert f.read(10) == data[2_500_000:2_500_010]
    assert fs.info(f"{s3_bucket}/dir/blob.bin")["size"] == len(data)


@pytest.mark.s3
def test_s3_env_for_subprocess_and_key_enforced(s3, s3_bucket):
    s3.fs().pipe(f"{s3_bucket}/x.txt", b"via env")
    code = f"import fsspec; print(fsspec.filesystem('s3').cat_file('{s3_bucket}/x.txt').decode())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | s3.env
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "via env"
    bad = dict(s3.storage_options, secret="wrong-secret", skip_instance_cache=True)
    import s3fs

    with pytest.raises((PermissionError, OSError)):
        s3fs.S3FileSystem(**bad).cat_file(f"{s3_bucket}/x.txt")


def test_local_s3_start_failure_reports_log(tmp_path):
    from shardtrain.testing.s3server import LocalS3

    fake = tmp_path / "weed"
    fake.write_text("#!/bin/sh\necho 'fake weed: cannot start' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"exited with code 3(.|\n)*fake weed: cannot start"):
        LocalS3(tmp_path / "data", weed=str(fake)).start()


@pytest.mark.s3
@pytest.mark.slow
def test_session_server_takes_writes_in_many_buckets(s3):
    """Each bucket is a SeaweedFS collection that grows 7 volumes; the default cap (free disk / 128 MB) ran out
    after ~25 buckets on a fuller disk and late tests got InternalError. 40 more buckets on the shared server,
    after whatever the session already made, must all take a write."""
    c = s3.client()
    for i in range(40):
        bucket = s3.make_bucket(f"many-{i:02d}")[5:]
        c.put_object(Bucket=bucket, Key="k", Body=b"x" * 1000)
        assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"x" * 1000


@pytest.mark.s3
def test_local_s3_volume_cap_is_what_limits_buckets(tmp_path):
    """The cap is passed to the server: with room for 3 volumes, 3 buckets take a write and a 4th fails the way
    late tests failed when the free-disk default cap ran out."""
    from shardtrain.testing.s3server import LocalS3

    with LocalS3(tmp_path / "data", max_volumes=3) as server:
        c = server.client(retries=0)
        for i in range(3):
            c.put_object(Bucket=server.make_bucket(f"cap-{i}")[5:], Key="k", Body=b"y" * 1000)
        with pytest.raises(Exception, match="InternalError|internal error"):
            c.put_object(Bucket=server.make_bucket("cap-3")[5:], Key="k", Body=b"y" * 1000)


@pytest.mark.s3
def test_the_server_leaves_nothing_in_the_temp_folder(tmp_path):
    """weed's glog files and `weed mini`'s unix sockets go to a private TMPDIR removed at stop (they piled up in /tmp,
    ~10 files a start). Checked by the server's pid, which names its log files, so other processes do not matter."""
    import tempfile

    from shardtrain.testing.s3server import LocalS3

    server = LocalS3(tmp_path / "data").start()
    pid, scratch = server._proc.pid, server._scratch
    try:
        server.client(retries=0).list_buckets()
        here = os.listdir(scratch)
        assert "s3.sock" in here and any(p.endswith(f".{pid}") for p in here), here
    finally:
        server.stop()
    assert not os.path.exists(scratch)
    assert not [p for p in os.listdir(tempfile.gettempdir()) if p.startswith("weed.") and p.endswith(f".{pid}")]
