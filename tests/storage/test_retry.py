"""storage/retry.py: which errors are retried, which are named as credentials or the clock, and the backoff that
waits under one budget without progress. The errors are the real types the network stack raises (botocore's
ClientError and NoCredentialsError, OSErrors, s3http's HTTPStatusError); the waits are real sleeps (milliseconds).
The same rules against real servers: tests/storage/test_trust_net.py, tests/integration/test_outage_s3.py."""
from __future__ import annotations

import email.utils
import http.client
import time

import pytest
from botocore.exceptions import ClientError, NoCredentialsError

from shardtrain.storage.clock import ProgressClock
from shardtrain.storage.retry import (CREDENTIALS_HELP, Backoff, ClockSkewError, CredentialsError,
                                      StorageUnavailable, credentials_error, is_transient)


def client_error(code: str, status: int, date: float | None = None) -> ClientError:
    meta: dict = {"HTTPStatusCode": status, "HTTPHeaders": {}}
    if date is not None:
        meta["HTTPHeaders"]["date"] = email.utils.formatdate(date, usegmt=True)
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": meta}, "GetObject")


@pytest.mark.parametrize("error, transient", [
    (ConnectionRefusedError("refused"), True),
    (ConnectionResetError("reset"), True),
    (TimeoutError("read timed out"), True),
    (http.client.IncompleteRead(b"x", 10), True),
    (OSError(5, "EIO from s3fs"), True),
    (client_error("SlowDown", 503), True),
    (client_error("RequestTimeout", 408), True),
    (client_error("TooManyRequests", 429), True),
    (client_error("NoSuchKey", 404), False),
    (FileNotFoundError("s3://b/k"), False),
    (IsADirectoryError("s3://b/"), False),
    (client_error("InvalidAccessKeyId", 403), False),
    (StorageUnavailable("budget spent", "s3://b/k"), False),
    (TypeError("a bug"), False),
    (KeyError("a bug"), False),
])
def test_is_transient(error, transient):
    assert is_transient(error) is transient


def test_credentials_missing_refused_and_through_a_chain():
    missing = credentials_error(NoCredentialsError(), "s3://b/k")
    assert isinstance(missing, CredentialsError) and missing.args[0].startswith("s3://b/k: no usable S3 credentials")
    assert CREDENTIALS_HELP in str(missing)
    refused = credentials_error(client_error("SignatureDoesNotMatch", 403))
    assert isinstance(refused, CredentialsError) and "SignatureDoesNotMatch" in str(refused)
    try:  # s3fs wraps the ClientError: the cause chain is followed
        try:
            raise client_error("InvalidAccessKeyId", 403)
        except ClientError as inner:
            raise PermissionError("Forbidden") from inner
    except PermissionError as outer:
        assert "InvalidAccessKeyId" in str(credentials_error(outer))
    assert credentials_error(ConnectionResetError("reset")) is None
    assert credentials_error(client_error("NoSuchKey", 404)) is None


def test_a_403_from_a_server_an_hour_away_blames_the_clock_not_the_keys():
    skewed = credentials_error(client_error("403", 403, date=time.time() + 3600), "s3://b/k")
    assert isinstance(skewed, ClockSkewError) and "clock is off by 60 min" in str(skewed)
    assert "behind" in str(skewed) and "timedatectl" in str(skewed)
    near = credentials_error(client_error("403", 403, date=time.time() + 10))  # 10 s: the keys, not the clock
    assert type(near) is CredentialsError and "HTTP 403" in str(near)
    named = credentials_error(client_error("RequestTimeTooSkewed", 403))
    assert isinstance(named, ClockSkewError) and "RequestTimeTooSkewed" in str(named)


def test_backoff_waits_grow_and_stop_at_the_retry_cap():
    b = Backoff("s3://b/k", retries=3, backoff_s=0.02, max_backoff_s=0.05)
    waits = []
    for _ in range(3):
        t0 = time.monotonic()
        b.wait(ConnectionResetError("reset"), "at byte 0")
        waits.append(time.monotonic() - t0)
    assert 0.01 <= waits[0] and all(w < 0.5 for w in waits)  # jittered in [0.5, 1] x min(max, base * 2**k)
    with pytest.raises(StorageUnavailable, match=r"reading s3://b/k at byte 0 failed after 3 retries"):
        b.wait(ConnectionResetError("reset"), "at byte 0")


def test_backoff_progress_starts_a_new_streak_and_the_budget_ends_it():
    clock = ProgressClock("s3://b/k", budget_s=60)
    b = Backoff("s3://b/k", retries=1, backoff_s=0.001, clock=clock)
    b.wait(ConnectionResetError("reset"), "x")
    clock.done()  # bytes arrived: the failure count starts again, so one more failure is allowed
    b.wait(ConnectionResetError("reset"), "x")
    assert b.failures == 1
    spent = Backoff("s3://b/k", budget_s=0.05, backoff_s=0.001)
    time.sleep(0.06)
    with pytest.raises(StorageUnavailable, match="retry budget 0.05 s") as e:
        spent.wait(TimeoutError("stall"), "x")
    assert e.value.url == "s3://b/k"
