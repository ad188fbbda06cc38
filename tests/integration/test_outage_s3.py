"""Outages and refusals against a dedicated real SeaweedFS server (this module's own, never the session's `s3`):
a server down for 8 s mid-epoch costs time and no sample; revoked keys, a missing object and an outage longer
than the retry budget stop the loader and `shardtrain train` loudly, naming the URL."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.load.reader import StreamError
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.storage import s3http
from shardtrain.testing.corpus import make_corpus
from shardtrain.testing.s3server import LocalS3
from shardtrain.world import World

pytestmark = [pytest.mark.s3, pytest.mark.slow]

DURS = [0.5 + 0.3 * ((i * 5) % 17) for i in range(48)]
OUTAGE_S = 8.0  # long enough that reads meet it (asserted: retries logged), short enough for the suite


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A LocalS3 that tests crash and restart, holding one packed dataset; the original keys are restored after
    each test that changes them (see `restart`)."""
    root = tmp_path_factory.mktemp("outage")
    s3 = LocalS3(root / "data").start()
    try:
        corpus = make_corpus(root / "corpus", DURS, seed=3)
        url = s3.make_bucket("outage") + "/ds"
        pack(PackConfig(input=str(corpus), output=url, storage_options=s3.storage_options,
                        max_samples_per_shard=8, workers=1, progress=False))
        yield s3, url, dict(s3.storage_options)
    finally:
        s3.stop()


def restart(s3: LocalS3, down_s: float, *, access_key: str | None = None, secret_key: str | None = None) -> dict:
    """Crash the server, keep it down `down_s`, start it again (optionally with other keys): the timeline."""
    t0 = time.monotonic()
    s3.crash()
    time.sleep(down_s)
    if access_key:
        s3.access_key, s3.secret_key = access_key, secret_key
    s3.start()
    return {"down_s": down_s, "back_after_s": time.monotonic() - t0}


def stream_cfg(**kw) -> StreamConfig:
    return StreamConfig(bucket=BucketConfig(max_batch_seconds=6.0, chunk_mb=0.05, num_buckets=4), epochs=1,
                        prefetch_chunks=1, **kw)


def consume(url: str, so: dict, on_batch=None, **kw) -> tuple[list[str], object, float]:
    loader = build_loader(url, world=World(), seed=0, cfg=stream_cfg(**kw), storage_options=so)
    keys: list[str] = []
    t0 = time.monotonic()
    for i, (batch, _) in enumerate(loader):
        keys += batch.keys
        if on_batch:
            on_batch(i)
        time.sleep(0.05)  # a trainer's step: the epoch lasts long enough for the outage to fall inside it
    return keys, loader, time.monotonic() - t0


