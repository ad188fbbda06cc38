"""Direct HTTP reads of S3 objects: presigned URLs, keep-alive `http.client` connections, ranged GETs.

Why not s3fs for the loader's reads: s3fs runs aiohttp on an event loop thread in the training process. Measured
against SeaweedFS on loopback, it spent ~0.7-1.0 CPU-s per GB there, holding the GIL that the decode threads
also need; a blocking `http.client` read into the socket buffer costs ~0.23 CPU-s per GB and hands bytes over
as they arrive. And starting s3fs (import, then botocore loading its service model for the first client) takes
~0.3 s per process before the first byte, which is most of a loader's time to first batch on S3.

Signing:
- With an explicit endpoint and explicit keys in the storage options (`key`/`secret`[/`token`],
  `client_kwargs.endpoint_url`[, `client_kwargs.region_name`]: MinIO, SeaweedFS, Ceph, R2, a local test server)
  URLs are presigned here (SigV4 query signing, path-style, ~20 us each) and s3fs is never imported.
- Otherwise (AWS's credential chain: profiles, SSO, instance roles), or when the server rejects a URL signed here
  (403, or 400 as for a wrong region), s3fs signs (`fs.sign`), so credentials, region and addressing follow the
  same rules as every other s3fs call. The signer matches botocore's on a golden set (tests/storage/test_s3http.py).
- The direct path is only taken where it is known to be right (`direct_unsupported`): a proxy (configured or
  from HTTP(S)_PROXY, as botocore would use), SSE-C or requester-pays arguments, virtual-host addressing or
  anonymous access leave the read to s3fs. A CA bundle (`client_kwargs.verify` = path, or AWS_CA_BUNDLE, which
  botocore also reads) or `verify=False` is honoured by the TLS context.

Versions: the first answer's ETag is kept in the caller's `pins`; every later GET of that object through them
(a retry resuming at a byte offset, the next run of the same shard) sends `If-Match`, and a 412 or another ETag
raises ObjectChanged (never retried): a shard replaced mid-read is an error for that shard, never spliced bytes.

Errors: 404 -> FileNotFoundError, 403 (after one re-sign) -> PermissionError, a body cut short -> ConnectionError,
a redirect -> HTTPStatusError, never followed (a presigned URL carries credentials; an S3 endpoint has no reason to
send a client to another host), other statuses -> HTTPStatusError (an OSError carrying `.status`; 5xx, 408 and
429 are transient, other 4xx are not). Retrying is the caller's job (`storage.iter_range` resumes at the byte
reached).

Time: every request runs under the caller's ProgressClock (storage.clock): connecting is bounded by the time left,
and while the request waits for its answer or its body the watchdog cuts it at the deadline, so a silent or
trickling server ends in a TimeoutError that says which (`clock.describe()`), within the budget.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import http.client
import io
import json
import logging
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from shardtrain.storage.clock import ProgressClock

log = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 60.0
"""Time without progress of a request made without a caller's clock (the storage layer always passes one)."""
PRESIGN_S = 3600
"""Lifetime of a presigned URL; cached URLs are re-signed 10 minutes before they expire."""
SUB_PIECE = 1 << 20
"""Largest piece handed over at once (smaller when the socket has less: nothing received waits for more)."""

FsFactory = Callable[[], Any]
"""Returns an s3fs filesystem (only called when a URL must be signed by s3fs)."""

_signed: dict[tuple[str, str], tuple[str, float]] = {}
"""(storage options, bucket/key) -> (presigned URL, expiry). Keyed by options, not by filesystem instance: fsspec
makes new instances in a forked DataLoader worker, which can then still use the URLs its parent signed."""
_local_rejected: set[str] = set()
"""Storage options whose locally signed URLs a server refused: s3fs signs for them from then on."""
_lock = threading.Lock()
_conns = threading.local()


def opts_key(storage_options: dict | None) -> str:
    return json.dumps(storage_options or {}, sort_keys=True, default=str)


