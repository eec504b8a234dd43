"""An S3 endpoint that answers a PUT with 404 and no S3 error body (a proxy or gateway path that does not exist)
stored nothing: the offload is dropped (``dropped_error``), never counted written. Review finding (2026-11-29):
the obstore client (the default) mapped every 404 to "absent" and so counted such a PUT as written. A real
HTTP server on loopback answers 404 to every request."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers.g4_writer import namespace, put_blocks
from tests.helpers.pools import G4_TIMEOUT_S
from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.pool import G4Pool


class _NotFound(BaseHTTPRequestHandler):
    def _any(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_PUT = do_GET = do_HEAD = do_POST = do_DELETE = _any

    def log_message(self, *a):
        pass


@pytest.fixture
def endpoint(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_a_put_answered_404_is_dropped_not_written(endpoint, client):
    ns = namespace()
    # the server (a thread of this process) answers at once: G4_TIMEOUT_S, not 2 s, so that an answer the busy CI VM
    # froze is no timeout (the PUT then ended unsettled and the breaker opened: no dropped_error)
    cfg = G4Config(url="s3://bucket/pfx", endpoint_url=endpoint, encrypt=False, timeout_s=G4_TIMEOUT_S, retries=0,
                   s3_client=client)
    with G4Pool(cfg, ns) as p:
        r = put_blocks(p, [1, 2, 3], "t")
        st = p.stats()
    assert (r.written, r.dropped) == (0, 3), r
    assert st["written"] == 0 and st["bytes_written"] == 0 and st["dropped_error"] == 3, st
