"""Slow or hostile S3 endpoints and missing keys, against the real SeaweedFS (`s3` fixture) behind the FaultProxy:
a silent or trickling server is cut at the loader's budget with one line, 503 SlowDown for a few seconds loses
nothing, a redirect to another host carries no credential there, a held upload stays atomic, and every command
that takes an `s3://` URL fails at once, in one line naming what to set, when keys are missing or refused."""
from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from conftest import shardtrain_cli_many
from shardtrain import storage
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.testing.corpus import make_corpus
from shardtrain.testing.proxy import FaultProxy, RecordingServer
from shardtrain.world import World

pytestmark = [pytest.mark.s3, pytest.mark.slow]

DURS = [0.5 + 0.25 * (i % 7) for i in range(24)]
BUDGET_S = 3.0
MARGIN_S = 2.5
"""A cut may come this long after the budget: one backoff step and a loaded 2-core machine's scheduling."""


@pytest.fixture(scope="module")
def dataset(s3, tmp_path_factory):
    root = tmp_path_factory.mktemp("trust_net")
    corpus = make_corpus(root / "corpus", DURS, seed=5)
    url = s3.make_bucket("trust-net") + "/ds"
    pack(PackConfig(input=str(corpus), output=url, storage_options=s3.storage_options, max_samples_per_shard=6,
                    workers=1, progress=False))
    return url, corpus


@pytest.fixture
def proxy(s3):
    with FaultProxy("127.0.0.1", s3.port) as p:
        yield p


def cfg(**kw) -> StreamConfig:
    return StreamConfig(bucket=BucketConfig(max_batch_seconds=6.0, chunk_mb=0.05, num_buckets=4), epochs=1,
                        prefetch_chunks=1, **kw)


def consume(url: str, so: dict, **kw) -> list[str]:
    return [k for batch, _ in build_loader(url, world=World(), seed=0, cfg=cfg(**kw), storage_options=so)
            for k in batch.keys]


def failing(fn) -> tuple[float, str]:
    t0 = time.monotonic()
    with pytest.raises(OSError) as info:
        fn()
    return time.monotonic() - t0, str(info.value)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "s3fs"])
def test_silent_endpoint_cuts_metadata_read_at_the_loader_budget(s3, dataset, proxy, direct):
    """The manifest read (metadata, formerly always 120 s) obeys stream.retry_budget_s on both paths."""
    url, _ = dataset
    proxy.arm("silence")
    took, msg = failing(lambda: consume(url, s3.storage_options_for(proxy.endpoint_url), retry_budget_s=BUDGET_S,
                                        s3_direct_http=direct))
    assert BUDGET_S - 0.2 <= took < BUDGET_S + MARGIN_S, (took, msg)
    assert "\n" not in msg and "manifest.json" in msg, msg
    if direct:
        assert "stall" in msg, msg


def test_trickling_endpoint_cuts_shard_read_at_the_budget(s3, dataset, proxy):
    """Metadata read healthy, then every answer trickles at 1 byte/s: the shard read stops within the budget
    with one line naming the shard and the trickle."""
    url, _ = dataset
    loader = build_loader(url, world=World(), seed=0, cfg=cfg(retry_budget_s=BUDGET_S),
                          storage_options=s3.storage_options_for(proxy.endpoint_url))
    proxy.arm("trickle", trickle_bps=1, trickle_after=0)
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        for _ in loader:
            pass
    took, msg = time.monotonic() - t0, str(info.value)
    assert took < BUDGET_S + MARGIN_S, (took, msg)
    assert "\n" not in msg.strip() and "shard-" in msg and "trickle" in msg, msg


def test_slowdown_for_seconds_loses_nothing(s3, dataset, proxy):
    """503 SlowDown for 3 s from the first request (manifest, index, shards): ridden out, every key once."""
    url, _ = dataset
    expected = sorted(consume(url, s3.storage_options))
    proxy.arm("slowdown", for_s=3.0)
    got = consume(url, s3.storage_options_for(proxy.endpoint_url), retry_budget_s=20.0, retry_backoff_s=0.05)
    assert sorted(got) == expected and len(got) == len(DURS)
    assert proxy.requests["slowdown"] >= 2


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "s3fs"])
def test_redirect_to_another_host_carries_no_credentials(s3, dataset, proxy, direct):
    """A 307 to another host is not followed: that host receives no request at all (no signature, no session
    token, no access key id), and the read fails in one line."""
    url, _ = dataset
    so = s3.storage_options_for(proxy.endpoint_url) | {"token": "SESSION-TOKEN-must-stay-home"}
    with RecordingServer() as other:
        proxy.arm("redirect", redirect_to=other.url)
        took, msg = failing(lambda: storage.read_bytes(f"{url}/manifest.json", so, direct_http=direct, budget_s=60))
        time.sleep(0.2)
        leaked = b"".join(other.heads)
    assert other.heads == [], leaked[:500]
    assert took < 20 and "\n" not in msg and "redirected" in msg and "not followed" in msg, (took, msg)
    assert s3.secret_key not in msg and "SESSION-TOKEN" not in msg and "X-Amz-Signature=0" not in msg


