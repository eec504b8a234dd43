"""An S3 store that answers a PUT "no room" is an answer, not an outage (2026-12), as a full ``file://`` mount is
(tests/pool/g4/test_g4_fs_full.py). Before, both S3 clients took HTTP 507 Insufficient Storage (MinIO
``XMinioStorageFull``, S3 on Outposts ``InsufficientCapacity``) for an outage: StoreUnavailable, a breaker failure per
dropped block, the breaker opened and every load missed although reads worked; and a bucket quota (MinIO
``XMinioAdminBucketQuotaExceeded``, HTTP 400; Ceph RGW ``QuotaExceeded``, HTTP 403) for a refused request
(``dropped_error``, logged as a credentials problem). Now the offload is dropped as ``dropped_full`` (ENOSPC / EDQUOT),
logged once naming the bucket, status and code, the breaker stays closed and loads go on.

SeaweedFS cannot answer so (its quota enforcement answers 500 InternalError): a real loopback proxy in front of the
tests' SeaweedFS answers object PUTs as a full or over-quota MinIO / Ceph does, with the S3 XML error body each
client's own response parsing reads, and forwards everything else (GET, HEAD, LIST, DELETE) to the server, so blocks
stored before are still there to load. A GET is never taken for "no room", whatever it is answered.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.pool.g4.store import StoreFull, StoreUnavailable
from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from tests.helpers.lying_proxy import reply, start_proxy, stop, upstream
from tests.helpers.throttle_proxy import request_kind

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
POOL_LOG = "kvbm_backend.pool.g4.pool"
ERROR_XML = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{msg}</Message>'
             '<BucketName>{bucket}</BucketName><Resource>{path}</Resource><RequestId>{rid}</RequestId></Error>')

#: (HTTP status, S3 error code, errno name the store's StoreFull carries): what real servers answer a PUT
ANSWERS = [
    (507, "XMinioStorageFull", "ENOSPC"),  # MinIO: its drives are full
    (507, "", "ENOSPC"),  # a bare 507 Insufficient Storage (no error body)
    (400, "XMinioAdminBucketQuotaExceeded", "EDQUOT"),  # MinIO bucket quota
    (403, "QuotaExceeded", "EDQUOT"),  # Ceph RGW bucket / user quota
]


def _error(h: BaseHTTPRequestHandler, status: int, code: str) -> None:
    """Answer ``h``'s client ``status`` with an S3 XML error body naming ``code`` (an empty body for ``""``)."""
    path = urlsplit(h.path).path
    xml = b"" if not code else ERROR_XML.format(code=code, msg="no room", bucket=path.split("/")[1],
                                                path=path, rid=uuid.uuid4().hex[:16]).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/xml")
    h.send_header("Content-Length", str(len(xml)))
    h.end_headers()
    h.wfile.write(xml)


class FullProxy:
    """A loopback proxy in front of ``(host, port)``: while ``self.full = (status, code)`` every object PUT is answered
    ``status`` with an S3 XML error body naming ``code`` (none for ``""``; the request body is read, nothing reaches
    the server); ``self.land_first``: the first such PUT of each object is instead forwarded (it lands) and answered
    ``500 InternalError`` (an answer lost: the client retries and meets ``status``). ``self.full_gets`` answers object
    GETs the same way. Counters: ``refused`` (answered full), ``landed_lost`` (forwarded, answered 500)."""

    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.full: tuple[int, str] | None = None
        self.land_first = False
        self.full_gets = False
        self.refused = self.landed_lost = 0
        self._seen: set[str] = set()
        self._mu = threading.Lock()
        self._srv, port = start_proxy(self._handle)
        self.endpoint = f"http://127.0.0.1:{port}"

    def _handle(self, h: BaseHTTPRequestHandler, body: bytes | None) -> None:
        what = self._what(h.command, h.path)
        if what == "pass":
            return reply(h, *upstream(h, self.target, body))
        if what == "lost":
            upstream(h, self.target, body)  # stored; its answer never reaches the client
            return _error(h, 500, "InternalError")
        status, code = self.full
        _error(h, status, code)

    def _what(self, method: str, path: str) -> str:
        """``"pass"`` (forward), ``"lost"`` (forward, answer 500) or ``"full"`` for this request."""
        with self._mu:
            if self.full is None or request_kind(method, path) != "object" \
                    or method not in (("PUT", "GET") if self.full_gets else ("PUT",)):
                return "pass"
            if method == "PUT" and self.land_first and path not in self._seen:
                self._seen.add(path)
                self.landed_lost += 1
                return "lost"
            self.refused += 1
            return "full"

    def close(self) -> None:
        stop(self._srv)


