"""Which storage errors a retry can fix, the backoff between tries, and the errors a command reports in one line.

    is_transient(e)          connection refused/reset, timeouts, HTTP 5xx/408/429 -> retry; the rest raises at once
    credentials_error(e)     missing or refused S3 credentials -> CredentialsError naming what to set (never retried:
                             no wait makes a missing key appear); a refusal for this machine's clock (S3's
                             RequestTimeTooSkewed, or a 403 whose Date header is minutes away) -> ClockSkewError
    Backoff(clock)           jittered exponential waits under one time budget without progress (storage.clock)
    StorageUnavailable       the budget ran out; the message names the URL and the cause (refused, stall, trickle)
    EndpointUnreachable      the endpoint never answered and cannot be talked to (unresolvable host, TLS against
                             plain HTTP, nothing listening): named within FIRST_CONTACT_S, not after the budget
"""
from __future__ import annotations

import email.utils
import http.client
import logging
import random
import re
import ssl
import time
from typing import Callable

from shardtrain.storage import s3http
from shardtrain.storage.clock import ProgressClock, answered

log = logging.getLogger(__name__)

RETRY_BUDGET_S = 120.0
"""Default time a read may go without progress (waiting and retrying alike): long enough to ride out a server
restart or a short network partition; past it the read raises StorageUnavailable (the job stops and can resume)."""

PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    EOFError,
    ssl.SSLCertVerificationError,
)
"""Storage errors that a retry cannot fix (a missing object, refused credentials, a path that is a folder, a
server certificate the trust store rejects)."""
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, http.client.HTTPException)
"""Network errors worth retrying: refused/reset/aborted connections, timeouts, a response cut short."""
FIRST_CONTACT_S = 2.0
"""Before any read in the process got an answer, the time a read waits for a refused endpoint to start listening.
A wrong endpoint is then named within ~2 s of the read's start; the full budget is for servers that answered once
and went slow or away."""
FIRST_CALL_S = 3.0
"""The most one call may take while the endpoint is unproven: botocore and s3fs retry a refused or unresolvable
endpoint inside one call for ~9 s before the probe can say why. A server slower than this to its first answer
costs one cut request, then the probe finds it connects and the full budget applies."""
_NETWORK_MODULES = ("aiohttp", "botocore", "aiobotocore", "urllib3", "s3fs")
_jitter = random.Random()  # not data: backoff jitter only, so concurrent readers do not retry in lockstep

CREDENTIALS_HELP = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a non-AWS "
                    "endpoint), or AWS_PROFILE / --storage-option profile=NAME")
_MISSING = ("NoCredentialsError", "PartialCredentialsError", "ProfileNotFound", "CredentialRetrievalError",
            "NoAuthTokenError", "UnauthorizedSSOTokenError", "SSOTokenLoadError", "InvalidConfigError")
_REFUSED = re.compile(r"\b(InvalidAccessKeyId|SignatureDoesNotMatch|InvalidToken|ExpiredToken|TokenRefreshRequired|"
                      r"InvalidClientTokenId|AccessDenied|AuthorizationHeaderMalformed)\b")


class StorageUnavailable(OSError):
    """No progress for the whole time budget: the storage is down, unreachable, silent or trickling."""

    def __init__(self, message: str, url: str = ""):
        super().__init__(message)
        self.url = url


CLOCK_HELP = ("sync this machine's clock (NTP: `timedatectl set-ntp true`, chrony or ntpd); S3 refuses requests "
              "signed more than 15 minutes away from its own time")
SKEW_TOLERANCE_S = 300.0
"""A 403 whose Date header is this far from the local clock is blamed on the clock, not the keys (S3 allows 15 min;
a refusal from a server 5+ minutes away is that, whatever the body did not say)."""


class EndpointUnreachable(StorageUnavailable):
    """The storage endpoint cannot be talked to at all (s3http.endpoint_problem): a wrong endpoint, not a slow one."""


class CredentialsError(PermissionError):
    """S3 credentials are missing or the server refused them: one line naming what to set; never retried."""


class ClockSkewError(CredentialsError):
    """The server refused a request because this machine's clock is off: keys are fine, the clock must change."""


