"""s3fs requests that never follow an HTTP redirect: signed headers are never sent to another host.

aiobotocore sends every request with aiohttp's default `allow_redirects=True`. aiohttp drops the Authorization
header when a redirect leaves the origin, but not `X-Amz-Security-Token` (a session token is a credential) nor the
other signed headers, and re-sends a PUT's body. An S3 endpoint has no reason to redirect a client to another
host (region redirects are answered with 301 + the region, which botocore handles by re-signing for the same
endpoint), so a redirect is returned to botocore as the error it is. The direct HTTP path (s3http) never follows
redirects either.

`fs_and_path` puts `NoRedirectSession` into s3fs's `config_kwargs` (unless the caller chose a session class).
Imported only when an s3fs filesystem is built. Costs nothing per request.
"""
from __future__ import annotations

from typing import Any

from aiobotocore.httpsession import AIOHTTPSession


class RedirectRefused(PermissionError):
    """The endpoint answered with a redirect (302/303/307/308); it was not followed. Not transient."""


class _NoRedirect:
    """An aiohttp ClientSession whose `request` never follows redirects (everything else delegated).

    A 301 goes back to botocore, which answers S3's region redirects itself (re-signed for the region); any other
    redirect raises RedirectRefused: left to botocore it would be retried in a loop until its recursion limit."""

    __slots__ = ("_session",)

    def __init__(self, session: Any):
        self._session = session

    def request(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["allow_redirects"] = False
        return self._request(*args, **kwargs)

    async def _request(self, method: str, url: Any = None, **kwargs: Any) -> Any:
        resp = await self._session.request(method, url=url, **kwargs)
        if resp.status in (302, 303, 307, 308):
            from shardtrain.storage.redact import redact_url

            location = resp.headers.get("Location", "-")
            resp.release()
            raise RedirectRefused(f"the endpoint redirected {method} to {redact_url(location)} (HTTP {resp.status}); "
                                  f"not followed, so no signed request leaves the configured endpoint: set the "
                                  f"endpoint to the final host")
        return resp

    def __getattr__(self, name: str) -> Any:
        if name == "_session":  # not set yet (a copy made without __init__): no recursion
            raise AttributeError(name)
        return getattr(self._session, name)


class NoRedirectSession(AIOHTTPSession):
    """aiobotocore's aiohttp session with redirects refused (see the module docstring)."""

    async def _get_session(self, proxy_url):  # type: ignore[override]
        return _NoRedirect(await super()._get_session(proxy_url))
