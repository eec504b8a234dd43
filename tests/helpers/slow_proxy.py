"""A TCP proxy on loopback that holds back the server's answer on its first connections: a slow store as a
real network sees it (the request reaches the server and is acted on; the answer comes after the client's
read timeout). Used to test what a client's retry then meets (e.g. S3's 412 for its own first PUT).

``SlowAnswerProxy(target_host, target_port, slow_connections=1, delay_s=2.0)``: connections 0 ..
``slow_connections - 1`` get the server's bytes ``delay_s`` seconds late; later ones pass straight through.
``first_answers[i]`` holds the first bytes of the server's first final answer on connection ``i`` (what the
client never saw in time, e.g. ``b"HTTP/1.1 200 OK"``); interim ``100 Continue`` answers are not held back.
A client that gives up and closes its connection does not close the proxy's connection to the server: the
server still answers (and is not told the request was abandoned), so ``first_answers`` records that answer even
when it comes after the client's timeout; :meth:`wait_answer` waits for it.

``SlowPutProxy``: an HTTP proxy whose object PUTs are answered late (they land) or never (they are lost),
every other request passing through, and optionally its first HEADs unanswered too (see its doc).
"""
from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler

from tests.helpers.lying_proxy import reply, start_proxy, stop, upstream


def end_sockets(*socks: socket.socket) -> None:
    """Shut down (both ways) and close each socket, ignoring ones already gone."""
    for x in socks:
        try:
            x.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        x.close()