class HTTPStatusError(OSError):
    """An S3 answer other than 2xx/403/404/416; `status` tells a transient one (5xx, 408, 429) from a hopeless one."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        return self.status >= 500 or self.status in (408, 429)


class ObjectChanged(HTTPStatusError):
    """The object is not the version this process first read (412 to If-Match, or another ETag in the answer):
    never retried, since a retry would splice bytes of two versions into one read."""

    def __init__(self, message: str):
        super().__init__(message, 412)


# ---- signing ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StaticCredentials:
    """What local signing needs; built only from explicit storage options (no environment, no profiles).
    Its repr shows the endpoint and region only."""

    endpoint: str
    key: str = field(repr=False)
    secret: str = field(repr=False)
    token: str | None = field(default=None, repr=False)
    region: str = "us-east-1"


def static_credentials(storage_options: dict | None) -> StaticCredentials | None:
    """Explicit endpoint + keys from s3fs-style storage options, or None when s3fs must sign."""
    so = storage_options or {}
    ck = so.get("client_kwargs") or {}
    endpoint = ck.get("endpoint_url") or so.get("endpoint_url")
    key = so.get("key") or ck.get("aws_access_key_id")
    secret = so.get("secret") or ck.get("aws_secret_access_key")
    if not (endpoint and key and secret) or so.get("anon") or so.get("requester_pays"):
        return None
    if urllib.parse.urlsplit(endpoint).scheme not in ("http", "https"):
        return None
    return StaticCredentials(endpoint=endpoint.rstrip("/"), key=key, secret=secret,
                             token=so.get("token") or ck.get("aws_session_token"),
                             region=ck.get("region_name") or so.get("region_name") or "us-east-1")


def direct_unsupported(storage_options: dict | None) -> str | None:
    """Why these options need s3fs for the whole request (not only for signing), or None when direct HTTP is right.

    Reads HTTP(S)_PROXY/NO_PROXY from the environment, because botocore does: a direct read that skipped a proxy
    every other request uses would reach a different network path (or none)."""
    so = storage_options or {}
    cfg = so.get("config_kwargs") or {}
    if so.get("anon"):
        return "anonymous access"
    if so.get("requester_pays"):
        return "requester pays"
    extra = so.get("s3_additional_kwargs") or {}
    if any(k.startswith("SSECustomer") or k == "RequestPayer" for k in extra):
        return "SSE-C / request-payer arguments"
    if (cfg.get("s3") or {}).get("addressing_style") == "virtual":
        return "virtual-host addressing"
    if cfg.get("proxies"):
        return "a configured proxy"
    endpoint = (so.get("client_kwargs") or {}).get("endpoint_url") or so.get("endpoint_url")
    host = urllib.parse.urlsplit(endpoint).hostname if endpoint else "s3.amazonaws.com"
    proxies = urllib.request.getproxies()
    scheme = urllib.parse.urlsplit(endpoint).scheme if endpoint else "https"
    if proxies.get(scheme) and not urllib.request.proxy_bypass(host or ""):
        return f"an {scheme} proxy from the environment"
    return None


def _tls_context(storage_options: dict | None) -> ssl.SSLContext:
    """botocore's TLS choices: `client_kwargs.verify` False (no verification) or a CA bundle path, else
    AWS_CA_BUNDLE, else the system store."""
    verify = ((storage_options or {}).get("client_kwargs") or {}).get("verify")
    if verify is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    cafile = verify if isinstance(verify, str) else os.environ.get("AWS_CA_BUNDLE") or None
    return ssl.create_default_context(cafile=cafile)


def _quote(s: str) -> str:
    return urllib.parse.quote(s, safe="-_.~")


def _host_header(ep: urllib.parse.SplitResult) -> str:
    """The Host header http.client sends (and botocore signs): lowercase, no userinfo, no default port."""
    host = ep.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if ep.port is not None and ep.port != {"http": 80, "https": 443}.get(ep.scheme):
        host = f"{host}:{ep.port}"
    return host


def sigv4_presign(creds: StaticCredentials, path: str, expires_s: int, now: float) -> str:
    """Path-style presigned GET URL for "bucket/key" (AWS Signature Version 4, query-string form)."""
    ep = urllib.parse.urlsplit(creds.endpoint)
    uri = "/".join(_quote(seg) for seg in (ep.path.rstrip("/") + "/" + path.lstrip("/")).split("/"))
    amz_date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    scope = f"{amz_date[:8]}/{creds.region}/s3/aws4_request"
    query = {"X-Amz-Algorithm": "AWS4-HMAC-SHA256", "X-Amz-Credential": f"{creds.key}/{scope}",
             "X-Amz-Date": amz_date, "X-Amz-Expires": str(int(expires_s)), "X-Amz-SignedHeaders": "host"}
    if creds.token:
        query["X-Amz-Security-Token"] = creds.token
    canonical_query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query.items()))
    canonical = "\n".join(["GET", uri, canonical_query, f"host:{_host_header(ep)}\n", "host", "UNSIGNED-PAYLOAD"])
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    k = ("AWS4" + creds.secret).encode()
    for part in (amz_date[:8], creds.region, "s3", "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    sig = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
    return f"{ep.scheme}://{ep.netloc}{uri}?{canonical_query}&X-Amz-Signature={sig}"


def presigned(path: str, storage_options: dict | None, fs_factory: FsFactory, refresh: bool = False) -> str:
    """A presigned GET URL for "bucket/key", cached per process; `refresh` signs again."""
    okey = opts_key(storage_options)
    with _lock:
        hit = _signed.get((okey, path))
        local_ok = okey not in _local_rejected
    if hit is not None and not refresh and hit[1] > time.time() + 600:
        return hit[0]
    creds = static_credentials(storage_options) if local_ok else None
    now = time.time()
    url = sigv4_presign(creds, path, PRESIGN_S, now) if creds else fs_factory().sign(path, expiration=PRESIGN_S)
    with _lock:
        _signed[(okey, path)] = (url, now + PRESIGN_S)
    return url


def _refused(path: str, storage_options: dict | None) -> None:
    """A 403 on a fresh URL: stop signing locally for these options if that is what was used."""
    okey = opts_key(storage_options)
    if static_credentials(storage_options) is not None and okey not in _local_rejected:
        log.info("server refused a locally signed URL for s3://%s; s3fs signs from now on", path)
        with _lock:
            _local_rejected.add(okey)


# ---- connections ------------------------------------------------------------------------------------------
def _connection(parts: urllib.parse.SplitResult, storage_options: dict | None = None) -> http.client.HTTPConnection:
    """This thread's keep-alive connection to the server (never shared across threads or a fork)."""
    pool = getattr(_conns, "pool", None)
    if pool is None or _conns.pid != os.getpid():
        pool, _conns.pid = {}, os.getpid()
        _conns.pool = pool
    key = (parts.scheme, parts.netloc)
    conn = pool.get(key)
    if conn is None:
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname or "", parts.port, context=_tls_context(storage_options))
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port)
        pool[key] = conn
    return conn


