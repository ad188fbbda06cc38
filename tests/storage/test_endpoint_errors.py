"""A wrong S3 endpoint is named in one line within seconds, through the CLI as a user types it: nothing listening
on the port, https against SeaweedFS's plain-HTTP port, a host name that does not resolve (a reserved `.invalid`
name: no query leaves the machine). The retry budget stays for servers that answered and went slow."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardtrain.storage import s3http

ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(endpoint: str, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(PYTHONPATH=str(ROOT), AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_ENDPOINT_URL=endpoint)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "shardtrain", *args], capture_output=True, text=True, env=env,
                       timeout=150)
    return time.monotonic() - t0, p


def _error_line(p: subprocess.CompletedProcess, command: str = "inspect") -> str:
    lines = [x for x in p.stderr.splitlines() if x.startswith(f"{command}: error")]
    assert p.returncode != 0 and len(lines) == 1, p.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.s3
def test_wrong_endpoints_are_named_within_20_s(s3):
    port = _closed_port()
    cases = {
        f"http://127.0.0.1:{port}": ("connection refused", f"127.0.0.1:{port}", "port"),
        s3.endpoint_url.replace("http://", "https://"): ("TLS handshake", "does not speak https",
                                                          s3.endpoint_url),
        "http://no-such-host.invalid:8333": ("does not resolve", "no-such-host.invalid", "host name"),
    }
    for endpoint, words in cases.items():
        took, p = _cli(endpoint, "inspect", "s3://bkt/ds")
        line = _error_line(p)
        assert took < 20 and all(w in line for w in words), (endpoint, took, line)
        assert "stall" not in line and "retry budget" not in line, line


@pytest.mark.slow
def test_pack_to_a_closed_port_is_named_within_20_s(tmp_path):
    """pack's first S3 call is its lock, outside any read's retry loop: the endpoint check covers it too."""
    from shardtrain.testing.corpus import make_corpus

    corpus = make_corpus(tmp_path / "corpus", [0.5, 0.6], seed=0)
    took, p = _cli(f"http://127.0.0.1:{_closed_port()}", "pack", str(corpus), "s3://bkt/ds", "--no-progress")
    line = _error_line(p, "pack")
    assert took < 20 and "connection refused" in line and "Traceback" not in p.stderr, (took, p.stderr[-2000:])


def test_no_endpoint_set_is_named_with_what_to_set(monkeypatch):
    """No endpoint: botocore goes to AWS. The default is pointed at a reserved `.invalid` name (this machine must
    send nothing off loopback), so the probe fails as it does on a machine that cannot reach AWS."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setattr(s3http, "AWS_DEFAULT_ENDPOINT", "https://s3.invalid")
    message, may_start = s3http.endpoint_problem({"key": "k", "secret": "s"})
    assert not may_start and "no endpoint is set" in message and "AWS_ENDPOINT_URL" in message, message
    assert "s3.invalid" in message and "does not resolve" in message


def test_a_listening_endpoint_has_no_problem(s3):
    """The probe only names endpoints it cannot talk to: SeaweedFS's port connects, so the budget decides."""
    assert s3http.endpoint_problem({"client_kwargs": {"endpoint_url": s3.endpoint_url}}) is None
