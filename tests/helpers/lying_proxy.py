"""A loopback HTTP proxy in front of a real S3 server that answers object GETs with ``200`` and a wrong
body: what a broken endpoint, cache or middlebox can do. Everything else (PUT, HEAD, DELETE, listings)
passes through unchanged, so the server itself keeps the true objects. The GETs lied about are those whose answer
carries the whole object (:func:`whole_object`): a ``200``, or a ranged GET's ``206`` covering all of it (G4 loads
ask for one frame and a byte more), whose ``Content-Range`` is then rewritten to the wrong body's length; ranged
GETs of part of an object (header reads) pass honestly.

``LyingProxy(host, port)``; set ``proxy.mode`` to one of :data:`MODES` (``"pass"`` forwards honestly):

* ``short``: the first third of the body, with a matching short Content-Length;
* ``garbage``: random bytes of the same length;
* ``other``: ``proxy.other_body`` (another object's bytes);
* ``html``: an HTML error page (``Content-Type: text/html``).

The server's ETag header is kept (a proxy that rewrites bodies rarely touches it). ``proxy.lied`` counts
rewritten answers.

``proxy.redirect_to = "https://host:port"``: every request (any method, any path) is answered ``301 Moved
Permanently`` to that origin and the same path, with an HTML body and no S3 headers, and never reaches the
server: an http endpoint behind a front end that sends everything to https. ``proxy.redirected`` counts them.
``proxy.endpoint`` as the origin is a redirect loop; ``""`` answers ``301`` with no ``Location`` header.

``proxy.cut_short = n``: the next ``n`` object GETs answered 200 (whole or ranged, mode ignored) are cut
short in transit: the full ``Content-Length`` header, then only the first third of the body, then the
connection is closed (a reset link, a proxy that died mid-answer). ``proxy.cut`` counts them. Set a large
``n`` for "every answer".

``proxy.no_conditional_delete = True``: a DELETE carrying ``If-Match`` is answered ``501 NotImplemented`` (an S3
XML error) and never reaches the server: an S3-compatible server without conditional deletes.
``proxy.refused_deletes`` counts them.

``proxy.conflict_puts = n``: the next ``n`` create-exclusive PUTs (``If-None-Match: *``) are answered ``409
ConditionalRequestConflict`` (an S3 XML error) and never reach the server: what AWS S3 answers when a conflicting
operation on the name (a DELETE) won against the conditional write ("retry the request"); nothing is stored.
``proxy.conflicted`` counts them.

``proxy.ignore_range = True``: a gateway that ignores ``Range``. The client's request still reaches the server
unchanged (its SigV4 signature covers the ``Range`` header: a request stripped of it is refused, 403
SignatureDoesNotMatch, by a server that checks signatures, as SeaweedFS with the tests' credentials does); an
object GET the server answers ``206`` is answered ``200`` instead, with the server's headers but ``Content-Range``
and the WHOLE object, which the proxy fetches with a GET of its own (boto3, credentials from the environment, as
the tests' clients have them; :meth:`LyingProxy._whole`). ``proxy.ranges_ignored`` counts them. Applied before
``cut_short`` and ``mode``, which then act on the whole object's ``200``.

``proxy.pad_lengths = True``: a gateway that lies about lengths only: every object GET answer (200 or 206) gets one
byte more (``Content-Range`` rewritten to match) and every object HEAD's ``Content-Length`` one more; the ETag is
the server's. ``proxy.padded`` counts the answers changed.

``proxy.repeat_list_pages = n``: the next ``n`` ListObjectsV2 pages are each served twice (an S3-compatible
server repeating a page): the first answer hands out a continuation token of the proxy's own (on the listing's
last page too, then marked truncated), and the client's request for that token is answered, without reaching the
server, with the page again as the server sent it (its true token, or none): the client lists the page's objects
twice and goes on. ``proxy.repeated`` counts the pages served again.

Used by tests/pool/g4/test_g4_hostile.py, tests/pool/g4/test_g4_drop_race.py, tests/pool/g4/test_g4_gc_repeats.py,
tests/pool/g4/test_g4_oversized.py, tests/pool/g4/test_g4_s3_errors.py and the ``lyings3`` fault campaign kind.
"""
from __future__ import annotations

import http.client
import os
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

MODES = ("short", "garbage", "other", "html")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "expect", "proxy-connection"}
MOVED = b"<html><head><title>301 Moved Permanently</title></head><body><h1>301 Moved Permanently</h1></body></html>\n"
NOT_IMPLEMENTED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NotImplemented</Code><Message>A header you '
                   b'provided implies functionality that is not implemented</Message></Error>')
CONFLICT = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ConditionalRequestConflict</Code><Message>A '
            b'conflicting operation occurred. If using PutObject you can retry the request.</Message></Error>')
HTML = b"<html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1></body></html>\n"


