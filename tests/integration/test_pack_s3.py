"""pack to, and inspect/verify from, a real SeaweedFS S3 server on loopback (fixture `s3` in conftest)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shardtrain import cli
from shardtrain import storage
from shardtrain.format.manifest import open_dataset
from shardtrain.pack.verify import inspect, verify
from shardtrain.pack.packer import AudioTarget, PackConfig, pack
from shardtrain.pack.shard_task import PackError
from shardtrain import faults
from shardtrain.testing.proxy import DropProxy

pytestmark = [pytest.mark.s3, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _region(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # s3fs without region_name (stack.md)


def _cfg(src, out, so=None, **kw):
    kw.setdefault("max_samples_per_shard", 8)
    return PackConfig(input=str(src), output=out, storage_options=so, progress=False, **kw)


def _so_flags(so: dict) -> list[str]:
    return [x for k, v in so.items() for x in ("--storage-option", f"{k}={json.dumps(v)}")]


def test_pack_to_s3_equals_local_and_verifies(s3, s3_bucket, tone_corpus, tmp_path, capsys):
    url, so = f"{s3_bucket}/ds", s3.storage_options
    r = pack(_cfg(tone_corpus, url, so, workers=2))
    local = pack(_cfg(tone_corpus, str(tmp_path / "local")))
    assert (r.samples, r.shards, r.bytes) == (local.samples, local.shards, local.bytes) == (30, 4, r.bytes)
    fs = s3.fs()
    # SeaweedFS lists an emptied prefix (`_work/`) as a folder; no object is left in it
    assert not [p for p in fs.find(f"{url}/_work") if p.endswith((".json", ".tar", ".tmp"))]
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url, detail=False) if not p.endswith("/_work"))
    assert names == ["index.parquet", "manifest.json", "rejects.jsonl"] + [f"shard-{i:06d}.tar" for i in range(4)]
    for name in names:  # same bytes on S3 as locally (the manifest differs only in created_utc)
        remote, here = fs.cat_file(f"{url}/{name}"), (tmp_path / "local" / name).read_bytes()
        if name == "manifest.json":
            remote, here = (json.loads(x) for x in (remote, here))
            remote.pop("created_utc"), here.pop("created_utc")
            remote["options"].pop("input"), here["options"].pop("input")
        assert remote == here, name
    ds = open_dataset(url, so)
    assert inspect(ds)["totals"]["samples"] == 30 and verify(ds, progress=False) == []
    assert ds.read_index(["key"]).num_rows == 30
    assert cli.main(["inspect", url, "--verify", "--no-progress", *_so_flags(so)]) == 0
    assert "verify    4 shards, 30 samples: OK" in capsys.readouterr().out

    # a flipped byte in one object is caught, with the shard named
    shard = f"{url}/shard-000002.tar"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 3] ^= 0x01
    fs.pipe_file(shard, bytes(data))
    problems = verify(open_dataset(url, so), progress=False)
    assert problems and {p.shard for p in problems} == {"shard-000002.tar"}
    assert cli.main(["inspect", url, "--verify", "--no-progress", *_so_flags(so)]) == 1

    with pytest.raises(PackError, match="different dataset"):
        pack(_cfg(tone_corpus, url, so, audio=AudioTarget(codec="wav")))


def test_resume_on_s3_after_killed_worker(s3, s3_bucket, tone_corpus):
    url, so = f"{s3_bucket}/ds", s3.storage_options
    cmd = [sys.executable, "-m", "shardtrain", "pack", str(tone_corpus), url, "--max-samples-per-shard", "4",
           "--workers", "2", "--no-progress", *_so_flags(so)]
    env = {**os.environ, **s3.env, faults.ENV: "pack.shard=4:kill"}
    crashed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert crashed.returncode == 2, crashed.stderr
    fs = s3.fs()
    assert not fs.exists(f"{url}/manifest.json")
    done = [p for p in fs.ls(f"{url}/_work", detail=False) if p.endswith(".json") and "/shard-" in p]
    assert 0 < len(done) < 8
    fp = json.loads(fs.cat_file(f"{url}/_work/layout.json"))["fingerprint"]
    Path(tempfile.gettempdir(), f"shardtrain-fault-{fp[:16]}-pack.shard-4").unlink()  # the fault's once-marker
    r = pack(PackConfig(input=str(tone_corpus), output=url, storage_options=so, max_samples_per_shard=4,
                        progress=False))
    assert r.shards == 8 and r.shards_written == 8 - len(done)
    assert verify(open_dataset(url, so), progress=False) == []
    assert not [p for p in fs.find(f"{url}/_work") if p.endswith((".json", ".tar", ".tmp"))]


def test_read_range_resumes_through_dropped_connections(s3, s3_bucket, tone_corpus):
    url, so = f"{s3_bucket}/ds", s3.storage_options
    pack(_cfg(tone_corpus, url, so, target_shard_mb=64, max_samples_per_shard=None))
    want = s3.fs().cat_file(f"{url}/shard-000000.tar")
    assert len(want) > 2_000_000
    with DropProxy("127.0.0.1", s3.port, drop_after_bytes=700_000, drops=3) as proxy:
        proxied = {**s3.storage_options_for(proxy.endpoint_url), "skip_instance_cache": True,
                   "config_kwargs": {"retries": {"max_attempts": 1}}}
        got = storage.read_range(f"{url}/shard-000000.tar", 0, None, proxied, piece_bytes=512 << 10,
                                 backoff_s=0.01)
        assert proxy.drops_done >= 1
    assert got == want
