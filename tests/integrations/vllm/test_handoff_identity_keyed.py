"""The hand-off's identity (:mod:`kvbm_backend.integrations.vllm.handoff_ident`) through vLLM's real ``Scheduler`` with
``KvbmBackendConnector``'s scheduler role on both sides, real G3 pools and a real shared G4 ``file://`` store (with a
shared keyring file where the test says so): S keyed under a keyring, and the mismatch WARNINGs of a field flooded with
forged values still naming a real misconfiguration. The worker's part is played by putting the blocks each step's save
jobs name into the pools those jobs are for."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvbm_backend.integrations.vllm import handoff, stats  # noqa: E402
from kvbm_backend.integrations.vllm.handoff import KEY  # noqa: E402
from kvbm_backend.log_limits import LimitedLog  # noqa: E402
from kvbm_backend.model.hashing import salt_bytes, salt_hash  # noqa: E402
from tests.helpers.vllm_handoff import HANG_S, handoff_extra, prefill, step_until  # noqa: E402
from tests.helpers.vllm_sched import runner_output, tiny_scheduler  # noqa: E402

pytestmark = [pytest.mark.vllm]

BS, NBLK = 16, 64


def _scheduler(tmp: Path, name: str, keyring: bool, tenant: str = "") -> Scheduler:
    """vLLM's Scheduler with KvbmBackendConnector (one full-attention group), its own G3 and the shared G4 (with the
    shared keyring file when ``keyring``); ``tenant``: its default tenant."""
    return tiny_scheduler(tmp, handoff_extra(tmp, name, "tiny", keyring=keyring, tenant=tenant),
                          lambda kw, names: [KVCacheGroupSpec(names, FullAttentionSpec(**kw))],
                          block_size=BS, num_blocks=NBLK, batched_tokens=512)


def _lora(name: str) -> LoRARequest:
    return LoRARequest(name, 1 + sum(name.encode()), f"/adapters/{name}")


def _decode(s: Scheduler, rid: str, prompt: list[int], params: dict, hasher, **req) -> None:
    s.add_request(Request(rid, prompt, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None,
                          0, block_hasher=hasher, **req))


def _serve(s: Scheduler) -> None:
    """Step ``s`` (the worker's part: one token per computed prompt) until every request it holds has finished; an
    AssertionError after ``HANG_S`` seconds (a hang guard)."""
    end = time.monotonic() + HANG_S
    while s.has_unfinished_requests():
        assert time.monotonic() < end, "requests never finished"
        so = s.schedule()
        s.update_from_output(so, runner_output(s, so))


@pytest.fixture()
def hasher():
    init_none_hash(sha256_cbor)
    return get_request_block_hasher(BS, sha256_cbor)


def test_a_keyed_g4s_salt_hash_confirms_no_guessed_lora_adapter_and_still_tells_a_mismatch_at_once(tmp_path, hasher):
    """Review finding (2026-12-03): the hand-off's S was the request's salt hash in hex, an unkeyed xxh3 of its
    cache_salt, LoRA adapter name and path and reset epoch, so anyone reading ``kv_transfer_params`` (or the mismatch
    WARNINGs) could confirm a guessed LoRA adapter path or cache_salt by hashing it, though the G4 had a keyring.
    Under a keyring S is now keyed with the tenant's G4 naming key: the decode worker sharing the keyring computes the
    same S (waits for and loads the blocks) and tells another adapter at once (a mismatch, no wait), while a G4
    without a keyring keeps the unkeyed hash (its names are unkeyed too)."""
    prompt = list(range(1000, 1000 + 4 * BS + 3))
    guess = f"{salt_hash(salt_bytes(None, 'sql', '/adapters/sql')):016x}"  # anyone can compute it
    pre, dec, plain = _scheduler(tmp_path, "prefill", keyring=True), None, None
    try:
        params = prefill(pre, prompt, hasher, lora_request=_lora("sql"))
        s = params[KEY]["salt"]
        assert len(s) == 16 and int(s, 16) >= 0
        assert s != guess  # before: == guess (the adapter path confirmed from the params)
        dec = _scheduler(tmp_path, "decode", keyring=True)
        done, mism, timeouts = (stats.get(k) for k in ("handoff_complete_requests", "handoff_identity_mismatches",
                                                       "handoff_timeouts"))
        _decode(dec, "d", prompt, params, hasher, lora_request=_lora("sql"))
        so = step_until(dec, "d", loads=True)
        assert [len(j.block_ids) for j in so.kv_connector_metadata.loads if j.req_id == "d"] == [4]
        assert stats.get("handoff_complete_requests") == done + 1
        # a decode request naming another adapter than its prefill request: no wait, nothing loaded, counted at once
        _decode(dec, "x", prompt, params, hasher, lora_request=_lora("chat"))
        so = step_until(dec, "x", loads=True)
        assert not [j for j in so.kv_connector_metadata.loads if j.req_id == "x"]
        assert so.num_scheduled_tokens["x"] == len(prompt)  # computed whole
        assert stats.get("handoff_identity_mismatches") == mism + 1 and stats.get("handoff_timeouts") == timeouts
        # a G4 without a keyring: S unkeyed, as before (docs/operations.md)
        plain = _scheduler(tmp_path / "plain", "prefill", keyring=False)
        assert prefill(plain, prompt, hasher, lora_request=_lora("sql"))[KEY]["salt"] == guess
    finally:
        for s_ in (pre, dec, plain):
            if s_ is not None:
                s_.shutdown()


def test_a_flood_of_forged_tenant_values_never_hides_a_real_tenant_misconfiguration(tmp_path, hasher, caplog,
                                                                                      monkeypatch):
    """Review finding (2026-12-03): each identity field's mismatch WARNINGs were the first 256 pairs of values, then
    one line a minute for the field. A client's forged ``kv_transfer_params`` (300 decode requests, each another T)
    took T's 256 pairs and then its line every minute, so a real tenant misconfiguration found later (a prefill
    worker of another default tenant: its pair recurs on every hand-off) was never named. Now the field's minute line
    names the pairs seen more than once since its last line; every mismatch is still counted."""
    now = [1000.0]
    monkeypatch.setattr(handoff, "LOG", LimitedLog(handoff.log, clock=lambda: now[0]))
    handoff._warned_pairs.clear()
    prompt = list(range(2000, 2000 + 2 * BS + 1))
    pre, dec = _scheduler(tmp_path, "prefill", keyring=True, tenant="team-a"), None
    try:
        real = prefill(pre, prompt, hasher)  # T: team-a's tag
        dec = _scheduler(tmp_path, "decode", keyring=True, tenant="team-b")  # the misconfiguration: another tenant

        def forged(i: int) -> dict:
            return {KEY: {**real[KEY], "tenant": f"{i:016x}"}}

        mism = stats.get("handoff_identity_mismatches")
        with caplog.at_level(logging.WARNING, logger="kvbm_backend.handoff"):
            for i in range(300):  # the flood: 300 distinct forged tenant tags
                _decode(dec, f"f{i}", prompt, forged(i), hasher)
            _serve(dec)
            for i, rid in enumerate(("r1", "r2")):  # the real pair, twice, amid more forged ones, within the minute
                _decode(dec, rid, prompt, real, hasher)
                for j in range(20):
                    _decode(dec, f"g{i}-{j}", prompt, forged(1000 + 100 * i + j), hasher)
                _serve(dec)
            now[0] += 61.0
            _decode(dec, "late", prompt, forged(5000), hasher)  # the field's next line is due: a forged one's
            _serve(dec)
        msgs = [r.getMessage() for r in caplog.records if "prefilled under" in r.getMessage()]
        assert stats.get("handoff_identity_mismatches") == mism + 343  # every one counted
        tag_a, tag_b = real[KEY]["tenant"], handoff.identity(dec.connector.sched.g4, "team-b")["tenant"]
        named = [m for m in msgs if tag_a in m]
        # before: [] (the minute's line was the forged request's alone)
        assert len(named) == 1 and tag_b in named[0] and "2 requests, last r2" in named[0], msgs[256:]
        assert "late" in named[0] and "seen more than once" in named[0]
    finally:
        pre.shutdown()
        if dec is not None:
            dec.shutdown()


def test_a_real_pair_is_named_within_minutes_of_a_flood_far_larger_than_the_sample(monkeypatch, caplog):
    """The field's heavy-hitters summary (:data:`~kvbm_backend.integrations.vllm.handoff_ident.HELD_PAIRS` counters,
    Space-Saving over the mismatches since the field's last line) under a flood of 10,000 distinct forged values a
    minute, ten times its size, the real pair 1 in 1,000 of the mismatches: the field's minute line names it within 3
    minutes, once (then quiet for the hour; the first-sight lines go to the first 256 forged pairs)."""
    from kvbm_backend.integrations.vllm import handoff_ident
    now = [0.0]
    monkeypatch.setattr(handoff, "LOG", LimitedLog(handoff.log, clock=lambda: now[0]))
    handoff._warned_pairs.clear()
    handoff._warned_pairs["tenant"] = handoff_ident.PairBudget()
    ours = {"namespace": "ns", "tenant": "b" * 16}

    def ask(rid: str, tenant: str) -> None:
        req = SimpleNamespace(request_id=rid, kv_transfer_params={KEY: {"blocks": 2, "block_size": BS,
                                                                         "namespace": "ns", "tenant": tenant}})
        assert handoff.expected_blocks(req, BS, ours) is None

    with caplog.at_level(logging.WARNING, logger="kvbm_backend.handoff"):
        n = 0
        for _minute in range(3):
            for i in range(10000):
                n += 1
                ask(f"f{n}", f"{n:016x}")
                if i % 1000 == 50 and n > 300:  # after the first-sight lines
                    ask(f"r{n}", "a" * 16)
            now[0] += 61.0
        ask("late", f"{n + 1:016x}")
    named = [r.getMessage() for r in caplog.records if "a" * 16 in r.getMessage()]
    assert len(named) == 1 and "seen more than once" in named[0], named
