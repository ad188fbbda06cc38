"""The local SigV4 presigner against botocore (golden set), and when the direct S3 path steps aside for s3fs."""
from __future__ import annotations

import datetime
import http.server
import os
import ssl
import threading
import urllib.parse
from unittest import mock

import botocore
import botocore.config
import botocore.session
import pytest

from shardtrain import storage
from shardtrain.storage import fs, s3http
from shardtrain.storage.s3http import StaticCredentials, direct_unsupported, sigv4_presign

NOW = 1_767_225_600.0 + 12_345.0  # 2026-01-01 03:25:45 UTC
ENDPOINTS = ["http://127.0.0.1:8333", "https://s3.example.com:443", "http://Host.Example.com:80",
             "https://minio.local:9000/", "https://r2.example.com/prefix"]
KEYS = ["a/b.tar", "odd key+plus=eq&amp;~tilde%pct", "ünïcödé/ß.tar", "a//double/slash", "sp ace/(paren)!*'$@:;,"]


def botocore_urls(endpoint: str, keys: list[str], token: str | None, region: str) -> list[str]:
    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name=region, aws_access_key_id="AKIDEXAMPLE",
        aws_secret_access_key="wJalr/K7MDENG+bPxRfiCY", aws_session_token=token,
        config=botocore.config.Config(signature_version="s3v4", s3={"addressing_style": "path"}))
    now = datetime.datetime.fromtimestamp(NOW, datetime.timezone.utc).replace(tzinfo=None)
    with mock.patch("botocore.auth.get_current_datetime", return_value=now):  # botocore's clock, frozen
        return [client.generate_presigned_url("get_object", Params={"Bucket": "bkt", "Key": k}, ExpiresIn=3600)
                for k in keys]


@pytest.mark.parametrize("token,region", [(None, "us-east-1"), ("FQoG/session+token==", "eu-west-3")])
def test_presign_matches_botocore(token, region):
    """Same path, same query (signature included) as botocore for odd keys, session tokens, regions, endpoint
    prefixes and explicit default ports (https://host:443 signs `host`, as http.client sends it)."""
    for endpoint in ENDPOINTS:
        refs = botocore_urls(endpoint.rstrip("/"), KEYS, token, region)
        for key, ref_url in zip(KEYS, refs):
            creds = StaticCredentials(endpoint=endpoint.rstrip("/"), key="AKIDEXAMPLE",
                                      secret="wJalr/K7MDENG+bPxRfiCY", token=token, region=region)
            mine = urllib.parse.urlsplit(sigv4_presign(creds, f"bkt/{key}", 3600, NOW))
            ref = urllib.parse.urlsplit(ref_url)
            assert (mine.path, urllib.parse.parse_qs(mine.query)) == \
                (ref.path, urllib.parse.parse_qs(ref.query)), (endpoint, key)
            assert mine.netloc == urllib.parse.urlsplit(endpoint).netloc  # connects where it was told to


BASE = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}}