def _server_skew_s(e: BaseException) -> float | None:
    """Local clock minus the server's (its Date header, on a botocore ClientError), or None when not known."""
    resp = getattr(e, "response", None)
    headers = (resp.get("ResponseMetadata") or {}).get("HTTPHeaders") or {} if isinstance(resp, dict) else {}
    try:
        return time.time() - email.utils.parsedate_to_datetime(headers["date"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return None


def _clock_skew_error(err: BaseException, code: str | None, where: str) -> ClockSkewError | None:
    skew = _server_skew_s(err)
    named = code == "RequestTimeTooSkewed" or "RequestTimeTooSkewed" in str(err)
    if not named and not (code in ("403", "Forbidden", "AccessDenied", "SignatureDoesNotMatch")
                          and skew is not None and abs(skew) > SKEW_TOLERANCE_S):
        return None
    how = "" if skew is None else (f" by {abs(skew) / 60:.0f} min ({'behind' if skew < 0 else 'ahead of'} the "
                                   f"server's Date header, {time.strftime('%H:%M:%S', time.gmtime(time.time() - skew))}"
                                   f" UTC; here {time.strftime('%H:%M:%S', time.gmtime())} UTC)")
    reason = "RequestTimeTooSkewed" if named else "HTTP 403" + (f" {code}" if code not in ("403", "Forbidden") else "")
    return ClockSkewError(f"{where}the server refused the request because this machine's clock is off{how}, not "
                          f"the keys ({reason}): {CLOCK_HELP}")


def _chain(e: BaseException):
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        wrapped = (getattr(e, "kwargs", None) or {}).get("error")  # botocore's HTTPClientError(error=...)
        wrapped = wrapped if isinstance(wrapped, BaseException) else None
        e = e.__cause__ or wrapped or e.__context__  # type: ignore[assignment]


def credentials_error(e: BaseException, url: str = "") -> CredentialsError | None:
    """`e` (or what it was raised from) as a CredentialsError when it is about credentials, else None.

    Missing: botocore's NoCredentialsError and kin (no keys in the options, the environment or a profile).
    Refused: an S3 error code that blames the keys (InvalidAccessKeyId, SignatureDoesNotMatch, expired or invalid
    token, AccessDenied), from s3http's 403 or a botocore ClientError that s3fs wrapped."""
    where = f"{url}: " if url else ""
    for err in _chain(e):
        if isinstance(err, CredentialsError):
            return err
        name = type(err).__name__
        if name in _MISSING:
            return CredentialsError(f"{where}no usable S3 credentials ({name}: {err}); {CREDENTIALS_HELP}")
        code = _error_code(err)
        skewed = _clock_skew_error(err, code, where)
        if skewed is not None:
            return skewed
        if code in ("403", "Forbidden"):  # a HEAD has no body to say why: bad keys or a policy, both refusals
            return CredentialsError(f"{where}the server refused access (HTTP 403, no reason given): the S3 "
                                    f"credentials are wrong or expired, or not allowed here (check the bucket "
                                    f"policy); {CREDENTIALS_HELP} with keys this endpoint accepts")
        if code and _REFUSED.fullmatch(code) or (isinstance(err, PermissionError) and _REFUSED.search(str(err))):
            code = code or _REFUSED.search(str(err)).group(1)  # type: ignore[union-attr]
            what = ("the server denied access (AccessDenied): check the bucket policy, or"
                    if code == "AccessDenied" else f"the server refused the S3 credentials ({code}):")
            return CredentialsError(f"{where}{what} {CREDENTIALS_HELP} with keys this endpoint accepts")
    return None


def refused_redirect(e: BaseException, url: str = "") -> OSError | None:
    """storage.noredirect's RedirectRefused from inside botocore's HTTPClientError, as an OSError naming `url`."""
    for err in _chain(e):
        if type(err).__name__ == "RedirectRefused":
            return PermissionError(f"{url}: {err}" if url else str(err))
    return None


def _error_code(e: BaseException) -> str | None:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        code = (resp.get("Error") or {}).get("Code")
        return str(code) if code else None
    return None


def is_transient(e: BaseException) -> bool:
    """True for errors a retry can fix; False for hopeless ones (missing object, credentials) and bugs.

    HTTP statuses come from s3http (5xx, 408, 429 transient) or botocore (the same rule on its status code); other
    OSErrors (s3fs maps unknown S3 errors to OSError(EIO)) count as transient, everything else (TypeError,
    KeyError, ...) is a bug and never retried."""
    if isinstance(e, s3http.HTTPStatusError):
        return e.transient
    if isinstance(e, (PERMANENT_ERRORS, StorageUnavailable)) or credentials_error(e) is not None:
        return False
    if refused_redirect(e) is not None:
        return False
    if isinstance(e, TRANSIENT_ERRORS):
        return True
    status = http_status(e)
    if status is not None:
        return status >= 500 or status in (408, 429)
    if type(e).__module__.split(".")[0] in _NETWORK_MODULES:
        return True
    return isinstance(e, OSError)


def http_status(e: BaseException) -> int | None:
    """The HTTP status of a botocore ClientError (also when s3fs chained it), else None."""
    for err in (e, e.__cause__):
        resp = getattr(err, "response", None)
        if isinstance(resp, dict):
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
    return None


class Backoff:
    """Jittered exponential backoff for one read, under its clock's budget of time without progress.

    Each wait is uniform in [0.5, 1] x min(max_backoff_s, backoff_s * 2**k) (k failures in a row since the last
    progress), never past the deadline, so an outage costs at most ~max_backoff_s after the server is back.
    `retries` (None: no limit) also caps the failures in a row.

    `probe` (s3http.endpoint_problem for S3 reads) runs after a failure while no read in the process has had an
    answer yet: an endpoint that cannot be reached raises EndpointUnreachable at once (a refused one after
    FIRST_CONTACT_S), so a wrong endpoint costs seconds, not the budget."""

    def __init__(self, url: str, *, budget_s: float = RETRY_BUDGET_S, retries: int | None = None,
                 backoff_s: float = 0.2, max_backoff_s: float = 5.0, clock: ProgressClock | None = None,
                 probe: Callable[[], tuple[str, bool] | None] | None = None):
        self.url, self.budget_s, self.retries = str(url), budget_s, retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.clock = clock or ProgressClock(self.url, budget_s)
        self.failures, self._mark = 0, self.clock.mark
        self.probe, self._started = probe, time.monotonic()

    def call_budget(self) -> float:
        """Time the next call may take: what is left of the budget, and at most FIRST_CALL_S while the endpoint is
        unproven (a probe pending and no answer yet in this process)."""
        left = self.clock.remaining()
        return min(left, FIRST_CALL_S) if self.probe is not None and not answered() else left

    def _check_endpoint(self, e: BaseException) -> None:
        if self.probe is None or answered():
            return
        problem = self.probe()
        if problem is None:  # the endpoint connects: a slow or failing server, which the budget is for
            self.probe = None
            return
        message, may_start = problem
        if may_start and time.monotonic() - self._started + self.call_budget() < FIRST_CONTACT_S:
            return  # another try ends inside the window: the server may be starting
        raise EndpointUnreachable(f"reading {self.url}: {message}", self.url) from e

    def wait(self, e: BaseException, where: str) -> None:
        """Sleep before the next try after transient error `e`, or raise StorageUnavailable when out of budget."""
        clock = self.clock
        clock.last_error = e
        self._check_endpoint(e)
        if clock.mark != self._mark:  # bytes arrived since the last failure: a new streak
            self.failures, self._mark = 0, clock.mark
        self.failures += 1
        left = clock.remaining()
        if (self.retries is not None and self.failures > self.retries) or left <= 0:
            tries = f"{self.failures} tries" if self.retries is None else f"{self.retries} retries"
            why = clock.describe() if left <= 0 else f"{type(e).__name__}: {e}"
            raise StorageUnavailable(
                f"reading {self.url} {where} failed after {tries} over {self.budget_s - max(left, 0):.0f} s without "
                f"progress (retry budget {self.budget_s:g} s): {why}; check that the storage endpoint is up and "
                f"reachable, or raise stream.retry_budget_s to wait longer", self.url) from e
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (self.failures - 1)) * _jitter.uniform(0.5, 1.0)
        delay = max(0.0, min(delay, left))
        log.warning("read %s %s failed (%s); retry %d in %.2fs (%.0f of %g s budget left)",
                    self.url, where, str(e) or type(e).__name__, self.failures, delay, left, self.budget_s)
        time.sleep(delay)
