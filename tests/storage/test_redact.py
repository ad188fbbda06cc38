"""Credentials stay out of help texts, stored files and debug logs (issue 16)."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardtrain import cli
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.storage.redact import RedactingFilter, redact_options, redact_text, redact_url, register_secret
from shardtrain.testing.corpus import make_corpus

ROOT = Path(__file__).resolve().parents[2]


def test_redaction_of_options_urls_and_log_lines():
    opts = {"key": "AKIAEXAMPLEKEY123456", "secret": "wJalrXUtnFEMI", "token": "", "profile": "dev",
            "client_kwargs": {"endpoint_url": "http://u:pw@host:8333/?X-Amz-Signature=abc", "aws_session_token": "T"},
            "default_block_size": 8}
    assert redact_options(opts) == {
        "key": "***", "secret": "***", "token": "", "profile": "dev", "default_block_size": 8,
        "client_kwargs": {"endpoint_url": "http://u:***@host:8333/?X-Amz-Signature=***", "aws_session_token": "***"}}
    assert redact_url("s3://bucket/prefix") == "s3://bucket/prefix"
    # the shapes botocore and s3fs print at DEBUG (botocore.endpoint, botocore.auth, presigned URLs)
    lines = [
        "Sending http request: <AWSPreparedRequest stream_output=False, method=GET, headers={'Authorization': "
        "b'AWS4-HMAC-SHA256 Credential=AKIAEXAMPLEKEY123456/20261201/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;x-amz-date, Signature=" + "ab12" * 16 + "', 'X-Amz-Security-Token': b'FQoGZXIvYXdz'}>",
        "Signature:\n" + "cd34" * 16,
        "GET http://h/b/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAEXAMPLEKEY123456%2F2026&"
        "X-Amz-Signature=" + "ef56" * 16,
    ]
    for line in lines:
        clean = redact_text(line)
        assert "AKIAEXAMPLEKEY123456" not in clean and not re.search(r"[0-9a-f]{32}", clean), clean
        assert "FQoGZXIvYXdz" not in clean
    register_secret("wJalrXUtnFEMI-registered")
    rec = logging.LogRecord("botocore.x", logging.DEBUG, __file__, 1, "creds %s", ("wJalrXUtnFEMI-registered",), None)
    assert RedactingFilter().filter(rec) and rec.getMessage() == "creds ***"


def test_help_steers_credentials_to_environment(capsys):
    for cmd in ("pack", "inspect", "bench", "train"):
        with pytest.raises(SystemExit):
            cli.main([cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "secret=..." not in text and "AWS_SECRET_ACCESS_KEY" in text and "profile" in text, cmd


@pytest.mark.s3
def test_no_credentials_in_manifest_or_verbose_logs(s3, s3_bucket, tmp_path):
    corpus = make_corpus(tmp_path / "c", [0.3, 0.4], seed=1)
    url = f"{s3_bucket}/ds"
    pack(PackConfig(input=str(corpus), output=url, storage_options=s3.storage_options, workers=1, progress=False))
    manifest = s3.fs().cat_file(url.split("://", 1)[1] + "/manifest.json").decode()
    assert s3.secret_key not in manifest and '"key"' not in manifest
    env = {**os.environ, **s3.env, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "shardtrain", "-v", "inspect", url, "--verify", "--no-progress"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    err = p.stderr
    assert "botocore" in err and "Authorization" in err, "debug logging of the S3 client must be on in this test"
    assert s3.secret_key not in err
    assert f"Credential={s3.access_key}" not in err and f"X-Amz-Credential={s3.access_key}" not in err
    assert not re.search(r"Signature[=:]\s*[0-9a-f]{16}", err) and not re.search(r"X-Amz-Signature=[0-9a-f]", err)
    # a secret passed on the command line anyway: warned about, and masked in the log
    p = subprocess.run([sys.executable, "-m", "shardtrain", "-v", "inspect", url, "--storage-option",
                        f"secret={s3.secret_key}", "--storage-option", f"key={s3.access_key}"],
                       env={**env, "AWS_SECRET_ACCESS_KEY": "", "AWS_ACCESS_KEY_ID": ""},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "puts a credential on the command line" in p.stderr
    assert s3.secret_key not in p.stderr.replace("--storage-option secret=...", "")
