"""Never stall prefill (docs/invariants.md #3): while the G3 pool cannot answer lookups (its lock held across a
journal write on a stalled drive), requests posted together, or in consecutive steps, cost about one
``job_timeout_s`` in RETRY, not one each. vLLM's ``AsyncLookupManager`` worker runs a batch's requests one after
another; before 2026-12-01 each had its own ``job_timeout_s`` and asked the pool (review repro t1: 6 requests,
2 s: each resolved after 12 s; 8 at the default 60 s: 8 minutes). Now a batch has one deadline from when it was
posted, and after a timed-out lookup the tier answers misses without asking the pool until it answered.

No durations are asserted: the pool's own ``lookups_deferred`` counts the lookups handed to it while its lock was
held, and the verdicts must all arrive while the journal write is still held (``GUARD_S`` is a hang guard). G4Tier
against an S3 endpoint that never answers: the HEADs that reached it are counted."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402

from tests.integrations.vllm.test_tiering import g3_tier, harnesses, keys_for, payloads  # noqa: E402,F401
from tests.integrations.vllm.test_tiering_lock_stall import GUARD_S, _stall_a_delete  # noqa: E402

pytestmark = [pytest.mark.vllm]

N = 6


@pytest.mark.parametrize("arrival", ["one_step", "step_by_step"])
def test_requests_posted_while_the_pool_lock_is_held_ask_the_pool_once(tmp_path, harnesses,  # noqa: F811
                                                                       monkeypatch, arrival):
    h = harnesses([g3_tier(tmp_path / "g3", job_timeout_s=1.0)])
    tier, pool = h.tier, h.tier.pool
    held = keys_for(1, "held")
    h.store(held, payloads(h, 1))
    h.wait_idle(timeout=GUARD_S)
    reqs = []
    for i in range(N):
        ctx = h.context(f"r{i}")
        h.manager.on_new_request(ctx)
        ks = keys_for(2, f"req{i}")
        for j, k in enumerate(ks):
            ctx.set_offload_key_position(k, j + 1)
        reqs.append((ctx, ks))
    deferred0 = pool.stats()["lookups_deferred"]
    hold, deleter, deleted = _stall_a_delete(monkeypatch, pool, tier._block_keys(held[0], ""))
    try:
        for ctx, ks in reqs:
            assert [h.manager.lookup(k, ctx) for k in ks] == [LookupResult.RETRY] * 2
            if arrival == "step_by_step":
                h.step()
        h.step()
        verdicts: dict[str, LookupResult] = {}
        end = time.monotonic() + GUARD_S
        while len(verdicts) < N and time.monotonic() < end:  # hang guard only
            for ctx, ks in reqs:
                r = h.manager.lookup(ks[0], ctx)
                if r is not LookupResult.RETRY:
                    verdicts[ctx.req_id] = r
            h.step()
            time.sleep(0.01)
        still_held = not hold.released.is_set() and pool.cat.lock.locked()
        asked = pool.stats()["lookups_deferred"] - deferred0
    finally:
        hold.release()
    assert deleted.wait(GUARD_S)
    deleter.join(GUARD_S)
    assert verdicts == {ctx.req_id: LookupResult.MISS for ctx, _ in reqs}, verdicts
    assert still_held  # every verdict came while the journal write still held the pool's lock
    # one lookup handed to the stalled pool (a second at most: a probe once the back-off ended), not one per request
    assert asked <= 2, f"{asked} lookups waited for the pool's lock for {N} requests"
    st = tier.kvbm_stats()["tier"]
    assert 1 <= st["lookups_timed_out"] <= asked and st["lookups_not_asked"] >= N - asked, st
    for ctx, _ in reqs:
        h.manager.on_request_finished(ctx)


class _Hanging:
    """An S3 endpoint on loopback that reads requests and never answers (a hung G4 store); ``heads`` counts the
    object HEADs that reached it. :meth:`close` drops every connection (the client's requests then fail)."""

    def __init__(self) -> None:
        import socket
        import threading
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        self.heads: list[bytes] = []
        self.conns: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._read, args=(c,), daemon=True).start()

    def _read(self, c) -> None:
        try:
            while d := c.recv(65536):
                self.heads += [ln for ln in d.split(b"\r\n") if ln.startswith(b"HEAD ") and ln.count(b"/") > 2]
        except OSError:
            return

    def close(self) -> None:
        self.srv.close()
        for c in self.conns:
            c.close()


def test_g4_lookups_against_a_hanging_endpoint_ask_it_once(tmp_path, harnesses, monkeypatch):  # noqa: F811
    """The same for G4Tier: 6 requests posted together while the S3 endpoint answers nothing send the first
    request's HEADs only (before 2026-12-01: every request's, each waiting its own ``job_timeout_s``)."""
    from tests.integrations.vllm.test_tiering import GEO, MOD
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "kvbm-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "kvbm-test")
    ep = _Hanging()
    try:
        h = harnesses([{"type": "G4Tier", "module_path": MOD, "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2,
                        "job_timeout_s": 1.0, "g4": {"url": "s3://kvbm-test/hang", "endpoint_url": ep.endpoint,
                                                     "timeout_s": 5.0, "retries": 0, "encrypt": False}}])
        reqs = []
        for i in range(N):
            ctx = h.context(f"r{i}")
            h.manager.on_new_request(ctx)
            ks = keys_for(2, f"g4req{i}")
            for j, k in enumerate(ks):
                ctx.set_offload_key_position(k, j + 1)
            assert [h.manager.lookup(k, ctx) for k in ks] == [LookupResult.RETRY] * 2
            reqs.append((ctx, ks))
        h.step()
        verdicts: dict[str, LookupResult] = {}
        end = time.monotonic() + GUARD_S
        while len(verdicts) < N and time.monotonic() < end:  # hang guard only
            for ctx, ks in reqs:
                r = h.manager.lookup(ks[0], ctx)
                if r is not LookupResult.RETRY:
                    verdicts[ctx.req_id] = r
            h.step()
            time.sleep(0.01)
        heads = len(ep.heads)
        assert verdicts == {ctx.req_id: LookupResult.MISS for ctx, _ in reqs}, verdicts
        assert 1 <= heads <= 2 * 2, f"{heads} HEADs sent to the hanging endpoint for {N} requests: {ep.heads}"
        assert h.tier.kvbm_stats()["tier"]["lookups_timed_out"] == 1
        for ctx, _ in reqs:
            h.manager.on_request_finished(ctx)
    finally:
        ep.close()