AWS_DEFAULT_ENDPOINT = "https://s3.amazonaws.com"
"""Where botocore goes when no endpoint is set (a regional name in practice; the same answer for a probe)."""


def endpoint_url(storage_options: dict | None) -> str | None:
    """The endpoint an S3 request goes to: the options' `endpoint_url`, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
    (botocore reads them too, so this names the same place), else None (AWS's default)."""
    so = storage_options or {}
    return ((so.get("client_kwargs") or {}).get("endpoint_url") or so.get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None)


def endpoint_problem(storage_options: dict | None, timeout_s: float = 5.0) -> tuple[str, bool] | None:
    """(why the endpoint cannot be talked to at all, whether waiting could fix it), or None when a TCP connection
    (and a TLS handshake for https) succeeds, so a failure is the server's answer or its slowness.

    Tells apart what a retry budget cannot: a host name that does not resolve, a TLS handshake with a server that
    speaks plain HTTP, and a refused connection (nothing listens: a wrong port, or a server still starting, the
    one case where waiting helps). Costs one resolve and one connect (~1 ms on loopback), only after a failure.
    A certificate the trust store rejects and a connect that times out are left to the caller (None)."""
    ep = endpoint_url(storage_options)
    if "proxy" in (direct_unsupported(storage_options) or ""):
        return None  # requests go through a proxy: a direct probe would test another path
    parts = urllib.parse.urlsplit(ep or AWS_DEFAULT_ENDPOINT)
    host, https = parts.hostname or "", parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    where = f"the S3 endpoint {ep}" if ep else (f"the default AWS S3 endpoint {AWS_DEFAULT_ENDPOINT} (no endpoint is "
                                                f"set: for another S3 server set AWS_ENDPOINT_URL or "
                                                f"--storage-option endpoint_url=URL)")
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except socket.gaierror as e:
        return (f"{where} names a host that does not resolve ({host}: {e.strerror}): check the host name "
                f"in the endpoint", False)
    except ConnectionRefusedError:
        return (f"connection refused by {where}: nothing listens on {host}:{port}; check the endpoint's port "
                f"(or start the server)", True)
    except OSError:
        return None  # a timeout or an unreachable network: the retry budget decides
    with sock:
        if not https:
            return None
        try:
            _tls_context(storage_options).wrap_socket(sock, server_hostname=host).close()
        except ssl.SSLCertVerificationError:
            return None
        except (ssl.SSLError, ConnectionResetError) as e:
            return (f"TLS handshake with {where} failed ({getattr(e, 'reason', None) or e}): the server on "
                    f"{host}:{port} does not speak https; use http://{parts.netloc} if it serves plain HTTP, or "
                    f"check the port", False)
    return None


