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
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from tests.helpers.lying_proxy import reply, start_proxy, stop, upstream

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


def _slow_down(h: BaseHTTPRequestHandler) -> None:
    """Answer ``h``'s client ``503 Slow Down`` as S3 does (an XML error body; none for a HEAD)."""
    h.send_response(503, "Slow Down")
    h.send_header("x-amz-request-id", uuid.uuid4().hex[:16].upper())
    if h.command == "HEAD":
        h.send_header("Content-Length", "0")
        h.end_headers()
        return
    xml = SLOWDOWN_XML.format(path=urlsplit(h.path).path, rid=uuid.uuid4().hex[:16].upper()).encode()
    h.send_header("Content-Type", "application/xml")
    h.send_header("Content-Length", str(len(xml)))
    h.end_headers()
    h.wfile.write(xml)


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
        self._srv, self.port = start_proxy(self._handle)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _handle(self, h: BaseHTTPRequestHandler, body: bytes | None) -> None:
        if self._throttle(h.command, h.path, request_kind(h.command, h.path)):
            return _slow_down(h)
        reply(h, *upstream(h, self.target, body))

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
        stop(self._srv)
