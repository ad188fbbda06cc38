"""A fault-injecting TCP proxy on loopback: the network failures a real server will not produce on demand.

`FaultProxy` answers per request with the faults a slow or hostile server shows (silence, trickle, 503
SlowDown, a held upload, a redirect to another host; `RecordingServer` plays that host).

`DropProxy` sits between a client and a server and cuts the first N connections that carry more than a given
number of bytes server->client, abruptly (RST), the way a flaky network or a load balancer resets a long
download. Loader tests use it to check retry-and-resume of a shard read.

    with LocalS3() as s3, DropProxy("127.0.0.1", s3.port, drop_after_bytes=1 << 20) as proxy:
        fs = s3fs.S3FileSystem(**s3.storage_options_for(proxy.endpoint_url))
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time

log = logging.getLogger(__name__)


class DropProxy:
    """Threaded TCP proxy on 127.0.0.1 that resets the first `drops` connections carrying more than
    `drop_after_bytes` server->client, after exactly that many bytes; later connections pass untouched.

    The reset uses SO_LINGER 0, so the client sees ECONNRESET / a truncated body, as with a real network fault.
    Byte counts are per TCP connection (HTTP keep-alive connections accumulate across requests).
    """

    def __init__(self, target_host: str, target_port: int, drop_after_bytes: int, drops: int = 1,
                 on_drop=None) -> None:
        """`on_drop(n)`, when given, runs in the proxy before the n-th cut reaches the client (a test replaces the
        object there, so the client's retry meets the new version deterministically)."""
        if drop_after_bytes < 0 or drops < 0:
            raise ValueError("drop_after_bytes and drops must be >= 0")
        self.on_drop = on_drop
        self.target = (target_host, target_port)
        self.drop_after_bytes = drop_after_bytes
        self.drops = drops
        self.drops_done = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._accept_thread = threading.Thread(target=self._accept_loop, name="DropProxy-accept", daemon=True)
        self._accept_thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError as e:
                log.warning("DropProxy: cannot reach %s:%d: %s", *self.target, e)
                client.close()
                continue
            with self._lock:
                self.connections += 1
                self._socks.update((client, upstream))
            self._threads = [t for t in self._threads if t.is_alive()]
            state = {"budget": self.drop_after_bytes, "armed": True, "live": 2}
            for src, dst, down in ((client, upstream, False), (upstream, client, True)):
                t = threading.Thread(target=self._pump, args=(src, dst, down, state, client, upstream), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src, dst, down: bool, state: dict, client, upstream) -> None:
        try:
            self._forward(src, dst, down, state, client, upstream)
        finally:
            with self._lock:
                state["live"] -= 1
                last = state["live"] == 0
            if last:  # both directions finished: release the sockets
                for s in (client, upstream):
                    s.close()
                    with self._lock:
                        self._socks.discard(s)

    def _forward(self, src, dst, down: bool, state: dict, client, upstream) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if down and state["armed"] and len(data) > state["budget"]:
                    with self._lock:
                        cut = self.drops_done < self.drops
                        if cut:
                            self.drops_done += 1
                    state["armed"] = False
                    if cut:
                        dst.sendall(data[: state["budget"]])
                        if self.on_drop is not None:
                            self.on_drop(self.drops_done)
                        self._reset(client, upstream)
                        return
                elif down and state["armed"]:
                    state["budget"] -= len(data)
                dst.sendall(data)
        except OSError:
            self._reset(client, upstream)

    def _reset(self, client: socket.socket, upstream: socket.socket) -> None:
        for s in (client, upstream):
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                # SHUT_RD wakes the other pump thread blocked in recv() on this socket without sending a FIN;
                # only then does close() really release the socket and send the RST.
                s.shutdown(socket.SHUT_RD)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass
            with self._lock:
                self._socks.discard(s)

    def close(self) -> None:
        """Stop accepting and close every open connection. shutdown() first: close() alone does not wake a
        thread blocked in accept()/recv() on the same socket."""
        self._closed.set()
        with self._lock:
            _shutdown_all([self._listener, *self._socks])
        self._accept_thread.join(timeout=2)
        for t in self._threads:
            t.join(timeout=2)

    def __enter__(self) -> "DropProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


FAULTS = ("pass", "silence", "trickle", "slowdown", "hold_upload", "redirect")
"""What FaultProxy does to each request (see FaultProxy)."""


class FaultProxy:
    """HTTP-aware fault proxy on 127.0.0.1: reads each request's head, then applies the fault armed at that moment.

    - `pass`: forward untouched.
    - `silence`: accept the connection, read the request, never answer (a hung server or a black-holed LB).
    - `trickle`: forward, but send the answer back at `trickle_bps` bytes/s after its first `trickle_after` bytes.
    - `slowdown`: answer `503 SlowDown` (S3's throttling reply) without reaching the server.
    - `hold_upload`: a PUT/POST's head goes on at once, its body only after `hold_s` seconds (a stuck upload).
    - `redirect`: answer `307` to the same path and query on `redirect_to` (another host: see RecordingServer).

    `arm(fault, for_s=None, **params)` sets the fault for new requests (for `for_s` seconds, then `pass`). Every
    request is forwarded with `Connection: close` (not a signed header), so each one meets the fault armed when it
    arrives; `requests` counts them per fault.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.fault, self.until = "pass", float("inf")
        self.trickle_bps, self.trickle_after, self.hold_s, self.redirect_to = 1.0, 0, 0.0, ""
        self.requests: dict[str, int] = {f: 0 for f in FAULTS}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._socks: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept_loop, name="FaultProxy-accept", daemon=True).start()

    def arm(self, fault: str, for_s: float | None = None, **params) -> "FaultProxy":
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, not {fault!r}")
        for k, v in params.items():
            if not hasattr(self, k) or k in ("fault", "until", "target", "requests"):
                raise ValueError(f"unknown FaultProxy parameter {k!r}")
            setattr(self, k, v)
        self.fault, self.until = fault, (time.monotonic() + for_s if for_s is not None else float("inf"))
        return self

    def _current(self) -> str:
        return self.fault if time.monotonic() < self.until else "pass"

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._socks.add(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        try:
            head, rest = _read_head(client)
            if head is None:
                return
            fault = self._current()
            with self._lock:
                self.requests[fault] += 1
            method, target = head.split(b" ", 2)[:2]
            if fault == "silence":
                self._closed.wait()
                return
            if fault == "slowdown":
                body = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
                        b"<Message>Please reduce your request rate.</Message></Error>")
                client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: "
                               + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
                return
            if fault == "redirect":
                client.sendall(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: " + self.redirect_to.encode()
                               + target + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
            with self._lock:
                self._socks.add(upstream)
            upstream.sendall(_close_after(head))
            if fault == "hold_upload" and method in (b"PUT", b"POST"):
                self._closed.wait(self.hold_s)
            if rest:
                upstream.sendall(rest)
            up = threading.Thread(target=self._copy, args=(client, upstream, 0, 0.0), daemon=True)
            up.start()
            bps = self.trickle_bps if fault == "trickle" else 0.0
            self._copy(upstream, client, self.trickle_after, bps)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass
                    with self._lock:
                        self._socks.discard(s)

    def _copy(self, src: socket.socket, dst: socket.socket, free: int, bps: float) -> None:
        """src -> dst; past `free` bytes at `bps` bytes per second when bps > 0."""
        try:
            while not self._closed.is_set():
                data = src.recv(65536)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if bps <= 0 or len(data) <= free:
                    free -= len(data)
                    dst.sendall(data)
                    continue
                dst.sendall(data[:max(free, 0)])
                tick = max(1.0 / bps, 0.05)  # one send per tick: 1 byte/s, or bps x 50 ms for fast rates
                step = max(1, int(bps * tick))
                for i in range(max(free, 0), len(data), step):
                    if self._closed.wait(tick):
                        return
                    dst.sendall(data[i:i + step])
                free = 0
        except OSError:
            pass

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            _shutdown_all([self._listener, *self._socks])

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shutdown_all(socks: list[socket.socket]) -> None:
    """shutdown() then close() each: close() alone does not wake a thread blocked in accept()/recv() on it."""
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


def _read_head(sock: socket.socket) -> tuple[bytes | None, bytes]:
    """(request head up to and including the blank line, bytes already read past it); (None, b"") on EOF."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            return None, b""
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _close_after(head: bytes) -> bytes:
    """The request head with `Connection: close` (unsigned in SigV4), so the next request opens a new connection."""
    lines = [ln for ln in head.rstrip(b"\r\n").split(b"\r\n") if not ln.lower().startswith(b"connection:")]
    return b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n"


class RecordingServer:
    """"Another host" for redirect tests: records every request head it receives and answers 404."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._loop, name="RecordingServer", daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    head, _ = _read_head(conn)
                    if head is not None:
                        self.heads.append(head)
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        _shutdown_all([self._listener])

    def __enter__(self) -> "RecordingServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