class SlowAnswerProxy:
    def __init__(self, host: str, port: int, slow_connections: int = 1, delay_s: float = 2.0):
        self.target = (host, port)
        self.slow_connections, self.delay_s = slow_connections, delay_s
        self.first_answers: dict[int, bytes] = {}
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._n = 0
        self._closed = False
        self._answered = threading.Condition()
        self._upstream: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                c, _ = self._srv.accept()
            except OSError:
                return
            i, self._n = self._n, self._n + 1
            s = socket.create_connection(self.target)
            self._upstream.append(s)
            threading.Thread(target=self._pipe, args=(c, s, None, 0.0), daemon=True).start()
            slow = self.delay_s if i < self.slow_connections else 0.0
            threading.Thread(target=self._pipe, args=(s, c, i, slow), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, conn: int | None, delay_s: float) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if conn is not None and conn not in self.first_answers and not data.startswith(b"HTTP/1.1 100 "):
                    # an interim ``100 Continue`` (botocore sends ``Expect: 100-continue`` with a PUT body)
                    # passes at once: the request's body must reach the server, only its answer is late
                    with self._answered:
                        self.first_answers[conn] = data[:64]
                        self._answered.notify_all()
                    time.sleep(delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            # the client's side ending (its timeout closed it) leaves the server's connection to the answering
            # thread: the server answers what it received, and that answer is recorded (close() ends it)
            end_sockets(*((src,) if conn is None else (src, dst)))

    def wait_answer(self, conn: int, timeout_s: float = 60.0) -> bytes:
        """The first bytes of the server's first final answer on connection ``conn``, once it came (the
        server may answer after the client gave up). Raises ``TimeoutError`` after ``timeout_s`` seconds (a hang
        guard, not a measurement)."""
        with self._answered:
            if not self._answered.wait_for(lambda: conn in self.first_answers, timeout_s):
                raise TimeoutError(f"no answer from the server on connection {conn} in {timeout_s} s: "
                                   f"{self.first_answers}")
            return self.first_answers[conn]

    def close(self) -> None:
        self._closed = True
        self._srv.close()
        for s in self._upstream:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


class SlowPutProxy:
    """A loopback HTTP proxy in front of a real S3 server whose object PUTs get no answer in time; every
    other request (HEAD, GET, LIST, bucket calls) passes straight through.

    ``SlowPutProxy(host, port, mode="late", delay_s=2.0, slow_puts=None)``:

    * ``mode="late"``: the PUT is forwarded (the server stores the object) and its answer is sent only
      ``delay_s`` seconds later: what a client sees when the server, or its own process, is too slow for
      its timeout although the write landed;
    * ``mode="lost"``: the PUT's body is read and dropped (it never reaches the server); after ``delay_s``
      the connection closes without an answer: a write that did not land.

    ``slow_puts``: how many PUTs are treated so (None: all); later ones pass. ``held`` counts those held.
    ``slow_heads``: how many HEADs get no answer (read, never forwarded; the connection closes after
    ``delay_s``): a server too loaded to settle a PUT with a HEAD; later ones pass. ``held_heads`` counts
    them. Both limits may be changed while the proxy runs (e.g. armed once a pool has started).
    """

    def __init__(self, host: str, port: int, mode: str = "late", delay_s: float = 2.0,
                 slow_puts: int | None = None, slow_heads: int = 0):
        if mode not in ("late", "lost"):
            raise ValueError(f"SlowPutProxy mode {mode!r}: 'late' or 'lost'")
        self.target = (host, port)
        self.mode, self.delay_s, self.slow_puts = mode, delay_s, slow_puts
        self.held = 0
        self.slow_heads, self.held_heads = slow_heads, 0
        self._mu = threading.Lock()
        self._srv, self.port = start_proxy(self._handle)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _handle(self, h: BaseHTTPRequestHandler, body: bytes | None) -> None:
        if h.command == "HEAD" and self._hold_head():
            time.sleep(self.delay_s)  # no answer: the client's timeout fires first
            h.close_connection = True
            return
        if not (h.command == "PUT" and self._hold()):
            return reply(h, *upstream(h, self.target, body))
        if self.mode == "late":
            answer = upstream(h, self.target, body)  # stored now; answered late
            time.sleep(self.delay_s)
            try:
                reply(h, *answer)
            except OSError:  # the client gave up and closed
                h.close_connection = True
            return
        time.sleep(self.delay_s)  # lost: never forwarded, never answered
        h.close_connection = True

    def _hold(self) -> bool:
        with self._mu:
            if self.slow_puts is not None and self.held >= self.slow_puts:
                return False
            self.held += 1
            return True

    def _hold_head(self) -> bool:
        with self._mu:
            if self.held_heads >= self.slow_heads:
                return False
            self.held_heads += 1
            return True

    def close(self) -> None:
        stop(self._srv)


class _PacedProxy(SlowAnswerProxy):
    """A TCP proxy one direction of which flows at ``rate_bps`` bytes per second per connection (``PACE_ANSWERS``:
    server to client, else client to server); the other passes at once. ``endpoint`` as :class:`SlowAnswerProxy`."""

    PACE_ANSWERS = False

    def __init__(self, host: str, port: int, rate_bps: int):
        self.rate_bps = rate_bps
        super().__init__(host, port, slow_connections=0)

    def _pipe(self, src: socket.socket, dst: socket.socket, conn: int | None, delay_s: float) -> None:
        if (conn is not None) != self.PACE_ANSWERS:  # the unpaced direction
            return super()._pipe(src, dst, conn, delay_s)
        step = max(1, self.rate_bps // 20)  # 20 paced sends a second
        try:
            while True:
                data = src.recv(step)
                if not data:
                    break
                dst.sendall(data)
                time.sleep(len(data) / self.rate_bps)
        except OSError:
            pass
        finally:
            end_sockets(src, dst)


class SlowUploadProxy(_PacedProxy):
    """A slow uplink: client-to-server bytes at ``rate_bps`` bytes per second per connection (each upload
    progresses, just slowly); the server's answers pass at once."""


class SlowDownloadProxy(_PacedProxy):
    """A slow downlink: server-to-client bytes at ``rate_bps`` bytes per second per connection (each answer arrives
    steadily, just slowly); requests pass at once."""

    PACE_ANSWERS = True