@pytest.mark.parametrize("extra,why", [
    ({}, None),
    ({"anon": True}, "anonymous"),
    ({"requester_pays": True}, "requester pays"),
    ({"s3_additional_kwargs": {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": "x" * 32}}, "SSE-C"),
    ({"s3_additional_kwargs": {"RequestPayer": "requester"}}, "request-payer"),
    ({"config_kwargs": {"s3": {"addressing_style": "virtual"}}}, "virtual-host"),
    ({"config_kwargs": {"proxies": {"http": "http://proxy:3128"}}}, "configured proxy"),
])
def test_direct_path_defers_where_it_would_be_wrong(extra, why, monkeypatch):
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    got = direct_unsupported({**BASE, **extra})
    assert got is None if why is None else why in got
    if why is not None:  # and fs reads such URLs through s3fs: no bucket/key for the direct path
        assert fs._direct_s3_key("s3://bkt/key", True, {**BASE, **extra}) is None


def test_environment_proxy_defers_unless_bypassed(monkeypatch):
    monkeypatch.setenv("http_proxy", "http://proxy.internal:3128")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    assert "proxy" in direct_unsupported(BASE)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    assert direct_unsupported(BASE) is None


def test_tls_context_honours_verify_and_ca_bundle(monkeypatch, tmp_path):
    """verify=False turns checks off; a bundle path (or AWS_CA_BUNDLE) is the only trust store, as in botocore."""
    pem = open(os.path.join(os.path.dirname(botocore.__file__), "cacert.pem")).read()
    first = pem[pem.index("-----BEGIN CERTIFICATE-----"):pem.index("-----END CERTIFICATE-----") + 25]
    bundle = tmp_path / "one-ca.pem"
    bundle.write_text(first + "\n")
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    off = s3http._tls_context({"client_kwargs": {"verify": False}})
    assert off.verify_mode == ssl.CERT_NONE and not off.check_hostname
    assert len(s3http._tls_context({"client_kwargs": {"verify": str(bundle)}}).get_ca_certs()) == 1
    monkeypatch.setenv("AWS_CA_BUNDLE", str(bundle))
    assert len(s3http._tls_context({}).get_ca_certs()) == 1


class _Answers(http.server.BaseHTTPRequestHandler):
    """400 to the first two GETs (as S3 answers a URL signed for the wrong region), then the bytes."""

    seen: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.seen.append(self.path)
        if len(self.seen) <= 2:
            body = b"<Error><Code>AuthorizationHeaderMalformed</Code><Message>region is wrong</Message></Error>"
            self.send_response(400)
        else:
            body = b"0123456789"
            self.send_response(206)
            self.send_header("Content-Range", "bytes 0-9/10")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_wrong_region_400_falls_back_to_s3fs_signing():
    """A 400 on a locally signed URL is treated like a 403: sign again, then let s3fs (botocore) sign."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        so = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{server.server_port}",
                                                           "region_name": "us-west-2"}}
        assert storage.read_range("s3://bkt/obj", 0, 10, so, direct_http=True, retries=0) == b"0123456789"
        assert len(_Answers.seen) == 3
        assert s3http.opts_key(so) in s3http._local_rejected  # s3fs signed the third request
    finally:
        server.shutdown()


class _BadRequest(http.server.BaseHTTPRequestHandler):
    """400 for a reason that has nothing to do with signing."""

    seen: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.seen.append(self.path)
        body = b"<Error><Code>InvalidArgument</Code><Message>bad part number</Message></Error>"
        self.send_response(400)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_other_400_is_hopeless_and_keeps_local_signing():
    """A 400 that does not blame the signature is raised at once (not retried, local signing kept)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BadRequest)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        so = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{server.server_port}"}}
        with pytest.raises(s3http.HTTPStatusError, match="HTTP 400 .*InvalidArgument: bad part number"):
            storage.read_range("s3://bkt/obj", 0, 10, so, direct_http=True, backoff_s=5.0)
        assert len(_BadRequest.seen) == 1 and s3http.opts_key(so) not in s3http._local_rejected
    finally:
        server.shutdown()


BLOB = bytes(range(256)) * 40  # 10,240 bytes


class _RewrittenRanges(http.server.BaseHTTPRequestHandler):
    """A server (or a cache in front of one) that answers a 206 with another range than asked: `shift` rounds the
    start down to 4 KiB, `cap` returns at most 1,000 bytes; the Content-Range says so honestly."""

    mode = "shift"

    def do_GET(self):  # noqa: N802 - http.server's name
        rng = self.headers["Range"].removeprefix("bytes=")
        if rng.startswith("-"):  # a suffix range (a Parquet footer): answer a block-aligned piece
            a = max(0, len(BLOB) - int(rng[1:]))
            a, b = a - a % 4096, len(BLOB) - 1
        else:
            a_s, b_s = rng.split("-")
            a, b = int(a_s), min(int(b_s) if b_s else len(BLOB) - 1, len(BLOB) - 1)
            a, b = (a - a % 4096, b) if self.mode == "shift" else (a, min(b, a + 999))
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {a}-{b}/{len(BLOB)}")
        self.send_header("Content-Length", str(b - a + 1))
        self.end_headers()
        self.wfile.write(BLOB[a:b + 1])

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("mode,start,end", [("shift", 5000, 6000), ("shift", 100, None), ("cap", 0, None),
                                            ("cap", 100, None), ("cap", 0, 5000)])
def test_a_206_of_another_range_is_refused_not_stitched(mode, start, end):
    """Bytes a server answered for another range than asked were placed at the asked offset (a block-aligned
    answer: 1,000 wrong bytes, or the whole object from byte 0 for a read from byte 100), and a capped answer was
    taken for the object's end (a whole-object read returned its first 1,000 bytes), silently. Now refused."""
    _RewrittenRanges.mode = mode
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RewrittenRanges)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        so = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{server.server_port}"}}
        with pytest.raises(s3http.HTTPStatusError, match="answered bytes .* not the range asked for"):
            storage.read_range("s3://bkt/obj", start, end, so, direct_http=True, backoff_s=5.0)
        with pytest.raises(s3http.HTTPStatusError, match="not the object's tail"):  # a Parquet footer's read
            s3http.read_tail("bkt/obj", so, lambda: None, 1000)
    finally:
        server.shutdown()
