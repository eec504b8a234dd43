"""The decode side's wait for a prefill -> decode hand-off (:class:`~kvbm_backend.integrations.vllm.handoff.HandoffWaits`,
:class:`SchedulerSide`) over real G3 and G4 pools: what its looks ask G4 (HEADs), when it stops waiting (the G4 circuit
breaker), and how the request's lookup is counted. The wait's clock is the test's (``s.handoff._clock``): no
wall-clock bound; the only real waits are for the pools' threads to answer (hang guards).

Review findings of 2026-11-30 (r3/r3s, r7, r11): every look started from block 0 again every 50 ms (5,312 HEADs for
one request waiting 5 s); the wait ignored an open G4 breaker (+5 s per request through a G4 outage); the request
counted its first look, usually made before the prefill's write landed (all 8 blocks loaded, counted 0 found)."""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import REGISTRY

from kvbm_backend.config import load_config
from kvbm_backend.integrations.tiers import open_tiers
from kvbm_backend.integrations.vllm import handoff, stats
from kvbm_backend.integrations.vllm.handoff import KEY, RETRY_S, HandoffWaits
from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide
from kvbm_backend.model.hashing import sequence_hashes
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from tests.helpers.pools import G3_LOAD_S, G4_TIMEOUT_S, LOOKUP_S
from tests.helpers.seaweed import ANON_ENV

HANG_S = 600.0  # a hang guard, not a bound: waits for answers that must come; returns as soon as they do
BS = 32
NB = 16  # blocks the prefill worker promises
TOKS = list(range(100, 100 + BS * NB + 5))
LAYOUT = KvLayout(2, 2, BS, 64, "bfloat16")
NS = Namespace("m", LAYOUT)


@pytest.fixture(autouse=True)
def _fresh_handoff_log():
    handoff.LOG.reset()
    yield


def _cfg(tmp_path, g4: dict):
    """G3 in ``tmp_path / "g3"`` and G4 (``g4``: its settings), their load bounds no subject (G3_LOAD_S, G4_TIMEOUT_S;
    ``g4`` may name another ``timeout_s``)."""
    return load_config({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 0.1, "files_per_path": 1,
                               "admission": {"policy": "all"}, "load_timeout_s": G3_LOAD_S},
                        "g4": {"enabled": True, "encrypt": False, "timeout_s": G4_TIMEOUT_S, **g4}}, use_env=False)


def _side(*a, **kw) -> SchedulerSide:
    """A :class:`SchedulerSide` whose lookups resolve within LOOKUP_S, not the class's 2 s (no subject here: a lookup
    the busy CI VM froze for longer answered 0 blocks and ended a wait these tests count)."""
    kw.setdefault("lookup_timeout_s", LOOKUP_S)
    return SchedulerSide(*a, **kw)


@pytest.fixture()
def tiers(tmp_path):
    g3, g4 = open_tiers(_cfg(tmp_path, {"url": f"file://{tmp_path / 'g4'}"}), NS)
    yield g3, g4
    g3.close()
    g4.close()


def _req(rid: str, blocks: int = NB):
    return SimpleNamespace(request_id=rid, prompt_token_ids=TOKS, cache_salt=None, lora_request=None,
                           kv_transfer_params={KEY: {"blocks": blocks, "block_size": BS}})


def _put(g4, a: int, b: int) -> None:
    keys = NS.keys(sequence_hashes(TOKS, BS)[a:b])
    assert g4.put(keys, [np.full(LAYOUT.bytes_per_block, i, np.uint8) for i in range(a, b)]).result(HANG_S).written \
        == b - a


class _Recorder:
    """Pass-through counters on the real G4 pool: every HEAD its store gets, and the length of every lookup."""

    def __init__(self, g4):
        self.heads: list[str] = []
        self.asked: list[int] = []
        self.looks: list = []  # the lookups' futures
        store = g4.lookups.store
        real_head, real_lookup = store.head, g4.lookup_prefix
        store.head = lambda name: self.heads.append(name) or real_head(name)

        def lookup_prefix(keys, *, request=True):
            self.asked.append(len(keys))
            self.looks.append(real_lookup(keys, request=request))
            return self.looks[-1]
        g4.lookup_prefix = lookup_prefix


