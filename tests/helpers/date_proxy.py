"""A loopback HTTP proxy in front of a real S3 server that states its own clock: every request and answer passes
through unchanged except the answer's ``Date`` header, which is the proxy's clock ``ahead_s`` ahead (nginx's
default: it does not pass the upstream's ``Date``), while ``LastModified`` stays the S3 server's.

``DateProxy(host, port, ahead_s)``; ``proxy.endpoint`` is its URL; ``proxy.requests`` lists ``(method, path)`` of
every request it received (to count, e.g., clock probe writes); ``proxy.refuse_puts = "text"``: a PUT whose path
contains it is answered ``403 AccessDenied`` (an S3 XML error) and never reaches the server (a bucket this client may
not write there); ``proxy.close()`` stops it.

Used by tests/pool/g4/test_g4_gc_clock.py and tests/pool/g4/test_g4_announce_proxy_clock.py.
"""
from __future__ import annotations

import email.utils
import time

from tests.helpers.lying_proxy import QuietHandler, reply, serve, stop, upstream

DENIED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied</Message>'
          b'</Error>')


class DateProxy:
    """See the module doc."""

    def __init__(self, host: str, port: int, ahead_s: float):
        target = (host, port)
        self.requests: list[tuple[str, str]] = []
        self.refuse_puts: str | None = None
        log, proxy = self.requests, self

        class Handler(QuietHandler):
            def date_time_string(self, timestamp=None):  # what send_response() sends as Date
                return email.utils.formatdate(time.time() + ahead_s, usegmt=True)

            def _forward(self):
                log.append((self.command, self.path))
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                if self.command == "PUT" and proxy.refuse_puts is not None and proxy.refuse_puts in self.path:
                    reply(self, 403, [("Content-Type", "application/xml")], DENIED, str(len(DENIED)))
                    return
                status, hdrs, data, length = upstream(self, target, body)
                reply(self, status, [(k, v) for k, v in hdrs if k.lower() != "date"], data, length)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _forward

        self._srv, port = serve(Handler)
        self.endpoint = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        stop(self._srv)