def _drop(parts: urllib.parse.SplitResult, conn: http.client.HTTPConnection) -> None:
    """Close `conn`; forget it only if it is this thread's (a generator closed from another thread must not drop
    that thread's connection)."""
    pool = getattr(_conns, "pool", {})
    if pool.get((parts.scheme, parts.netloc)) is conn:
        del pool[(parts.scheme, parts.netloc)]
    conn.close()


Pins = dict
"""bucket/key -> the ETag of the first answer: every later GET of the object through the same dict sends If-Match
(one per reader of a dataset, so a run reads one version of each shard; a new reader may read a new version)."""


def _get(path: str, storage_options: dict | None, fs_factory: FsFactory, range_value: str, clock: ProgressClock,
         pins: Pins):
    """(parts, conn, response) of a GET with `Range: range_value`, pinned to the version `pins` first saw.

    A 412 (or, from a server that ignores If-Match, an answer with another ETag) raises ObjectChanged. Cost: one
    dict look-up and a ~60-byte header per request."""
    with _lock:
        etag = pins.get(path)
    parts, conn, resp = _get_once(path, storage_options, fs_factory, range_value, clock, etag)
    got = resp.getheader("ETag")
    if resp.status == 412 or (etag is not None and got is not None and got != etag and resp.status in (200, 206)):
        resp.read(2048)
        _drop(parts, conn)
        clock.unwatch()
        raise ObjectChanged(f"s3://{path} {range_value}: the object was replaced while it was being read (ETag "
                            f"{etag} first, now {got if resp.status != 412 else 'another: HTTP 412'}); its bytes "
                            "would mix two versions")
    if etag is None and got is not None and resp.status in (200, 206):
        with _lock:
            pins.setdefault(path, got)
    return parts, conn, resp