@pytest.fixture
def proxy(seaweed):
    host, port = seaweed.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    p = FullProxy(host, int(port))
    yield p
    p.close()


def _pool(seaweed, s3_prefix, proxy, client) -> G4Pool:
    cfg = G4Config(url=f"s3://{seaweed.bucket}/{s3_prefix}", endpoint_url=proxy.endpoint, encrypt=False,
                   s3_client=client, timeout_s=30.0, retries=1, breaker_failures=2)
    pool = G4Pool(cfg, namespace())
    deadline = time.monotonic() + HANG_S  # hang guard: the start-up write of namespace.json (a PUT too)
    while not pool.writer.namespace_written and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.writer.namespace_written
    return pool


@pytest.mark.parametrize("status,code,eno", ANSWERS, ids=[f"{s}-{c or 'nobody'}" for s, c, _ in ANSWERS])
@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_a_put_answered_no_room_is_dropped_full_and_loads_go_on(seaweed, s3_prefix, proxy, client, status, code, eno,
                                                                 caplog):
    caplog.set_level(logging.WARNING, logger=POOL_LOG)
    pool = _pool(seaweed, s3_prefix, proxy, client)
    try:
        assert put_blocks(pool, [1], "t").written == 1  # stored before the store filled
        proxy.full = (status, code)
        res = put_blocks(pool, list(range(2, 8)), "t")  # 6 new blocks, more than breaker_failures
        s = pool.stats()
        assert (res.written, res.dropped) == (0, 6), res
        assert s["breaker_state"] == "closed" and s["breaker_opens"] == 0, s
        assert s.get("dropped_full") == 6 and s.get("dropped_unavailable", 0) == 0 and s.get("dropped_error", 0) == 0, s
        assert proxy.refused == 6  # one answer per block: a "no room" answer is not retried
        assert read_checked(pool, [1], "t") == [True], pool.stats()  # the block stored before is still served
        s = pool.stats()
        assert s["hits"] == 1 and s["misses"] == 0, s
        lines = [r.getMessage() for r in caplog.records if r.name == POOL_LOG and "refuses writes" in r.getMessage()]
        assert len(lines) == 1, lines  # once, not once per dropped block
        want = [eno, f"s3://{seaweed.bucket}/{s3_prefix}/", f"HTTP {status}", code or "-", "dropped_full"]
        assert all(w in lines[0] for w in want), (want, lines[0])
        assert ", mount " not in lines[0], lines[0]  # an S3 store has no mount (before: "mount ?")

        proxy.full = None  # room again: offloads are stored again, no restart
        assert put_blocks(pool, [9], "t").written == 1
        assert read_checked(pool, [9], "t") == [True]
    finally:
        pool.close(timeout=HANG_S)


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_a_retried_put_answered_over_quota_is_settled_by_a_head(seaweed, s3_prefix, proxy, client):
    """A PUT whose first attempt landed but whose answer was lost (500) and whose retry met "over quota" counts
    written (a HEAD finds these very bytes), as after any PUT that got no answer; one that never landed is
    ``dropped_full``, not a breaker failure."""
    pool = _pool(seaweed, s3_prefix, proxy, client)
    try:
        proxy.full, proxy.land_first = (403, "QuotaExceeded"), True
        res = put_blocks(pool, [1], "t")
        assert proxy.landed_lost == 1 and proxy.refused == 1, (proxy.landed_lost, proxy.refused)
        assert (res.written, res.dropped) == (1, 0), (res, pool.stats())
        proxy.land_first = False
        res = put_blocks(pool, [2], "t")
        s = pool.stats()
        assert (res.written, res.dropped) == (0, 1) and s["dropped_full"] == 1 and s["breaker_state"] == "closed", s
        proxy.full = None
        assert read_checked(pool, [1, 2], "t") == [True, False]
    finally:
        pool.close(timeout=HANG_S)


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_only_puts_are_taken_for_no_room(seaweed, s3_prefix, proxy, client):
    """A GET answered 507 stays what it was: the store is unavailable (no server answers a read for room)."""
    pool = _pool(seaweed, s3_prefix, proxy, client)
    try:
        assert put_blocks(pool, [1], "t").written == 1
        name = pool.object_name(namespace().keys([1], tenant="t")[0])
        proxy.full, proxy.full_gets = (507, "XMinioStorageFull"), True
        with pytest.raises(StoreUnavailable) as e:
            pool.store.get(name)
        assert not isinstance(e.value, StoreFull)
    finally:
        pool.close(timeout=HANG_S)
