"""Time without progress, credentials and hygiene on the network path (fast: a small real HTTP server on loopback,
the FaultProxy in front of it; the SeaweedFS versions are in tests/integration/test_trust_net_s3.py).

The direct S3 path presigns URLs locally when the options hold an endpoint and keys; this server answers ranged GETs
like S3 (206 + Content-Range) and refuses a key named `badkey` the way S3 does (403 InvalidAccessKeyId)."""
from __future__ import annotations

import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from shardtrain import storage
from shardtrain.storage.clock import PROGRESS_BYTES, ProgressClock
from shardtrain.testing.proxy import FaultProxy, RecordingServer

BLOB = os.urandom(1 << 20)
SECRET = "s3cr3t-value-that-must-not-print"


class _S3ish(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):
        if "=badkey" in self.path:  # SigV4 (X-Amz-Credential=) or s3fs's SigV2 (AWSAccessKeyId=)
            body = b"<Error><Code>InvalidAccessKeyId</Code><Message>The key does not exist</Message></Error>"
            self.send_response(403)
        elif not self.path.startswith("/b/blob?"):
            body = b"<Error><Code>NoSuchKey</Code><Message>no</Message></Error>"
            self.send_response(404)
        else:
            m = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            a = int(m.group(1)) if m else 0
            b = int(m.group(2)) + 1 if m and m.group(2) else len(BLOB)
            body = BLOB[a:min(b, len(BLOB))]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {a}-{a + len(body) - 1}/{len(BLOB)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _S3ish)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def proxy(server):
    with FaultProxy("127.0.0.1", server.server_address[1]) as p:
        yield p


def _opts(endpoint: str, key: str = "goodkey") -> dict:
    return {"key": key, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint}}


def _timed_failure(fn, exc=storage.StorageUnavailable):
    t0 = time.monotonic()
    with pytest.raises(exc) as info:
        fn()
    return time.monotonic() - t0, str(info.value)


def test_silent_server_is_cut_at_the_budget_with_one_line(proxy):
    """Accepts, reads the request, never answers: cut at the budget (not the old 60 s socket timeout x retries)."""
    proxy.arm("silence")
    took, msg = _timed_failure(lambda: storage.read_range("s3://b/blob", 0, 1000, _opts(proxy.endpoint_url),
                                                          direct_http=True, budget_s=1.5))
    assert 1.4 <= took < 3.0, took
    assert "\n" not in msg and "s3://b/blob" in msg and "stall" in msg and "waiting for an answer" in msg, msg


def test_trickling_server_is_cut_at_the_budget(proxy):
    """Bytes keep coming, far too slowly to count as progress: cut at the budget, named a trickle."""
    proxy.arm("trickle", trickle_bps=20, trickle_after=0)
    took, msg = _timed_failure(lambda: storage.read_range("s3://b/blob", 0, 4096, _opts(proxy.endpoint_url),
                                                          direct_http=True, budget_s=1.5))
    assert 1.4 <= took < 3.0, took
    assert "\n" not in msg and "trickle" in msg, msg


def test_trickling_body_after_healthy_headers_is_cut(proxy):
    """Status and headers arrive at once, then the body trickles: the body's wait is watched too."""
    proxy.arm("trickle", trickle_bps=50, trickle_after=2000)
    took, msg = _timed_failure(lambda: storage.read_range("s3://b/blob", 0, 200_000, _opts(proxy.endpoint_url),
                                                          direct_http=True, budget_s=1.5))
    assert 1.4 <= took < 3.0 and "trickle" in msg, (took, msg)


def test_slow_but_progressing_read_is_not_cut(proxy):
    """1 MB at ~400 KB/s takes ~2.5 s, longer than the 1 s budget, but every second brings far more than 64 KiB."""
    proxy.arm("trickle", trickle_bps=400_000, trickle_after=0)
    t0 = time.monotonic()
    assert storage.read_range("s3://b/blob", 0, None, _opts(proxy.endpoint_url), direct_http=True,
                              budget_s=1.0) == BLOB
    assert time.monotonic() - t0 > 1.5  # it really was slower than the budget


def test_refused_connection_is_retried_then_named():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    took, msg = _timed_failure(lambda: storage.read_bytes("s3://b/blob", _opts(f"http://127.0.0.1:{port}"),
                                                          direct_http=True, budget_s=1.0))
    assert 0.9 <= took < 2.5 and "connection refused" in msg and "\n" not in msg, (took, msg)


