"""A loopback HTTP proxy in front of a real S3 server that throttles like S3 does, and counts requests.

``ThrottleProxy(host, port)``; what it throttles (object requests only: ``/bucket/key``):

* ``proxy.first_n = N``: the first N requests of each (method, object) are throttled, later ones pass;
* ``proxy.share = p``: each request is throttled with probability ``p`` (1.0: every one), after ``first_n``;
* ``proxy.methods``: which methods may be throttled (default GET, HEAD, PUT).

A throttled request gets what S3 answers: ``503 Slow Down`` with an S3 XML error body (``<Code>SlowDown``)
for GET/PUT, and a bodyless 503 for HEAD (S3 cannot send a body to a HEAD); the request body is read first
(the connection stays usable) and never reaches the server. Everything else is forwarded unchanged.

Counters: ``proxy.throttled`` (answers throttled), ``proxy.requests`` (a Counter of ``(method, kind)``,
kind ``"list"`` for any GET at bucket level, which is where ListObjects/ListObjectsV2 (``?list-type=2``,
``?prefix=``) go, else ``"object"`` or ``"bucket"``) and :meth:`lists` (LIST requests seen).
"""
from __future__ import annotations

import collections
import random
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from tests.helpers.lying_proxy import reply, upstream

SLOWDOWN_XML = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                '<Message>Please reduce your request rate.</Message><Resource>{path}</Resource>'
                '<RequestId>{rid}</RequestId></Error>')


def request_kind(method: str, path: str) -> str:
    """``"list"`` for a GET at bucket level (ListObjects, ListObjectsV2), ``"object"`` for ``/bucket/key``,
    else ``"bucket"`` (HEAD bucket, ...). Path-style addressing (as the tests' SeaweedFS uses)."""
    p = urlsplit(path).path.strip("/")
    if "/" in p:
        return "object"
    return "list" if method == "GET" else "bucket"


class ThrottleProxy:
    def __init__(self, host: str, port: int, *, first_n: int = 0, share: float = 0.0, seed: int = 0):
        self.target = (host, port)
        self.first_n, self.share = first_n, share
        self.methods = {"GET", "HEAD", "PUT"}
        self.throttled = 0
        self.requests: collections.Counter = collections.Counter()
        self._seen: collections.Counter = collections.Counter()
        self._rng = random.Random(seed)
        self._mu = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _handle(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                kind = request_kind(self.command, self.path)
                if proxy._throttle(self.command, self.path, kind):
                    return self._slow_down()
                reply(self, *upstream(self, proxy.target, body))

            def _slow_down(self):
                self.send_response(503, "Slow Down")
                self.send_header("x-amz-request-id", uuid.uuid4().hex[:16].upper())
                if self.command == "HEAD":
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                xml = SLOWDOWN_XML.format(path=urlsplit(self.path).path, rid=uuid.uuid4().hex[:16].upper()).encode()
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(xml)))
                self.end_headers()
                self.wfile.write(xml)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _handle

        self._srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._srv.daemon_threads = True
        self.port = self._srv.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()

    def _throttle(self, method: str, path: str, kind: str) -> bool:
        with self._mu:
            self.requests[(method, kind)] += 1
            if kind != "object" or method not in self.methods:
                return False
            key = (method, urlsplit(path).path)
            self._seen[key] += 1
            hit = self._seen[key] <= self.first_n or (self.share > 0 and self._rng.random() < self.share)
            self.throttled += hit
            return hit

    def lists(self) -> int:
        """LIST requests (GETs at bucket level) seen so far."""
        with self._mu:
            return sum(v for (m, k), v in self.requests.items() if k == "list")

    def close(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()
