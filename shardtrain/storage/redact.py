"""Credentials never reach logs or stored files: secret-looking options and log lines are redacted.

    redact_options({"key": "AKIA..", "client_kwargs": {...}}) -> {"key": "***", "client_kwargs": {...}}
    redact_url("https://user:pw@host/x?token=abc")            -> "https://user:***@host/x?token=***"
    RedactingFilter (on the log handlers, cli.init_logging)  -> botocore/s3fs debug lines without access key
                                                                ids, signatures, tokens or registered secrets
    StorageOptions({...})                                     -> a dict whose repr/str mask secrets, so any object
                                                                holding it (configs, locks, datasets) prints clean

Why a handler filter: with `-v`, botocore logs request headers (`Authorization: AWS4-HMAC-SHA256
Credential=<access key id>/..., Signature=<hex>`), presigned URLs (`X-Amz-Credential=...&X-Amz-Signature=...`)
and the signature itself (`Signature:\\n<hex>`). A filter on the handlers sees every record that is printed,
whichever library logged it. Costs one regex pass per printed record (none for records below the level).
"""
from __future__ import annotations

import logging
import re
import threading
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
SECRET_NAME_RE = re.compile(r"secret|token|passw|pwd|key|credential|signature|auth|session|cookie", re.I)
"""Option/parameter names whose values are treated as secrets (`key` covers s3fs's access key id)."""

_PATTERNS = [
    # Authorization header: Credential=<key id>/<date>/..., Signature=<hex>
    (re.compile(r"(Credential=)[^\s,'\"&/]+"), r"\1" + MASK),
    (re.compile(r"(Signature\s*[=:]\s*)[0-9a-fA-F]{16,}"), r"\1" + MASK),
    (re.compile(r"((?:X-Amz-(?:Signature|Credential|Security-Token))=)[^\s&'\"]+", re.I), r"\1" + MASK),
    (re.compile(r"((?:x-amz-security-token|authorization)['\"]?\s*[:=]\s*b?['\"])[^'\"]+", re.I), r"\1" + MASK),
    (re.compile(r"((?:aws_secret_access_key|aws_access_key_id|aws_session_token|secret|token|password)"
                r"['\"]?\s*[:=]\s*['\"])[^'\"]+", re.I), r"\1" + MASK),
]
_secrets: set[str] = set()
_lock = threading.Lock()


def register_secret(value: object, min_len: int = 4) -> None:
    """Mask this exact value wherever a log line would show it. Values under `min_len` characters are ignored:
    masking them would garble ordinary text (access key ids are registered with min_len=12: real ones have 20)."""
    if isinstance(value, str) and len(value) >= min_len:
        with _lock:
            _secrets.add(value)


def redact_options(options: object) -> object:
    """A copy of storage options (nested dicts/lists) with secret-looking values replaced by `***`, for logs and
    anything stored (manifests, configs)."""
    if isinstance(options, dict):
        return {k: (MASK if isinstance(k, str) and SECRET_NAME_RE.search(k) and v not in (None, "")
                    else redact_options(v)) for k, v in options.items()}
    if isinstance(options, (list, tuple)):
        return type(options)(redact_options(v) for v in options)
    return redact_url(options) if isinstance(options, str) and "://" in options else options


def redact_url(url: str) -> str:
    """`url` with a password in its userinfo and secret-looking query parameters replaced by `***`."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        netloc = (user.split(":", 1)[0] + ":" + MASK if ":" in user else user) + "@" + host
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, MASK if SECRET_NAME_RE.search(k) else v) for k, v in pairs], safe="*")
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def register_options(options: object) -> None:
    """Register every secret-looking value in storage options (nested) with `register_secret`."""
    if isinstance(options, dict):
        for k, v in options.items():
            if isinstance(k, str) and SECRET_NAME_RE.search(k) and isinstance(v, str):
                register_secret(v, 12 if k.lower() in ("key", "aws_access_key_id", "access_key") else 4)
            else:
                register_options(v)


def redact_text(text: str) -> str:
    """Credentials in free text (a formatted log line) replaced by `***`."""
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    with _lock:
        secrets = sorted(_secrets, key=len, reverse=True)
    for s in secrets:
        if s in text:
            text = text.replace(s, MASK)
    return text


class StorageOptions(dict):
    """Storage options whose repr and str mask secret-looking values (`redact_options`); otherwise a plain dict.

    Why: configs, locks and datasets hold the options, and a dataclass or an error message that shows its fields
    would print the keys. Only the top level is wrapped: `**options` unpacks to a plain dict, so fsspec's instance
    cache (which tokenizes the repr of its kwargs' values) and s3fs see the real values. Costs nothing on use.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(redact_options(dict(self)))

    __str__ = __repr__

    def __reduce__(self):  # pickles (to workers) as itself, with the real values
        return (StorageOptions, (dict(self),))


class RedactingFilter(logging.Filter):
    """Logging filter that rewrites each record's message through `redact_text` (never drops a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is left to the handler's own error path
            return True
        clean = redact_text(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        return True