def test_slowdown_for_a_while_is_ridden_out(proxy):
    """503 SlowDown for 1.5 s under a 5 s budget: retried, every byte delivered once."""
    proxy.arm("slowdown", for_s=1.5)
    assert storage.read_range("s3://b/blob", 0, None, _opts(proxy.endpoint_url), direct_http=True,
                              budget_s=5.0, backoff_s=0.05) == BLOB
    assert proxy.requests["slowdown"] >= 2


def test_time_the_consumer_holds_a_piece_is_not_counted(server):
    """A consumer slower than the budget between pieces (decode, a full queue) is not the server's stall."""
    out = bytearray()
    for piece in storage.iter_range("s3://b/blob", 0, None, _opts(f"http://127.0.0.1:{server.server_address[1]}"),
                                    direct_http=True, budget_s=0.5, piece_bytes=256 << 10):
        out += piece
        if len(out) <= 512 << 10:
            time.sleep(0.7)
    assert bytes(out) == BLOB


def test_clock_counts_progress_in_units():
    c = ProgressClock("x", 10.0)
    m0 = c.mark
    c.got(PROGRESS_BYTES - 1)
    assert c.mark == m0 and c.pending == PROGRESS_BYTES - 1
    c.got(1)
    assert c.pending == 0 and c.mark >= m0
    c.got(5)
    assert c.describe().startswith("trickle: 5 bytes")
    silent = ProgressClock("x", 1.0)
    silent.expired, silent.phase = True, "answer"
    assert silent.describe() == "stall: no byte for 1 s (connected, waiting for an answer)"
    t = c.hold()
    time.sleep(0.05)
    before = c.mark
    c.resume(t)
    assert c.mark - before >= 0.05  # held time pushed the deadline back


def test_refused_keys_raise_credentials_error_at_once(server):
    took, msg = _timed_failure(
        lambda: storage.read_bytes("s3://b/blob", _opts(f"http://127.0.0.1:{server.server_address[1]}", "badkey"),
                                   direct_http=True), storage.CredentialsError)
    # s3fs starts up to sign the last try (seconds on a loaded machine); no retries
    assert took < 10 and "InvalidAccessKeyId" in msg and "AWS_ACCESS_KEY_ID" in msg and "profile=" in msg, msg
    assert "\n" not in msg and SECRET not in msg


def test_missing_keys_raise_credentials_error_without_retries(server, monkeypatch, tmp_path):
    """No keys anywhere (options, environment, profile): s3fs cannot sign; no retry can fix that."""
    for var in list(os.environ):
        if var.startswith("AWS_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    so = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{server.server_address[1]}"}}
    took, msg = _timed_failure(lambda: storage.read_bytes("s3://b/blob-missing-keys", so, direct_http=True),
                               storage.CredentialsError)
    assert took < 10 and "no usable S3 credentials" in msg and "AWS_SECRET_ACCESS_KEY" in msg, (took, msg)
    assert not storage.is_transient(storage.CredentialsError("x"))


def test_redirect_is_not_followed_and_carries_no_credentials(proxy):
    """The endpoint answers 307 to another host: the read stops with one line, the other host sees nothing."""
    with RecordingServer() as other:
        proxy.arm("redirect", redirect_to=other.url)
        took, msg = _timed_failure(lambda: storage.read_bytes("s3://b/blob", _opts(proxy.endpoint_url),
                                                              direct_http=True), OSError)
        assert other.heads == []
    assert "redirected to another host" in msg and "not followed" in msg and "\n" not in msg, msg
    assert "X-Amz-Signature=***" in msg or "Signature" not in msg
    assert not re.search(r"X-Amz-(Signature|Credential)=[^*]", msg), msg


def test_reprs_hold_no_secret(tmp_path):
    from shardtrain.format.manifest import Dataset
    from shardtrain.storage.redact import StorageOptions
    from shardtrain.storage.s3http import static_credentials

    so = StorageOptions(_opts("http://127.0.0.1:1", key="AKIAEXAMPLEKEY123456") | {"token": SECRET + "-token"})
    shown = [repr(so), str(so), f"{so}", repr(static_credentials(so)),
             repr(Dataset(url="s3://b/d", manifest={}, shards=[], storage_options=so)), repr({"opts": so})]
    for text in shown:
        assert SECRET not in text and "AKIAEXAMPLEKEY123456" not in text, text
    assert so["secret"] == SECRET and dict(so)["key"] == "AKIAEXAMPLEKEY123456"  # the values themselves are intact
