"""A loopback TCP proxy in front of a real server that counts the bytes the server sends its clients: what a
client fetched, measured on the wire (HTTP headers included), without timing or RSS noise.

``CountingProxy(host, port)``; ``proxy.endpoint`` to connect through; :meth:`take` returns the bytes sent to
clients since the last call (or since the start) and starts counting afresh. ``proxy.connections`` counts the
client connections accepted. A client that closes its connection early (it read what it wanted) ends that
connection's forwarding at once. Used by tests/pool/g4/test_g4_oversized.py.
"""
from __future__ import annotations

import socket
import threading


class CountingProxy:
    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.connections = 0
        self._down = 0
        self._lock = threading.Lock()
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closed = False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def take(self) -> int:
        """Bytes sent to clients since the last call; the count starts again from zero."""
        with self._lock:
            n, self._down = self._down, 0
        return n

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self._srv.accept()
            except OSError:
                return
            try:
                s = socket.create_connection(self.target)
            except OSError:
                c.close()
                continue
            with self._lock:
                self.connections += 1
                self._socks += [c, s]
            threading.Thread(target=self._pipe, args=(c, s, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(s, c, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
                if count:  # counted once the client's socket took them
                    with self._lock:
                        self._down += len(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._srv.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            try:
                s.close()
            except OSError:
                pass