def _get_once(path: str, storage_options: dict | None, fs_factory: FsFactory, range_value: str,
              clock: ProgressClock, etag: str | None):
    """(parts, conn, response) of a GET with `Range: range_value` (and `If-Match: etag` when pinned); handles
    stale keep-alive and refused URLs.

    Runs under `clock`: connecting may take the time left, then the request is watched (the watchdog cuts it at
    the deadline) until the caller's `clock.unwatch()`; a cut raises TimeoutError naming stall or trickle.
    A 403 (or a 400, which a wrong region gives) is answered by signing again (the cached URL may have expired);
    a second one on a fresh URL makes local signing stop for these options (`_refused`) and s3fs signs the last
    try. A third is returned.
    """
    resigns, reconnected = 0, False
    while True:
        parts = urllib.parse.urlsplit(presigned(path, storage_options, fs_factory, refresh=resigns > 0))
        conn = _connection(parts, storage_options)
        reused = conn.sock is not None
        try:
            if not reused:
                clock.phase = "connect"
                conn.timeout = max(0.05, min(clock.remaining(), clock.budget_s))
                conn.connect()
            conn.sock.settimeout(clock.budget_s)  # a fallback only: the watchdog enforces the deadline
            clock.phase = "answer"
            clock.watch(conn)
            conn.response_class = functools.partial(_ClockedResponse, clock=clock)  # type: ignore[assignment]
            headers = {"Range": range_value} if etag is None else {"Range": range_value, "If-Match": etag}
            conn.request("GET", f"{parts.path}?{parts.query}", headers=headers)
            resp = conn.getresponse()
            _raise_if_expired(clock, ConnectionError("cut by the watchdog"))  # headers cut short look complete
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
            _drop(parts, conn)
            _raise_if_expired(clock, e)
            if reused and not reconnected:  # the server closed an idle keep-alive connection: reconnect at once
                reconnected = True
                continue
            clock.unwatch()
            raise
        except BaseException as e:
            _drop(parts, conn)
            _raise_if_expired(clock, e)
            clock.unwatch()
            raise
        if resp.status in (400, 403) and resigns < 2:
            body = resp.read()
            if resp.status == 400 and not _SIGNING_400.search(body):  # a bad request, not a bad signature
                _drop(parts, conn)
                clock.unwatch()
                raise HTTPStatusError(f"s3://{path} {range_value}: HTTP 400 {resp.reason}: "
                                      f"{_error_text(body.decode('utf-8', 'replace'))}", 400)
            if resigns == 1:
                _refused(path, storage_options)
            resigns += 1
            continue
        return parts, conn, resp


class _ClockedIO(io.RawIOBase):
    """The socket's reader, telling the clock every byte that arrives (status line and headers included, so a
    trickle of headers is told from silence). One Python call per recv, like socket.SocketIO itself."""

    def __init__(self, raw: Any, clock: ProgressClock):
        super().__init__()
        self.raw, self.clock = raw, clock

    def readinto(self, b) -> int:
        n = self.raw.readinto(b)
        if n:
            self.clock.got(n)
        return n

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.raw.close()
        super().close()


class _ClockedResponse(http.client.HTTPResponse):
    """An HTTPResponse whose socket reads go through `_ClockedIO` (set per request as the connection's
    response_class)."""

    def __init__(self, sock, debuglevel: int = 0, method: str | None = None, url: str | None = None, *,
                 clock: ProgressClock):
        super().__init__(sock, debuglevel, method, url)
        self.fp = io.BufferedReader(_ClockedIO(self.fp.detach(), clock))


def _raise_if_expired(clock: ProgressClock, e: BaseException) -> None:
    """After the watchdog cut a request: a TimeoutError that says why (stall or trickle), not a reset."""
    if clock.expired:
        clock.unwatch()
        raise TimeoutError(clock.describe()) from e


_SIGNING_400 = re.compile(rb"AuthorizationHeaderMalformed|AuthorizationQueryParametersError|region", re.I)
"""A 400 body that blames the signature (S3 answers a URL signed for the wrong region this way)."""


