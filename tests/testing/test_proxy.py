"""testing/proxy.py: the fault proxies that cut connections at exact byte counts, on a real S3 server and a raw
socket."""
from __future__ import annotations

import numpy as np
import pytest

from shardtrain.testing.proxy import DropProxy


@pytest.mark.s3
def test_drop_proxy_cuts_exactly_once(s3, s3_bucket):
    data = np.random.default_rng(1).bytes(4 << 20)
    s3.fs().pipe(f"{s3_bucket}/big.bin", data)
    with DropProxy("127.0.0.1", s3.port, drop_after_bytes=1 << 20, drops=1) as proxy:
        fs = s3.fs(proxy.endpoint_url)
        try:
            got = fs.cat_file(f"{s3_bucket}/big.bin")
        except Exception:  # the reset surfaced instead of being retried: acceptable, the drop is what we test
            got = None
        assert got in (None, data)
        assert proxy.drops_done == 1
        connections = proxy.connections
        assert fs.cat_file(f"{s3_bucket}/big.bin") == data  # later connections pass untouched
        assert fs.cat_file(f"{s3_bucket}/big.bin", start=3_000_000, end=3_000_050) == data[3_000_000:3_000_050]
        assert proxy.drops_done == 1 and proxy.connections >= connections


def test_drop_proxy_raw_socket_truncates_at_byte_count():
    """Without S3: a tiny server sends 100 kB; the first connection gets exactly 30,000 bytes, the second all."""
    import socket
    import threading

    payload = bytes(range(256)) * 400
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        for _ in range(2):
            conn, _ = server.accept()
            with conn:
                conn.sendall(payload)

    threading.Thread(target=serve, daemon=True).start()
    with DropProxy("127.0.0.1", server.getsockname()[1], drop_after_bytes=30_000) as proxy:
        results = []
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c:
                got, err = b"", None
                try:
                    while chunk := c.recv(65536):
                        got += chunk
                except ConnectionResetError as e:
                    err = e
                results.append((got, err))
    server.close()
    assert results[0][0] == payload[:30_000]
    assert results[1] == (payload, None)
    assert proxy.drops_done == 1 and proxy.connections == 2