def _on_clock(g3, g4, wait_s: float):
    """A scheduler side over ``g3``/``g4`` whose hand-off waits run on the returned clock (``now[0]`` seconds)."""
    s = _side(NS, BS, g3, g4, handoff_wait_s=wait_s)
    now = [0.0]
    s.handoff._clock = lambda: now[0]
    return s, now


def _wait_out(s, req, now, step_s=0.01, on_look=None):
    """Ask as vLLM's scheduler does, the wait's clock moving ``step_s`` per ask, until an answer; returns it."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < HANG_S:
        n, is_async = s.get_num_new_matched_tokens(req, 0)
        if n is not None:
            return n, is_async
        if on_look is not None:
            on_look()
        now[0] += step_s
        time.sleep(0.002)  # the pools' threads answer the lookups in flight
    raise AssertionError("no answer")


def test_a_waiting_request_asks_g4_only_beyond_the_prefix_it_found_and_backs_off(tiers):
    """12 of 16 promised blocks in G4 and the rest never coming: the first look HEADs the 16 blocks, every later one
    only the 4 missing (before: the 16 again, every 50 ms), and the looks back off (RETRY_S: 9 looks in 2 s of the
    wait's clock instead of 40)."""
    g3, g4 = tiers
    _put(g4, 0, 12)
    rec = _Recorder(g4)
    s, now = _on_clock(g3, g4, 2.0)
    n, _ = _wait_out(s, _req("w1"), now)
    assert n == 12 * BS  # what is there, at the end of the wait; the engine computes the rest
    assert rec.asked[0] == NB and rec.asked[1:] and set(rec.asked[1:]) == {NB - 12}, rec.asked
    assert len(rec.heads) == NB + (NB - 12) * (len(rec.asked) - 1), (len(rec.heads), rec.asked)
    # looks at 0, 0.05, 0.15, 0.35, 0.75, 1.15, 1.55, 1.95 and 2.0 (the wait's end) of the wait's clock, +- one ask
    assert len(rec.asked) <= 10, rec.asked


def test_retry_schedule_backs_off_resets_on_progress_and_stops_at_the_waits_end():
    """After a look that found more blocks than the request's looks before, the next one comes RETRY_S[0] later;
    each look in a row that found nothing new doubles it, to RETRY_S[-1]; no look is planned past the wait's end."""
    now = [0.0]
    w = HandoffWaits(wait_s=2.0, clock=lambda: now[0])
    assert w.may_look("r")  # the first look: at once
    expect = [0.05, 0.1, 0.2, 0.4, 0.4, 0.05, 0.1, 0.2, 0.4, 0.1]  # the last cut at the wait's end (2.0)
    for found, delay in zip((3, 3, 3, 3, 3, 5, 5, 5, 5, 5), expect):
        assert w.should_wait("r", found, 8)
        assert not w.may_look("r")
        t = now[0]
        now[0] = t + delay * 0.99
        assert not w.may_look("r"), (found, delay)
        now[0] = t + delay + 1e-9
        assert w.may_look("r"), (found, delay)
    assert now[0] == pytest.approx(2.0)
    timeouts = stats.get("handoff_timeouts")
    assert not w.should_wait("r", 5, 8) and stats.get("handoff_timeouts") == timeouts + 1
    assert RETRY_S == (0.05, 0.1, 0.2, 0.4)


def test_a_handed_off_request_counts_the_look_that_ended_its_wait(tiers):
    """The prefill's write lands after the decode's first look (the usual order): the request counts every block it
    found and loads (before: its first look's 0 found, so g4_found_blocks, lookup_hits, kvbm_matched_tokens and the
    G4 hit rate said a miss), and it counts once."""
    g3, g4 = tiers
    _put(g4, 0, 4)
    rec = _Recorder(g4)
    s, now = _on_clock(g3, g4, 600.0)
    keys = ("lookup_requests", "lookup_blocks", "g3_found_blocks", "g4_found_blocks", "handoff_complete_requests")
    before = {k: stats.get(k) for k in keys}
    pool_before = g4.stats()
    tokens_before = REGISTRY.get_sample_value("kvbm_matched_tokens_total") or 0.0
    landed = []

    def land_after_the_first_look():
        if not landed and rec.looks and rec.looks[0].done():  # it found the first 4 and the wait goes on
            assert rec.looks[0].result() == 4
            landed.append(True)
            _put(g4, 4, NB)
    n, is_async = _wait_out(s, _req("w2"), now, on_look=land_after_the_first_look)
    assert landed and (n, is_async) == (NB * BS, True)
    got = {k: stats.get(k) - before[k] for k in keys}
    assert got == {"lookup_requests": 1, "lookup_blocks": NB, "g3_found_blocks": 0, "g4_found_blocks": NB,
                   "handoff_complete_requests": 1}, got
    pool = g4.stats()
    assert pool["lookups"] - pool_before.get("lookups", 0) == 1
    assert pool["lookup_hits"] - pool_before.get("lookup_hits", 0) == NB
    assert (REGISTRY.get_sample_value("kvbm_matched_tokens_total") or 0.0) - tokens_before == NB * BS
    assert s.get_num_new_matched_tokens(_req("w2"), 0) == (NB * BS, True)  # asked again (a preemption): not recounted
    assert stats.get("lookup_requests") - before["lookup_requests"] == 1


def test_a_handed_off_request_the_engines_prefix_cache_covers_counts_its_local_hit_blocks_once(tiers):
    """Review finding 2026-11-30: a handed-off request whose every block the engine's prefix cache held (no look
    needed) ended its wait uncounted (``local_hit_blocks`` missed it). It counts once, with its local blocks."""
    g3, g4 = tiers
    s = _side(NS, BS, g3, g4, handoff_wait_s=600.0)
    keys = ("lookup_requests", "lookup_blocks", "local_hit_blocks", "g3_found_blocks", "g4_found_blocks")
    before = {k: stats.get(k) for k in keys}
    assert s.get_num_new_matched_tokens(_req("cov"), NB * BS) == (0, False)
    assert s.get_num_new_matched_tokens(_req("cov"), NB * BS) == (0, False)  # asked again: not recounted
    got = {k: stats.get(k) - before[k] for k in keys}
    assert got == {"lookup_requests": 1, "lookup_blocks": NB, "local_hit_blocks": NB, "g3_found_blocks": 0,
                   "g4_found_blocks": 0}, got


def test_the_wait_ends_at_once_when_g4s_breaker_is_open(tmp_path, caplog, monkeypatch):
    """G4 refusing connections (nothing listens at its endpoint), its breaker open: a handed-off request stops waiting at its first look (counted
    handoff_timeouts and handoff_breaker_timeouts, one WARNING) instead of looking again for handoff_wait_s (the
    wait's clock never moves here: before, the request waited for good). A store that answers again (the breaker
    closed) is waited for as before."""
    for k, v in ANON_ENV.items():  # credentials, so the client connects (and is refused)
        monkeypatch.setenv(k, v)
    cfg = _cfg(tmp_path, {"url": "s3://kvbm-test/p", "endpoint_url": "http://127.0.0.1:9", "timeout_s": 0.5,
                          "retries": 0, "breaker_reset_s": 3600})
    g3, g4 = open_tiers(cfg, NS)
    try:
        t0 = time.monotonic()
        while g4.breaker.state != "open":  # the start-up probe finds nothing listening and opens it
            assert time.monotonic() - t0 < HANG_S, g4.breaker.state
            time.sleep(0.01)
        s = _side(NS, BS, g3, g4, handoff_wait_s=600.0)
        s.handoff._clock = lambda: 0.0
        before = {k: stats.get(k) for k in ("handoff_timeouts", "handoff_breaker_timeouts", "lookup_requests")}
        rejected = g4.breaker.rejected
        with caplog.at_level(logging.WARNING, logger="kvbm_backend.handoff"):
            for i in range(3):
                req = _req(f"b{i}")
                answers = [s.get_num_new_matched_tokens(req, 0) for _ in range(50)]
                assert answers[0] == (0, False) and set(answers) == {(0, False)}, answers[:3]
                s.request_finished(req, [])
        assert stats.get("handoff_timeouts") - before["handoff_timeouts"] == 3
        assert stats.get("handoff_breaker_timeouts") - before["handoff_breaker_timeouts"] == 3
        assert stats.get("lookup_requests") - before["lookup_requests"] == 3
        assert g4.breaker.rejected - rejected == 3  # one look per request
        msgs = [r.getMessage() for r in caplog.records if "circuit breaker open" in r.getMessage()]
        assert len(msgs) == 1 and "b0" in msgs[0], msgs
    finally:
        g3.close()
        g4.close()


def test_a_promised_block_cooling_after_a_failed_load_ends_the_wait_once_the_blocks_before_it_are_there(tiers, caplog):
    """Review finding (2026-11-30): a load of the promised prefix missed block 10 (the worker's report), so for
    ``FAILED_BLOCK_COOLDOWN_S`` every lookup's hit ends before it (``lookup_failed_block_cuts``). A handed-off
    request of that prefix then never found more than 10 of its 16 blocks, whatever G4 held: it waited the whole
    ``handoff_wait_s`` (600 s of the wait's clock here), a look every 400 ms each counting another cut, and its
    WARNING asked whether the prefill's write-behind kept up although every block was there. Now its wait ends at
    the look that finds every block before the cooling one (counted ``handoff_timeouts`` and
    ``handoff_cooled_timeouts``, 0 s waited, one cut counted); one that finds fewer waits for those as before."""
    from kvbm_backend.integrations.vllm.metadata import FailedLoad
    g3, g4 = tiers
    hs = sequence_hashes(TOKS, BS)
    s, now = _on_clock(g3, g4, 600.0)
    s.failed_blocks.cooldown_s = HANG_S  # cooling for the whole test, however slow the machine
    s.loads_failed([FailedLoad("earlier", "", hs[10], "miss")])  # an earlier request's load of block 10 missed
    keys = ("handoff_timeouts", "handoff_cooled_timeouts", "handoff_wait_s", "handoff_complete_requests",
            "lookup_failed_block_cuts")
    before = {k: stats.get(k) or 0 for k in keys}
    _put(g4, 0, NB)  # the prefill worker's blocks, every one of them there
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.handoff"):
        n, _ = _wait_out(s, _req("c1"), now, step_s=1.0)
    assert n == 10 * BS  # the load stops before the cooling block: the engine computes from it
    got = {k: (stats.get(k) or 0) - before[k] for k in keys}
    assert got == {"handoff_timeouts": 1, "handoff_cooled_timeouts": 1, "handoff_wait_s": 0.0,
                   "handoff_complete_requests": 0, "lookup_failed_block_cuts": 1}, got  # before: wait_s 600, cuts 600+
    msgs = [r.getMessage() for r in caplog.records if "c1" in r.getMessage()]
    assert len(msgs) == 1 and "block 10" in msgs[0] and "keeping up" not in msgs[0], msgs


def test_a_request_waits_for_the_blocks_before_a_cooling_one(tiers):
    """The same cooling block 10, but only 4 blocks there at the first look: the request waits (the blocks before
    the cooling one may still land), and its wait ends at the look that finds the 10, not at handoff_wait_s."""
    from kvbm_backend.integrations.vllm.metadata import FailedLoad
    g3, g4 = tiers
    _put(g4, 0, 4)
    rec = _Recorder(g4)
    s, now = _on_clock(g3, g4, 600.0)
    s.failed_blocks.cooldown_s = HANG_S  # cooling for the whole test, however slow the machine
    s.loads_failed([FailedLoad("earlier", "", sequence_hashes(TOKS, BS)[10], "miss")])
    keys = ("handoff_timeouts", "handoff_cooled_timeouts", "handoff_wait_s")
    before = {k: stats.get(k) or 0 for k in keys}
    req, t0 = _req("c2"), time.monotonic()
    while (ans := s.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() - t0 < HANG_S, "no answer"
        if rec.looks and all(f.done() for f in rec.looks):  # the wait's clock moves between G4's looks only
            if len(rec.looks) == 1:
                assert rec.looks[0].result() == 4
                _put(g4, 4, NB)  # the prefill's write lands after the first look
            now[0] += 0.5
        time.sleep(0.002)
    assert ans[0] == 10 * BS
    got = {k: (stats.get(k) or 0) - before[k] for k in keys}
    assert got["handoff_timeouts"] == 1 and got["handoff_cooled_timeouts"] == 1, got
    assert got["handoff_wait_s"] < 600.0, got  # ended at a look, not at the wait's end (before: 600)
