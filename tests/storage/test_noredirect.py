"""storage/noredirect.py: a real aiohttp session (the one s3fs requests go through) against a real HTTP server on
loopback: a 307 to another host is refused with the host named and never requested, a 301 goes back to botocore
unfollowed, a 200 passes (s3fs against a redirecting SeaweedFS: tests/integration/test_trust_net_s3.py)."""
from __future__ import annotations

import asyncio
import http.server
import threading

import aiohttp
import pytest

from shardtrain.storage.noredirect import NoRedirectSession, RedirectRefused, _NoRedirect


class Handler(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self):
        Handler.seen.append(self.path)
        status = {"/307": 307, "/301": 301, "/302": 302}.get(self.path, 200)
        self.send_response(status)
        if status != 200:
            self.send_header("Location", f"http://other.invalid/elsewhere?X-Amz-Signature=secret{self.path}")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


async def get(url: str):
    async with aiohttp.ClientSession() as s:
        resp = await _NoRedirect(s).request("GET", url)
        status = resp.status
        resp.release()
        return status


def test_redirects_refused_or_returned_and_200_passes(server):
    Handler.seen.clear()
    assert asyncio.run(get(f"{server}/ok")) == 200
    assert asyncio.run(get(f"{server}/301")) == 301  # botocore handles S3's region redirects itself
    for path in ("/307", "/302"):
        with pytest.raises(RedirectRefused) as e:
            asyncio.run(get(f"{server}{path}"))
        assert "redirected GET to http://other.invalid/elsewhere" in str(e.value) and "secret" not in str(e.value)
        assert f"HTTP {path[1:]}" in str(e.value)
    assert Handler.seen == ["/ok", "/301", "/307", "/302"]  # nothing followed


def test_s3_filesystems_get_the_session_unless_the_caller_chose_one(server):
    from shardtrain import storage

    fs, _ = storage.fs_and_path("s3://bucket/key", {"endpoint_url": server, "key": "k", "secret": "s"})
    assert fs.config_kwargs["http_session_cls"] is NoRedirectSession and issubclass(RedirectRefused, PermissionError)
    mine = type("Mine", (NoRedirectSession,), {})
    fs, _ = storage.fs_and_path("s3://bucket/key", {"endpoint_url": server, "key": "k", "secret": "s",
                                                    "config_kwargs": {"http_session_cls": mine}})
    assert fs.config_kwargs["http_session_cls"] is mine