def test_held_upload_stays_atomic(s3, dataset, proxy):
    """An upload whose body is held 2 s: nobody sees a partial object meanwhile, then the whole one appears."""
    url, _ = dataset
    target = url.rsplit("/", 1)[0] + "/held/blob.bin"
    data = os.urandom(3 << 20)
    proxy.arm("hold_upload", hold_s=2.0)
    done: dict = {}
    t = threading.Thread(target=lambda: done.setdefault("r", storage.atomic_write_bytes(
        target, data, s3.storage_options_for(proxy.endpoint_url))), daemon=True)
    t.start()
    seen = []
    while t.is_alive():
        seen.append(storage.exists(target, s3.storage_options))
        time.sleep(0.2)
    t.join()
    assert proxy.requests["hold_upload"] >= 1 and not any(seen[:5])
    assert storage.read_bytes(target, s3.storage_options) == data


# ---- credentials through the real CLI ----------------------------------------------------------------------
SMALL = ["model.d_model=32", "model.num_layers=1", "train.augment=false", "stream.bucket.max_batch_seconds=8",
         "stream.bucket.num_buckets=1", "train.tensorboard=false", "train.progress=false", "train.cpu_threads=1",
         "train.val_every_steps=0", "train.log_every_steps=20"]


@pytest.fixture(scope="module")
def local_run(dataset, tmp_path_factory):
    """A local packed copy and a 1-step checkpoint (transcribe needs a model before it reads its input)."""
    from pipelines import load_pipeline
    from shardtrain.train.loop import train
    from shardtrain.train.overrides import apply_overrides

    root = tmp_path_factory.mktemp("trust_net_local")
    _, corpus = dataset
    pack(PackConfig(input=str(corpus), output=str(root / "ds"), max_samples_per_shard=6, workers=1, progress=False))
    cfg = apply_overrides(load_pipeline("tiny_cpu"), SMALL + [f"train.data_url={root / 'ds'}",
                                                             f"train.out_dir={root / 'run'}", "train.max_steps=1"])
    train(cfg, World())
    return root


INFO_LINE = re.compile(r"^\d\d:\d\d:\d\d \[rank\d+\] (INFO|DEBUG) ")
"""A log record at INFO (e.g. transcribe's "loaded checkpoint"): not an error line. WARNING lines do count."""


def _commands(url: str, corpus: Path, root: Path, tmp: Path) -> dict[str, list[str]]:
    train = ["train", "--pipeline", "tiny_cpu", "--max-steps", "1"] + [a for s in SMALL for a in ("--set", s)]
    return {
        "inspect": ["inspect", url],
        "bench": ["bench", url, "--max-batches", "1", "--no-progress"],
        "pack": ["pack", str(corpus), f"{url}-new", "--no-progress"],
        "train": train + ["--data", url, "--out", str(tmp / "t1")],
        "val-data": train + ["--data", str(root / "ds"), "--val-data", url, "--out", str(tmp / "t2")],
        "transcribe": ["transcribe", str(root / "run"), url, "--no-progress"],
    }


@pytest.mark.parametrize("case", ["missing", "refused"])
def test_every_command_fails_at_once_in_one_line_without_usable_keys(s3, dataset, local_run, tmp_path, case):
    """No keys anywhere (options, environment, profile), or keys the server refuses: each command exits 1 within
    seconds, without a retry (the old behaviour spent the 120 s budget; the time bound below leaves room for a
    loaded 2-core machine), with exactly one stderr line naming the variables and the profile option."""
    url, corpus = dataset
    env = dict(AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_ENDPOINT_URL=s3.endpoint_url, AWS_DEFAULT_REGION="us-east-1")  # no AWS_* of the caller's
    if case == "refused":
        env.update(AWS_ACCESS_KEY_ID="wrongkey", AWS_SECRET_ACCESS_KEY="wrong-secret-value")
    cmds = _commands(url, corpus, local_run, tmp_path)
    # every command through the CLI's main in one fresh interpreter with that environment (torch imported once,
    # not 6 times); each command's own time is measured around its main()
    runs = shardtrain_cli_many(*cmds.values(), env=env, timeout=600)
    procs = {name: (p.wall_s, p.returncode, p.stderr) for name, p in zip(cmds, runs)}
    bad = []
    for name, (took, rc, err) in procs.items():
        lines = [ln for ln in err.splitlines() if ln.strip() and not INFO_LINE.match(ln)]
        ok = (rc == 2 and len(lines) == 1 and "AWS_ACCESS_KEY_ID" in lines[0] and "profile=" in lines[0]
              and ("no usable S3 credentials" if case == "missing" else "refused") in lines[0]
              and took < 90 and "retry" not in err)
        if not ok:
            bad.append(f"{name}: rc={rc} {took:.1f}s stderr={err[-1500:]!r}")
        print(f"\n{case} {name}: {took:.1f} s: {lines[-1][:160] if lines else ''}")
    assert not bad, "\n".join(bad)
