"""Issue 21 with real processes: several processes hammering one shard cache, packs racing to take over a stale
lock on a real SeaweedFS (and a local folder), the index map built on a disk that fills up (a real tmpfs)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shardtrain.testing.indexes import write_index_dataset

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _py(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _spawn(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


HAMMER = """
    import random, sys
    from shardtrain.storage.cache import ShardCache
    root, seed, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    size = 200_000
    shards = {f"s{i}.tar": random.Random(i).randbytes(size) for i in range(6)}
    fetches = 0
    def fetch(name):
        def pieces():
            global fetches
            fetches += 1
            d = shards[name]
            for a in range(0, size, 50_000):
                yield d[a:a + 50_000]
        return pieces
    cache = ShardCache(root, max_bytes=2 * size + 10)
    rnd, bad = random.Random(seed), 0
    for _ in range(n):
        name = rnd.choice(list(shards))
        a = rnd.randrange(size)
        b = min(size, a + rnd.randrange(1, 40_000))
        try:
            assert b"".join(cache.read(name, "ab" * 8, size, fetch(name), a, b)) == shards[name][a:b]
        except Exception as e:
            bad += 1
            print(type(e).__name__, e, file=sys.stderr)
    print(bad, fetches)
"""


def test_processes_hammering_one_shard_cache_never_miss_a_shard(tmp_path):
    """Four processes share a cache holding two of six shards: every read must return the right bytes (without
    file locks, eviction in one process deleted another's fresh copy before it was opened: 'missing shard')."""
    procs = [_spawn(HAMMER, str(tmp_path / "cache"), str(i), "400") for i in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    bad = sum(int(o[0].split()[0]) for o in outs)
    fetches = sum(int(o[0].split()[1]) for o in outs)
    assert bad == 0, [o[1][-2000:] for o in outs]
    assert fetches > 24, "eviction hardly ran: the test proves nothing"
    left = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert not [n for n in left if ".tmp" in n], left  # no download temp file left behind
    assert len([n for n in left if n.endswith(".tar")]) <= 3


TAKE = """
    import json, sys, time
    from shardtrain.storage.lock import LockHeld, acquire_lock
    url, so, t0 = sys.argv[1], json.loads(sys.argv[2]) or None, float(sys.argv[3])
    while time.time() < t0:
        time.sleep(0.001)
    try:
        lock = acquire_lock(url, so)
    except LockHeld as e:
        print("HELD", e)
        sys.exit(0)
    print("WON")
    sys.stdout.flush()
    time.sleep(4)  # hold it while the others try: a later, legitimate acquire would blur the count
    lock.release()
"""


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _race(url: str, so: dict | None, plant) -> list[str]:
    stale = {"host": socket.gethostname(), "pid": _dead_pid(), "purpose": "pack", "token": "0" * 32,
             "time_utc": "2026-01-01T00:00:00Z"}
    plant(json.dumps(stale).encode())
    t0 = time.time() + 8  # every process imported and waiting before the start
    procs = [_spawn(TAKE, url, json.dumps(so), str(t0)) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    return [o[0].split()[0] for o in outs]


def test_exactly_one_of_racing_packs_takes_over_a_stale_local_lock(tmp_path):
    url = str(tmp_path / "out")
    os.makedirs(url)
    for _ in range(1):
        got = _race(url, None, lambda data: Path(url, "_pack.lock").write_bytes(data))
        assert got.count("WON") == 1, got
    assert not [p.name for p in Path(url).iterdir() if "takeover" in p.name]  # claims are cleaned up


@pytest.mark.s3
def test_exactly_one_of_racing_packs_takes_over_a_stale_s3_lock(s3, s3_bucket):
    from shardtrain import storage

    url, so = f"{s3_bucket}/out", s3.storage_options
    for _ in range(1):
        got = _race(url, so, lambda data: storage.atomic_write_bytes(f"{url}/_pack.lock", data, so))
        assert got.count("WON") == 1, got
    assert not [n for n in storage.ls_names(url, so) if "takeover" in n]


@pytest.mark.s3
def test_seaweedfs_conditional_requests_as_the_lock_relies_on(s3):
    """What the lock's design rests on (If-None-Match create) and what it does not need (If-Match PUT/DELETE,
    which SeaweedFS 4.48 also honours): a change of server behaviour shows up here first."""
    import botocore.exceptions

    c = s3.client()
    s3.make_bucket("t-conditional")
    c.put_object(Bucket="t-conditional", Key="k", Body=b"one")

    def refused(**kw) -> bool:
        try:
            c.put_object(Bucket="t-conditional", Key="k", Body=b"two", **kw)
        except botocore.exceptions.ClientError as e:
            return e.response["ResponseMetadata"]["HTTPStatusCode"] == 412
        return False
    assert refused(IfNoneMatch="*")
    assert refused(IfMatch='"0000"')
    assert c.get_object(Bucket="t-conditional", Key="k")["Body"].read() == b"one"


BUILD = """
    import sys
    from shardtrain.format.manifest import open_dataset
    from shardtrain.load.mapped import open_mapped
    try:
        open_mapped(open_dataset(sys.argv[1]), sys.argv[2], text=True)
    except OSError as e:
        print(e)
        sys.exit(3)
    print("built")
"""


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs (mode 0700) mounted for the test; skipped, saying why, where mount is not allowed."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root/CAP_SYS_ADMIN): {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("rows, text_chars, found", [(20_000, 300, "while writing"), (60_000, 10, "before writing")])
def test_disk_full_while_building_the_index_map_is_an_error_not_sigbus(tmp_path, small_disk, rows, text_chars,
                                                                        found):
    """The copy does not fit: one line naming the folder and the space, exit status 3, no temp folder left. With
    300-character transcripts the estimate (from Parquet's dictionary-encoded sizes) passes and the disk fills
    during the writes; 60k rows are refused up front. Through a memory map this was a SIGBUS (-7)."""
    ds = write_index_dataset(tmp_path / "ds", rows, text="X" * text_chars)
    r = _py(BUILD, ds, str(small_disk))
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr[-3000:])
    assert f"in {small_disk}" in r.stdout and "MB free" in r.stdout and "stream.index_cache_dir" in r.stdout
    assert ("needs more than" in r.stdout) == (found == "while writing"), r.stdout
    assert [p.name for p in small_disk.iterdir() if p.is_dir()] == []  # no temp folder left behind
    assert "which has 0.0 MB free" not in r.stdout  # the space it had, once the partial copy is gone