def in_background(fn, *args, **kw) -> tuple[threading.Thread, dict]:
    """Run `fn` in a thread (the server must be restarted from the main thread: LocalS3's server dies with the
    thread that started it), its result or exception in the returned dict."""
    out: dict = {}

    def target() -> None:
        try:
            out["result"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def test_outage_mid_epoch_loses_nothing(server, caplog):
    """SeaweedFS SIGKILLed after the second batch and restarted 8 s later (it then answers 5xx/refuses for a
    while): the epoch delivers every sample exactly once, skips nothing, and is late by about the outage."""
    s3, url, so = server
    s3http._signed.clear()
    ref, _, base_s = consume(url, so)
    assert sorted(ref) == sorted(set(ref)) and len(ref) == len(DURS)
    second = threading.Event()
    caplog.set_level("WARNING", logger="shardtrain.storage")
    t, out = in_background(consume, url, so, on_batch=lambda i: i == 1 and second.set())
    assert second.wait(60)
    timeline = restart(s3, OUTAGE_S)
    t.join(180)
    assert "error" not in out, out.get("error")
    keys, loader, took_s = out["result"]
    assert keys == ref, "a sample was lost, duplicated or reordered by the outage"
    assert loader.stats()["skipped"] == 0
    retried = [r for r in caplog.records if "retry" in r.getMessage()]
    assert retried, "no read met the outage: the test proves nothing"
    lost = took_s - base_s - timeline["back_after_s"]
    print(f"\nOUTAGE loader: base epoch {base_s:.1f} s, with outage {took_s:.1f} s, server back after "
          f"{timeline['back_after_s']:.1f} s -> {lost:+.1f} s beyond the outage "
          f"({(took_s - base_s) / timeline['back_after_s']:.2f} s lost per outage second), {len(retried)} retries")


def test_outage_past_budget_stops_naming_the_url(server):
    """A 5 s retry budget and a server down for longer: StreamError naming the shard URL, within ~budget."""
    s3, url, so = server
    s3http._signed.clear()
    errors: list[BaseException] = []
    t_crash: list[float] = []

    def crash_at(i: int) -> None:
        if i == 1:
            s3.crash()
            t_crash.append(time.monotonic())

    try:
        with pytest.raises(StreamError) as err:
            consume(url, so, on_batch=crash_at, retry_budget_s=5.0)
        waited = time.monotonic() - t_crash[0]
    finally:
        s3.start()
    msg = str(err.value)
    assert f"{url}/shard-" in msg and "retry budget 5 s" in msg and "storage unreachable" in msg
    assert 4.0 < waited < 20.0, f"gave up after {waited:.1f} s with a 5 s budget"
    del errors


# ---- `shardtrain train` end to end --------------------------------------------------------------------------
TRAIN = ["model.d_model=96", "model.num_layers=2", "model.dropout=0", "train.augment=false",
         "train.warmup_steps=3", "stream.bucket.max_batch_seconds=6", "stream.bucket.num_buckets=4",
         "stream.bucket.chunk_mb=0.05", "train.tensorboard=false", "train.log_every_steps=1",
         "train.cpu_threads=1", "stream.prefetch_chunks=1"]


def start_train(s3: LocalS3, url: str, out: Path, steps: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, **s3.env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    sets = [a for x in TRAIN + list(extra) for a in ("--set", x)]
    cmd = [sys.executable, "-m", "shardtrain", "train", "--data", url, "--out", str(out), "--pipeline", "tiny_cpu",
           "--max-steps", str(steps), *sets]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def steps_logged(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if '"loss"' in x]


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout_s: float = 120.0) -> None:
    t0 = time.monotonic()
    while not any(r["step"] >= step for r in steps_logged(out)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() - t0 < timeout_s, "training never reached the step"
        time.sleep(0.1)


def test_train_rides_out_outage_and_stops_on_refusal(server, tmp_path):
    """`shardtrain train` (a real process): an 8 s outage at step 2 costs time only (every step logged once,
    nothing skipped, exit 0); then the server comes back with other keys during a second run, which stops
    non-zero with one line naming 403 and the shard URL."""
    s3, url, _ = server
    out = tmp_path / "run"
    proc = start_train(s3, url, out, 20)
    wait_for_step(proc, out, 2)
    t0 = time.monotonic()
    timeline = restart(s3, OUTAGE_S)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    rows = steps_logged(out)
    assert [r["step"] for r in rows] == list(range(1, 21)), "a step was skipped or repeated"
    assert rows[-1]["skipped"] == 0 and "retry" in err
    assert "step 20/20  loss" in err and "audio-s/s  data wait" in err  # no TTY: progress lines, not a bar
    print(f"\nOUTAGE train: outage {timeline['back_after_s']:.1f} s, run finished {time.monotonic() - t0:.1f} s "
          f"after the crash; max data wait {max(r['data_wait_pct'] for r in rows):.0f}%")

    old = (s3.access_key, s3.secret_key)
    out2 = tmp_path / "revoked"
    proc = start_train(s3, url, out2, 40)
    try:
        wait_for_step(proc, out2, 2)
        restart(s3, 0.0, access_key="otherkey", secret_key="other-secret")
        t1 = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - t1
    finally:
        restart(s3, 0.0, access_key=old[0], secret_key=old[1])
    assert proc.returncode == 1 and took < 60, (proc.returncode, took)
    last = err.strip().splitlines()[-1]
    assert last.startswith("train: error: cannot read shard s3://outage/ds/shard-"), err[-2000:]
    assert "403" in last and "access denied" in last
    assert "Traceback" not in err
    assert max(r["step"] for r in steps_logged(out2)) < 40


def test_train_outage_past_budget_exits_nonzero(server, tmp_path):
    """An outage longer than a 5 s retry budget: exit 1, one line naming the shard URL and the budget."""
    s3, url, _ = server
    out = tmp_path / "run"
    proc = start_train(s3, url, out, 40, "stream.retry_budget_s=5")
    try:
        wait_for_step(proc, out, 2)
        s3.crash()
        _, err = proc.communicate(timeout=120)
    finally:
        s3.start()
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("train: error: cannot read shard s3://outage/ds/shard-"), err[-2000:]
    assert "retry budget 5 s" in last and "Traceback" not in err
