"""The circuit breaker's half-open probe always comes back. Review finding (2026-11-29): an offload that took
the probe and then ended without asking the store (its tenant was revoked: the keyring refused to seal) never
reported, so the breaker stayed half-open for good: every later load a miss and every offload dropped until a
restart. The writer now hands such a probe back, and any probe lapses after ``reset_s``."""
from __future__ import annotations

import time

import numpy as np

from tests.helpers.g4_writer import namespace, payload
from tests.helpers.pools import G4_TIMEOUT_S
from kvbm_backend.config import G4Config
from kvbm_backend.crypto.keyring import Keyring, provider_for
from kvbm_backend.pool.g4.breaker import CircuitBreaker
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.pool.g4.store import StoreUnavailable

HANG_S = 600.0  # a hang guard, not a bound: waits for results and states that must come; returns as soon as they do


def test_a_probe_that_never_reports_lapses_and_release_hands_it_back():
    now = [0.0]
    b = CircuitBreaker(failures=1, reset_s=5.0, clock=lambda: now[0])
    b.failure()
    now[0] = 5.0
    assert b.allow() and not b.allow()  # one probe out
    now[0] = 9.9
    assert not b.allow()  # still its turn
    now[0] = 10.0
    assert b.allow()  # it never reported: lapsed, another request probes
    b.release()
    assert b.allow()  # handed back: the next request probes at once
    b.success()
    assert b.state == "closed"
    b.release()  # no-op while closed
    assert b.state == "closed" and b.allow()


class _FlakyFs(FsStore):
    """A real file store that answers StoreUnavailable (as an unreachable server) while ``down``."""

    down = False

    def _check(self):
        if self.down:
            raise StoreUnavailable("injected outage")

    def put_if_absent(self, name, data):
        self._check()
        return super().put_if_absent(name, data)

    def get_into(self, *a, **kw):
        self._check()
        return super().get_into(*a, **kw)

    def head(self, name):
        self._check()
        return super().head(name)


def test_a_revoked_tenants_offload_does_not_keep_the_breaker_half_open(tmp_path):
    krp = tmp_path / "keys" / "kr.json"
    krp.parent.mkdir()
    kr = Keyring(str(krp), provider_for(str(krp), create=True), create=True)
    kr.create("alice")
    kr.create("bob")
    kr.revoke("bob")
    kr.close()
    ns = namespace()
    bpb = ns.layout.bytes_per_block

    def put(seq, tenant):
        return p.put(ns.keys([seq], tenant=tenant), [payload(seq, tenant, bpb)]).result(timeout=HANG_S)

    store = _FlakyFs(str(tmp_path / "store"))
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", keyring={"path": str(krp)}, breaker_failures=1,
                   breaker_reset_s=0.2, timeout_s=G4_TIMEOUT_S)
    with G4Pool(cfg, ns, store=store) as p:
        assert put(1, "alice").written == 1
        store.down = True
        assert put(2, "alice").dropped == 1 and p.breaker.state == "open"
        store.down = False
        deadline = time.monotonic() + HANG_S
        while p.breaker.state != "half_open" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert put(3, "bob").dropped == 1  # the revoked tenant's offload takes the probe, sends nothing
        assert p.stats()["dropped_revoked_tenant"] == 1
        written = 0
        while not written and time.monotonic() < deadline:  # the next offload probes and closes it
            written = put(4, "alice").written
            time.sleep(0.05)
        assert written == 1 and p.breaker.state == "closed"
        out = [np.zeros(bpb, np.uint8)]
        assert p.get(ns.keys([1], tenant="alice"), out).result(timeout=HANG_S).ok == [True]
        assert np.array_equal(out[0], payload(1, "alice", bpb))
