"""The trainer's lease (storage/lock.py with ttl_s): refused while live, renewed, taken over once expired by exactly
one of several claimants, lost by a holder that stalled past its expiry. Local folder and SeaweedFS."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from shardtrain import storage
from shardtrain.storage.lock import LEASE_NAME, LeaseLost, LockHeld, acquire_lock


def _lease(url: str, so: dict | None = None, ttl_s: float = 60.0):
    return acquire_lock(url, so, purpose="trainer", name=LEASE_NAME, ttl_s=ttl_s)


def _expire(url: str, so: dict | None) -> None:
    """Age the holder's lease into the past, as a holder that died an hour ago would have left it."""
    path = storage.join(url, LEASE_NAME)
    holder = json.loads(storage.read_bytes(path, so))
    storage.atomic_write_bytes(path, json.dumps({**holder, "host": "node-gone", "expires_unix": time.time() - 1})
                               .encode(), so)


def _race_for_expired(url: str, so: dict | None) -> None:
    first = _lease(url, so)
    _expire(url, so)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: _try(url, so), range(4)))
    winners = [r for r in results if not isinstance(r, LockHeld)]
    assert len(winners) == 1, results  # the claim lets exactly one take the expired lease over
    assert all("is locked by another trainer" in str(r) for r in results if isinstance(r, LockHeld))
    with pytest.raises(LeaseLost, match="taken over"):
        first.renew()  # the stalled holder learns it at its next renewal
    winners[0].renew()
    winners[0].release()
    assert not storage.exists(storage.join(url, LEASE_NAME), so)


def _try(url: str, so: dict | None):
    try:
        return _lease(url, so)
    except LockHeld as e:
        return e


def test_live_lease_is_refused_renewed_and_an_expired_one_taken_over_by_one(tmp_path):
    url = str(tmp_path / "run")
    lease = _lease(url)
    before = json.loads((tmp_path / "run" / LEASE_NAME).read_text())["expires_unix"]
    with pytest.raises(LockHeld, match=r"locked by another trainer: pid \d+ on host .*lease expires in \d+ s"):
        _lease(url)
    time.sleep(0.01)
    lease.renew()
    assert json.loads((tmp_path / "run" / LEASE_NAME).read_text())["expires_unix"] > before
    lease.release()
    _race_for_expired(url, None)


@pytest.mark.slow
@pytest.mark.s3
def test_expired_lease_on_s3_is_taken_over_by_exactly_one(s3, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    _race_for_expired(f"{s3_bucket}/run", s3.storage_options)