def upstream(handler: BaseHTTPRequestHandler, target: tuple[str, int], body: bytes | None):
    """Send ``handler``'s request (method, path, end-to-end headers, ``body``) to ``target``; returns the
    answer's ``(status, end-to-end headers, body, Content-Length header)``."""
    hdrs = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP}
    c = http.client.HTTPConnection(*target, timeout=30)
    try:
        c.request(handler.command, handler.path, body=body, headers=hdrs)
        r = c.getresponse()
        data = r.read()
        return r.status, [(k, v) for k, v in r.getheaders() if k.lower() not in _HOP], data, \
            r.getheader("Content-Length", "0")
    finally:
        c.close()


def reply(handler: BaseHTTPRequestHandler, status: int, hdrs: list, data: bytes, length: str) -> None:
    """Answer ``handler``'s client: ``status``, ``hdrs``, and ``data`` (a HEAD: the upstream ``length``, no body)."""
    handler.send_response(status)
    for k, v in hdrs:
        handler.send_header(k, v)
    handler.send_header("Content-Length", length if handler.command == "HEAD" else str(len(data)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)


def list_query(handler: BaseHTTPRequestHandler, target: tuple[str, int]) -> dict | None:
    """The parsed query of ``handler``'s request when it is an S3 ListObjectsV2 (``GET ?list-type=2``), for the
    caller to answer; any other request is passed to ``target`` and answered here (None)."""
    query = parse_qs(urlsplit(handler.path).query)
    if handler.command == "GET" and query.get("list-type") == ["2"]:
        return query
    n = int(handler.headers.get("Content-Length") or 0)
    status, hdrs, data, length = upstream(handler, target, handler.rfile.read(n) if n else None)
    reply(handler, status, hdrs, data, length)
    return None


def whole_object(status: int, hdrs: list) -> bool:
    """An object GET's answer carries the whole object: ``200``, or ``206`` whose ``Content-Range`` covers all of
    it (``bytes 0-(L-1)/L``: a ranged GET that asked for at least the object, as G4 loads do)."""
    if status == 200:
        return True
    rng = next((v for k, v in hdrs if k.lower() == "content-range"), "")
    m = re.fullmatch(r"bytes 0-(\d+)/(\d+)", rng.strip())
    return status == 206 and m is not None and int(m.group(1)) + 1 == int(m.group(2))


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler for the tests' loopback proxies: HTTP/1.1 (keep-alive, as S3 clients expect), no log."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):  # quiet
        pass


def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, int]:
    """A ``ThreadingHTTPServer`` on a free loopback port running ``handler`` (daemon threads, served from a daemon
    thread); returns ``(server, port)``. Stop it with :func:`stop`."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1]


def start_proxy(handle: Callable[[BaseHTTPRequestHandler, bytes | None], None]) -> tuple[ThreadingHTTPServer, int]:
    """:func:`serve` a :class:`QuietHandler` that reads each request's body (``Content-Length`` bytes; ``None``
    when there are none) and calls ``handle(handler, body)`` for any GET, PUT, HEAD, DELETE or POST."""

    class Handler(QuietHandler):
        def _handle(self):
            n = int(self.headers.get("Content-Length") or 0)
            handle(self, self.rfile.read(n) if n else None)

        do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _handle

    return serve(Handler)


def stop(srv: ThreadingHTTPServer) -> None:
    """Stop serving ``srv`` and close its socket."""
    srv.shutdown()
    srv.server_close()


class LyingProxy:
    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.mode = "pass"
        self.other_body = b""
        self.lied = 0
        self.redirect_to: str | None = None
        self.redirected = 0
        self.cut_short = 0
        self.cut = 0
        self.no_conditional_delete = False
        self.refused_deletes = 0
        self.conflict_puts = 0
        self.conflicted = 0
        self.ignore_range = False
        self.ranges_ignored = 0
        self._s3: Any = None  # the proxy's own boto3 client (ignore_range), made at first use
        self.pad_lengths = False
        self.padded = 0
        self.repeat_list_pages = 0
        self.repeated = 0
        self._made = 0  # tokens of the proxy's made so far
        self._pages: dict[str, tuple[list, bytes]] = {}  # a token of the proxy's -> the page to serve again
        self._lock = threading.Lock()
        proxy = self

        class Handler(QuietHandler):
            def handle(self):
                try:
                    super().handle()
                except (BrokenPipeError, ConnectionResetError):  # a client that read what it wanted and hung up
                    pass

            def _forward(self):
                n = int(self.headers.get("Content-Length") or 0)
                if proxy.redirect_to is not None:
                    if n:
                        self.rfile.read(n)
                    proxy.redirected += 1
                    loc = [("Location", proxy.redirect_to + self.path)] if proxy.redirect_to else []
                    reply(self, 301, loc + [("Content-Type", "text/html")], MOVED, str(len(MOVED)))
                    return
                if proxy.no_conditional_delete and self.command == "DELETE" and "If-Match" in self.headers:
                    proxy.refused_deletes += 1
                    err = NOT_IMPLEMENTED
                    reply(self, 501, [("Content-Type", "application/xml")], err, str(len(err)))
                    return
                if proxy.conflict_puts > 0 and self.command == "PUT" and self.headers.get("If-None-Match") == "*":
                    if n:
                        self.rfile.read(n)
                    proxy.conflict_puts -= 1
                    proxy.conflicted += 1
                    reply(self, 409, [("Content-Type", "application/xml")], CONFLICT, str(len(CONFLICT)))
                    return
                query = parse_qs(urlsplit(self.path).query)
                if self.command == "GET" and query.get("list-type") == ["2"]:
                    self._list(query)
                    return
                status, out_hdrs, data, length = upstream(self, proxy.target, self.rfile.read(n) if n else None)
                obj_get = self.command == "GET" and status in (200, 206) and "?" not in self.path \
                    and self.path.count("/") >= 2
                if obj_get and status == 206 and proxy.ignore_range:
                    status, data = 200, proxy._whole(self.path)
                    out_hdrs = [(k, v) for k, v in out_hdrs if k.lower() != "content-range"]
                    length = str(len(data))
                if obj_get and proxy.cut_short > 0 and len(data) >= 3:
                    proxy.cut_short -= 1
                    proxy.cut += 1
                    self.send_response(status)
                    for k, v in out_hdrs:
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 3])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if proxy.pad_lengths and status in (200, 206) and "?" not in self.path and self.path.count("/") >= 2:
                    if self.command == "HEAD":
                        proxy.padded += 1
                        length = str(int(length) + 1)
                    elif obj_get:
                        proxy.padded += 1
                        data = data + b"\0"
                        length = str(len(data))
                        out_hdrs = [(k, v) for k, v in out_hdrs if k.lower() != "content-range"]
                        if status == 206:
                            out_hdrs.append(("Content-Range", f"bytes 0-{len(data) - 1}/{len(data)}"))
                if obj_get and proxy.mode != "pass" and whole_object(status, out_hdrs):
                    data, out_hdrs = proxy._lie(data, out_hdrs)
                    if status == 206:  # the lie told consistently: an object of the wrong body's length
                        out_hdrs = [(k, v) for k, v in out_hdrs if k.lower() != "content-range"] + \
                            [("Content-Range", f"bytes 0-{len(data) - 1}/{len(data)}")]
                reply(self, status, out_hdrs, data, length)

            def _list(self, query: dict[str, list[str]]) -> None:
                """A ListObjectsV2 page: ``repeat_list_pages`` (module doc)."""
                token = (query.get("continuation-token") or [""])[0]
                with proxy._lock:
                    again = proxy._pages.pop(token, None)
                    if again is not None:
                        proxy.repeated += 1
                if again is not None:
                    reply(self, 200, again[0], again[1], str(len(again[1])))
                    return
                status, out_hdrs, data, length = upstream(self, proxy.target, None)
                with proxy._lock:
                    fake = f"kvbm-repeat-{proxy._made}" if status == 200 and proxy.repeat_list_pages > 0 else None
                    if fake is not None:
                        proxy._made += 1
                        proxy.repeat_list_pages -= 1
                        proxy._pages[fake] = (out_hdrs, data)
                if fake is not None:
                    tag = f"<NextContinuationToken>{fake}</NextContinuationToken>".encode()
                    data, hit = re.subn(rb"<NextContinuationToken>[^<]*</NextContinuationToken>", tag, data)
                    if not hit:
                        data = data.replace(b"<IsTruncated>false</IsTruncated>", b"<IsTruncated>true</IsTruncated>" + tag)
                    length = str(len(data))
                reply(self, status, out_hdrs, data, length)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _forward

        self._srv, self.port = serve(Handler)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _whole(self, path: str) -> bytes:
        """The whole object at the path-style ``path`` (``/bucket/key``), by a correctly signed GET of the proxy's
        own (``ignore_range``)."""
        with self._lock:
            if self._s3 is None:
                import boto3
                self._s3 = boto3.client("s3", endpoint_url=f"http://{self.target[0]}:{self.target[1]}",
                                        region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
            self.ranges_ignored += 1
        bucket, key = unquote(urlsplit(path).path).lstrip("/").split("/", 1)
        return bytes(self._s3.get_object(Bucket=bucket, Key=key)["Body"].read())

    def _lie(self, data: bytes, hdrs: list):
        self.lied += 1
        m = self.mode
        if m == "short":
            return data[: len(data) // 3], hdrs
        if m == "garbage":
            return os.urandom(len(data)), hdrs
        if m == "other":
            return bytes(self.other_body), hdrs
        if m == "html":
            return HTML, [(k, v) for k, v in hdrs if k.lower() != "content-type"] + [("Content-Type", "text/html")]
        raise ValueError(f"LyingProxy.mode {m!r}: one of pass, {', '.join(MODES)}")

    def close(self) -> None:
        stop(self._srv)