def _raise_status(path: str, what: str, parts, conn, resp) -> None:
    body = resp.read(2048).decode("utf-8", "replace")
    _drop(parts, conn)
    msg = f"s3://{path} {what}: HTTP {resp.status} {resp.reason}: {_error_text(body)}"
    if resp.status == 404:
        raise FileNotFoundError(msg)
    if resp.status == 403:
        raise PermissionError(msg)
    if 300 <= resp.status < 400:
        from shardtrain.storage.redact import redact_url

        where = urllib.parse.urlsplit(resp.getheader("Location") or "")
        there = "another host" if where.netloc and where.netloc != parts.netloc else "elsewhere"
        raise HTTPStatusError(f"s3://{path}: the endpoint redirected to {there} ({resp.status}, Location "
                              f"{redact_url(resp.getheader('Location') or '-')}); not followed, so no signed "
                              f"request leaves the configured endpoint: set the endpoint to the final host",
                              resp.status)
    raise HTTPStatusError(msg, resp.status)


def _error_text(body: str) -> str:
    """One line from an S3 error body: "Code: Message" from the XML, else the body's first 300 characters."""
    code, message = (re.search(f"<{t}>(.*?)</{t}>", body, re.S) for t in ("Code", "Message"))
    if code:
        return f"{code.group(1)}: {message.group(1) if message else ''}".strip()
    return " ".join(body.split())[:300]


# ---- reads ------------------------------------------------------------------------------------------------
def iter_range(path: str, storage_options: dict | None, fs_factory: FsFactory, start: int,
               stop: int | None, clock: ProgressClock | None = None, pins: Pins | None = None) -> Iterator[bytes]:
    """Bytes [start, stop) of "bucket/key" (to the end when `stop` is None) by one ranged GET, as they arrive.

    Yields nothing when the object ends at or before `start` (416), fewer bytes when it ends before `stop`.
    `clock` (default: HTTP_TIMEOUT_S without progress) bounds every wait; the time the consumer holds a piece
    is not counted. `pins` (the caller's, shared by its retries and later reads) holds the object to the version
    first read: another version raises ObjectChanged.
    """
    clock = clock or ProgressClock(f"s3://{path}", HTTP_TIMEOUT_S)
    rng = f"bytes={start}-" if stop is None else f"bytes={start}-{stop - 1}"
    parts, conn, resp = _get(path, storage_options, fs_factory, rng, clock, {} if pins is None else pins)
    try:
        if resp.status == 416:
            resp.read()
            clock.done()
            return
        if resp.status != 206 and not (resp.status == 200 and start == 0):
            _raise_status(path, rng, parts, conn, resp)
        if resp.status == 206:
            _check_content_range(path, rng, resp.getheader("Content-Range"), start, stop)
        clock.phase = "body"
        left = resp.length if stop is None or resp.length is None else min(resp.length, stop - start)
        while left is None or left > 0:  # read1: what the socket has, so a cut loses no byte already received
            piece = resp.read1(SUB_PIECE if left is None else min(SUB_PIECE, left))
            if not piece:
                break
            if left is not None:
                left -= len(piece)
            held = clock.hold()
            yield piece
            clock.resume(held)
        _raise_if_expired(clock, ConnectionError("cut by the watchdog"))
        if resp.length:  # bytes announced but not read: cut short, or a 200 with more than we need
            _drop(parts, conn)
            if left:
                raise ConnectionError(f"s3://{path}: connection closed {left} bytes before the end of {rng}")
        else:
            resp.read()  # marks the response done (read1 does not) so the keep-alive connection takes the next GET
        clock.done()
    except BaseException as e:
        _drop(parts, conn)
        if not isinstance(e, GeneratorExit):
            _raise_if_expired(clock, e)
        raise
    finally:
        clock.unwatch()


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def _check_content_range(path: str, rng: str, header: str | None, start: int, stop: int | None) -> None:
    """Refuse a 206 that holds other bytes than those asked for: from `start` to `stop` or the object's end.

    Why: the caller places the bytes at `start` and takes a short answer for the object's end, so a server (or a
    cache in front of it) that answers a block-aligned or capped range would have its bytes stitched in at the
    wrong offset, or the object cut short, silently. Not transient (HTTPStatusError 206): the same server answers
    the same way again. Cost: one regex per request."""
    m = _CONTENT_RANGE.match(header or "")
    if m is None:
        raise HTTPStatusError(f"s3://{path} {rng}: HTTP 206 without a usable Content-Range ({header!r}); the "
                              "bytes cannot be placed", 206)
    first, last = int(m.group(1)), int(m.group(2))
    total = None if m.group(3) == "*" else int(m.group(3))
    end = stop if total is None else total if stop is None else min(stop, total)
    if first != start or end is None or last != end - 1:
        raise HTTPStatusError(f"s3://{path} {rng}: the server answered bytes {first}-{last}/{m.group(3)}, not the "
                              "range asked for; refusing bytes that would be placed at the wrong offset or taken "
                              "for the object's end (a proxy or cache rewriting ranges?)", 206)


