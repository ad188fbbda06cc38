"""A fault-injecting TCP proxy on loopback: the network failures a real server will not produce on demand.

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

log = logging.getLogger(__name__)


class DropProxy:
    """Threaded TCP proxy on 127.0.0.1 that resets the first `drops` connections carrying more than
    `drop_after_bytes` server->client, after exactly that many bytes; later connections pass untouched.

    The reset uses SO_LINGER 0, so the client sees ECONNRESET / a truncated body, as with a real network fault.
    Byte counts are per TCP connection (HTTP keep-alive connections accumulate across requests).
    """

    def __init__(self, target_host: str, target_port: int, drop_after_bytes: int, drops: int = 1) -> None:
        if drop_after_bytes < 0 or drops < 0:
            raise ValueError("drop_after_bytes and drops must be >= 0")
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
            socks = [self._listener, *self._socks]
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._accept_thread.join(timeout=2)
        for t in self._threads:
            t.join(timeout=2)

    def __enter__(self) -> "DropProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
