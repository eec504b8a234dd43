"""What an S3 answer means for a G4 offload and for the operator's logs (review findings 2026-12-02).

* A create-exclusive PUT answered ``409 ConditionalRequestConflict`` (AWS: a conflicting operation on the name, such as
  a DELETE, won against the conditional write: "retry the request") stored nothing. Both clients took every 409 for
  "another writer's copy holds the name": the block counted ``skipped_exists`` (stored) while the name was empty.
  Now it is a dropped offload (``dropped_error``), and a later offload stores it. SeaweedFS never answers 409: a real
  proxy in front of it does (:mod:`tests.helpers.lying_proxy`, ``conflict_puts``).
* ``g4.endpoint_url`` with credentials (``http://USER:SECRET@host``): the clients' error texts name the request's
  URL, and the circuit breaker's OPEN warning logged them verbatim, secret included. Now every store error text and
  the breaker's log lines are redacted.
"""
from __future__ import annotations

import logging
import socket
import time

import pytest

from tests.helpers.g4_writer import namespace, payload
from tests.helpers.lying_proxy import LyingProxy
from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.pool import G4Pool

HANG_S = 600.0  # a hang guard, not a bound


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_a_put_answered_409_conflict_is_dropped_not_counted_stored(seaweed, s3_prefix, client):
    host, port = seaweed.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = LyingProxy(host, int(port))
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    cfg = G4Config(url=f"s3://{seaweed.bucket}/{s3_prefix}", endpoint_url=proxy.endpoint, encrypt=False,
                   s3_client=client, timeout_s=30.0)
    try:
        with G4Pool(cfg, ns) as pool:
            key = ns.keys([7], tenant="t")
            deadline = time.monotonic() + HANG_S  # hang guard: the start-up write of namespace.json (a PUT too)
            while not pool.writer.namespace_written and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pool.writer.namespace_written
            proxy.conflict_puts = 1
            res = pool.put(key, [payload(7, "t", bpb)]).result(HANG_S)
            assert proxy.conflicted == 1
            assert (res.written, res.skipped, res.dropped) == (0, 0, 1), res
            st = pool.stats()
            assert st["skipped_exists"] == 0 and st["dropped_error"] == 1, st
            assert pool.store.head(pool.object_name(key[0])) is None  # nothing stored
            res = pool.put(key, [payload(7, "t", bpb)]).result(HANG_S)  # a later offload of the block stores it
            assert res.written == 1 and pool.lookup_prefix(key).result(HANG_S) == 1
    finally:
        proxy.close()


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_endpoint_credentials_never_reach_the_log(client, caplog, monkeypatch):
    """An endpoint that refuses connections, named with credentials: the breaker opens (WARNING naming the last
    error) and offloads are dropped; no log line carries the secret."""
    for k, v in {"AWS_ACCESS_KEY_ID": "kvbmtest", "AWS_SECRET_ACCESS_KEY": "kvbmtest-secret",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    ep = f"http://admin:TOPSECRET@127.0.0.1:{_dead_port()}"
    cfg = G4Config(url="s3://kvbm-test/leak", endpoint_url=ep, encrypt=False, timeout_s=1, retries=0, s3_client=client)
    caplog.set_level(logging.INFO)
    ns = namespace()
    with G4Pool(cfg, ns) as pool:
        keys = ns.keys(list(range(1, 9)), tenant="t")
        pool.put(keys, [payload(s, "t", ns.layout.bytes_per_block) for s in range(1, 9)]).result(HANG_S)
        pool.flush(HANG_S)
    opened = [r.getMessage() for r in caplog.records if "circuit breaker OPEN" in r.getMessage()]
    assert opened and "EndpointConnectionError" in opened[0] or "Connect" in opened[0], opened  # the error is named
    leaked = [r.getMessage() for r in caplog.records if "TOPSECRET" in r.getMessage()]
    assert not leaked, leaked[0]
