"""The announcement poller's clock behind a reverse proxy that states its own ``Date`` (review of 2026-12-03, as
gc's in tests/pool/g4/test_g4_gc_clock.py).

nginx in front of an S3 server sends its own ``Date`` header, not the upstream's, while ``LastModified`` is the S3
server's. The poller took the stated ``Date`` alone as the store's clock: behind a proxy whose clock ran 2 h ahead
every fresh batch looked 2 h old, so with the default 1 h TTL it withdrew and deleted the whole fleet's fresh
batches (their blocks lost their router credit while G4 holds them). Now the poller also measures the clock that
stamps objects (its own batches' mtimes, else gc's empty probe object, at most once per ``CLOCK_REMEASURE_S``) and
goes by the earlier one, with a warning.

Real SeaweedFS behind a real loopback proxy; real pools, announcers and pollers.
"""
from __future__ import annotations

import logging
import time

import pytest

from tests.helpers.date_proxy import DateProxy
from tests.helpers.g4_writer import namespace
from tests.pool.g4.test_g4_announce import _save, _stored, _worker  # the same worker and save steps

from kvbm_backend.config import G4Config
from kvbm_backend.integrations.vllm import stats
from kvbm_backend.pool.g4.gc import CLOCK_PROBE_PREFIX
from kvbm_backend.pool.g4.pool import G4Pool

pytestmark = [pytest.mark.slow, pytest.mark.side, pytest.mark.vllm]  # imports vLLM; no wall-clock assertion
AHEAD_S = 7200.0  # the proxy's clock ahead of the S3 server's


def _delta(before: dict) -> dict:
    after = stats.snapshot()
    return {k: after[k] - before.get(k, 0) for k in after if k.startswith("announce") and after[k] != before.get(k, 0)}


def test_a_poller_behind_a_proxy_stating_a_clock_ahead_expires_no_fresh_batch(tmp_path, seaweed, s3_prefix, caplog):
    host, port = seaweed.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = DateProxy(host, int(port), AHEAD_S)
    kw = {"url": seaweed.url(s3_prefix), "timeout_s": 60.0, "dir_fanout": 16, "announce": True,
          "keyring": {"path": str(tmp_path / "keys" / "keyring.json")}}
    a_pool = G4Pool(G4Config(**kw, endpoint_url=seaweed.endpoint), namespace())  # a writer talking to S3 directly
    c_pool = G4Pool(G4Config(**kw, endpoint_url=proxy.endpoint), namespace())  # a poller behind the proxy
    try:
        assert c_pool.cfg.announce_ttl_s == 3600
        stated = c_pool.store.server_time()
        assert stated is not None and stated - time.time() > AHEAD_S - 60, stated  # the proxy's clock, as C sees it
        a, c = _worker(a_pool), _worker(c_pool)
        bs = namespace().layout.page_size
        _save(a_pool, a, "tenant-x", list(range(7001, 7001 + 3 * bs)))
        assert a.announcer.flush() == 3
        (batch,) = [b.name for b in a.announcer.ann.list()]
        before = stats.snapshot()
        probes_before = len(proxy.requests)
        with caplog.at_level(logging.WARNING, logger="kvbm_backend.integrations.vllm.g4_announce"):
            got = c.announcer.poll()
        left = [b.name for b in a.announcer.ann.list()]
        assert left == [batch], (left, _delta(before))  # old code: [] (the fresh batch "expired" and deleted)
        assert got == (3, 0) and len(_stored(c.take())) == 1, (got, _delta(before))
        assert "announce_expired_batches" not in _delta(before), _delta(before)
        assert any("Date header" in r.getMessage() for r in caplog.records), caplog.text
        assert list(a_pool.store.list(CLOCK_PROBE_PREFIX)) == []  # the probe removed
        probe_puts = [r for r in proxy.requests[probes_before:] if r[0] == "PUT" and CLOCK_PROBE_PREFIX in r[1]]
        assert len(probe_puts) == 1, proxy.requests[probes_before:]  # measured once ...
        n = len(proxy.requests)
        assert c.announcer.poll() == (0, 0) and c.announcer.ann.list() != []
        assert not [r for r in proxy.requests[n:] if CLOCK_PROBE_PREFIX in r[1]]  # ... not again within 10 min

        # the real clock still expires: a batch its writer sealed with a 1 s TTL is withdrawn and deleted once
        # that old on the S3 server's clock (the sleep makes it old; nothing is timed)
        short = _worker(a_pool, ttl=1.0)
        _save(a_pool, short, "tenant-x", list(range(9001, 9001 + 2 * bs)), rid="s")
        assert short.announcer.flush() == 2
        assert len(a.announcer.ann.list()) == 2
        time.sleep(3.0)
        before = stats.snapshot()
        c.announcer.poll()
        assert [b.name for b in a.announcer.ann.list()] == [batch], _delta(before)
        assert _delta(before).get("announce_expired_batches") == 1, _delta(before)
        # and the 3 fresh blocks keep their credit
        assert len(c.announcer.live()) == 3
    finally:
        a_pool.close()
        c_pool.close()
        proxy.close()


def test_a_refused_probe_is_not_written_again_each_poll_where_the_store_states_a_time(tmp_path, seaweed, s3_prefix):
    """A guard for the fix above (passes on the old code too, which probed no S3 store): a poller that may not write
    the probe object (a read-only bucket) goes by the stated time and tries the probe again only after
    ``CLOCK_REMEASURE_S``, not on every poll and flush."""
    host, port = seaweed.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = DateProxy(host, int(port), 0.0)  # an honest Date
    proxy.refuse_puts = CLOCK_PROBE_PREFIX
    kw = {"url": seaweed.url(s3_prefix), "timeout_s": 60.0, "dir_fanout": 16, "announce": True,
          "keyring": {"path": str(tmp_path / "keys" / "keyring.json")}}
    a_pool = G4Pool(G4Config(**kw, endpoint_url=seaweed.endpoint), namespace())
    c_pool = G4Pool(G4Config(**kw, endpoint_url=proxy.endpoint), namespace())
    try:
        a, c = _worker(a_pool), _worker(c_pool)
        bs = namespace().layout.page_size
        _save(a_pool, a, "tenant-x", list(range(7001, 7001 + 2 * bs)))
        assert a.announcer.flush() == 2
        assert c.announcer.poll() == (2, 0)
        for _ in range(3):
            assert c.announcer.poll() == (0, 0)
        probe_puts = [r for r in proxy.requests if r[0] == "PUT" and CLOCK_PROBE_PREFIX in r[1]]
        assert len(probe_puts) <= 1, probe_puts
        assert len(a.announcer.ann.list()) == 1 and list(a_pool.store.list(CLOCK_PROBE_PREFIX)) == []
    finally:
        a_pool.close()
        c_pool.close()
        proxy.close()