def read_tail(path: str, storage_options: dict | None, fs_factory: FsFactory, n: int,
              clock: ProgressClock | None = None, pins: Pins | None = None) -> tuple[bytes, int]:
    """(last `n` bytes, object size) in one request: how a Parquet reader starts (the footer is at the end)."""
    clock = clock or ProgressClock(f"s3://{path}", HTTP_TIMEOUT_S)
    parts, conn, resp = _get(path, storage_options, fs_factory, f"bytes=-{n}", clock, {} if pins is None else pins)
    try:
        if resp.status == 416:  # an empty object
            resp.read()
            return b"", 0
        if resp.status not in (200, 206):
            _raise_status(path, f"last {n} bytes", parts, conn, resp)
        clock.phase = "body"
        data = resp.read()
        _raise_if_expired(clock, ConnectionError("cut by the watchdog"))
        clock.done()
    except BaseException as e:
        _drop(parts, conn)
        _raise_if_expired(clock, e)
        raise
    finally:
        clock.unwatch()
    if resp.status == 200:
        return data[-n:], len(data)
    m = _CONTENT_RANGE.match(resp.getheader("Content-Range", ""))
    if m is None or m.group(3) == "*":
        raise OSError(f"s3://{path}: 206 without a usable Content-Range")
    total = int(m.group(3))
    if int(m.group(2)) != total - 1 or int(m.group(1)) != max(0, total - n) or len(data) != total - int(m.group(1)):
        raise HTTPStatusError(f"s3://{path} last {n} bytes: the server answered bytes {m.group(1)}-{m.group(2)}/"
                              f"{total} with {len(data)} bytes, not the object's tail; refusing a footer read at "
                              "the wrong offset", 206)
    return data, total


class RangeFile(io.RawIOBase):
    """Read-only seekable file over ranged GETs with a one-block cache: enough for pyarrow to read a Parquet
    footer and the projected column chunks only (a few requests, not the whole object)."""

    def __init__(self, path: str, storage_options: dict | None, fs_factory: FsFactory, read_block: Callable,
                 block_bytes: int = 1 << 20, clock: ProgressClock | None = None, pins: Pins | None = None):
        """`read_block(a, b)` should read through the same `pins`, so footer and column chunks are one version."""
        super().__init__()
        self._read_block = read_block
        self.block_bytes = block_bytes
        tail, self.size = read_tail(path, storage_options, fs_factory, block_bytes, clock, pins)
        self._cache = (self.size - len(tail), tail)
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def read(self, size: int = -1) -> bytes:
        end = self.size if size is None or size < 0 else min(self.size, self.pos + size)
        if end <= self.pos:
            return b""
        c0, cdata = self._cache
        if not (c0 <= self.pos and end <= c0 + len(cdata)):
            stop = min(self.size, max(end, self.pos + self.block_bytes))
            self._cache = (self.pos, self._read_block(self.pos, stop))
            c0, cdata = self._cache
        out = cdata[self.pos - c0:end - c0]
        self.pos += len(out)
        return out

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)
