"""``kvbm-backend keys revoke`` reaches the native G3 tier (vLLM's ``secondary_tiers``: :class:`G3Tier`), as it reaches
the connector's G3 (tests/integrations/vllm/test_revoked_tenants.py; :mod:`kvbm_backend.integrations.vllm.tier_revoked`,
docs/configuration.md "Revocation and G3").

Before 2026-12 a G3Tier opened no keyring: a revoked tenant's G3 chunks (local plaintext) were still looked up,
loaded and stored, until evicted and across restarts. Now a G3Tier follows the keyring its config names
(``g4.keyring.path``), else the one of a G4Tier beside it in the same tiering manager: once its keyring check sees
the revocation, the tenant's lookups miss without asking G3, its loads read nothing, its stores are not put, and its
G3 blocks are deleted (those restored by tag after a restart as the tier starts, by G3's tenant labels); other
tenants' chunks stay and are served; after ``keys create`` the re-created tenant's new chunks are stored and served.

Real parts: vLLM's TieringOffloadingSpec and manager building our tiers from ``module_path`` (CPU primary tier, no
engine: :class:`~kvbm_backend.integrations.vllm.tiering_harness.TieringHarness`), real G3 files, a keyring file
changed by the ``kvbm-backend keys`` CLI as an operator would (another keyring instance on the same file). The
tier's keyring checks run on its check thread and are waited for (``check_now``), never slept for.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from typer.testing import CliRunner  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from kvbm_backend.apps.cli import app  # noqa: E402
from kvbm_backend.config import ConfigError  # noqa: E402
from kvbm_backend.pool.g3.index import TagKey, tag_of  # noqa: E402
from tests.integrations.vllm import test_tiering  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, HANG_S, MOD, _resolve, g3_tier, keys_for, payloads  # noqa: E402

pytestmark = [pytest.mark.vllm]

harnesses = test_tiering.harnesses  # the fixture: TieringHarness makers, shut down after the test
ACME, GLOBEX = "acme", "globex"
N = 4  # chunks per tenant (one block each: TP 1)
NEVER_S = 300  # the keyring's reload interval (its most): the tier's own checks never run here, check_now does


@pytest.fixture
def kek(monkeypatch):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)  # the KEK file beside the keyring, as the CLI finds it


def _keys(tenant: str, *args: str, kr: str) -> None:
    """``kvbm-backend keys <args> --keyring kr --tenant tenant``: the operator's command, its own keyring instance."""
    r = CliRunner().invoke(app, ["keys", *args, "--keyring", kr, "--tenant", tenant, "--json"])
    assert r.exit_code == 0, r.output


def _ctx(h, tenant: str):
    return h.context(kv_transfer_params={"kvbm_tenant": tenant})


def _held(tier, keys, tenant: str) -> int:
    """How many of ``keys`` (chunks) ``tier``'s G3 holds for ``tenant`` (index look-ups: restored keys by tag too)."""
    return sum(all(tier.pool.contains(bk) for bk in tier._block_keys(k, tenant)) for k in keys)


def _check(tier) -> None:
    """The tier's keyring check, now (its own runs every ``g4.keyring.reload_interval_s``), and the purges it finds
    due, waited for. A tier that follows no keyring (the code before 2026-12) has none to run."""
    rev = getattr(tier, "_revoked", None)
    if rev is not None:
        rev.keyring.reload_every_s = 0  # the CLI's change is read at this check (the bound: keyring tests)
        rev.gate.check_now(HANG_S)


def _counts(tier) -> tuple:
    st = tier.kvbm_stats()["tier"]
    return tuple(st.get(n, 0) for n in ("g3_revoked_purges", "g3_revoked_deleted_blocks", "lookup_g3_revoked",
                                        "load_g3_revoked_blocks", "save_g3_revoked_blocks"))


def _load_job(tier, job_id: int, keys, chunk_ids, ctx):
    """Run one load job of ``keys`` into primary chunks ``chunk_ids`` (one vLLM submitted, e.g. before the check saw
    the revocation); its JobResult."""
    tier.submit_load(TransferJob(job_id, keys, np.array(chunk_ids), True, ctx))
    end = time.monotonic() + HANG_S
    while True:
        done = [r for r in tier.get_finished_jobs() if r.job_id == job_id]
        if done:
            return done[0]
        assert time.monotonic() < end, "load job never finished"
        time.sleep(0.002)


def _tiers(tmp_path, kr: str, **kw) -> list[dict]:
    return [g3_tier(tmp_path / "g3", g4={"keyring": {"path": kr, "reload_interval_s": NEVER_S}}, **kw)]


def test_a_revoked_tenant_is_neither_looked_up_nor_loaded_nor_stored_nor_kept_by_the_g3_tier(tmp_path, kek, harnesses,
                                                                                              caplog):
    """acme's and globex's chunks are in the G3 tier (its config names the keyring); a request of acme has G3 hits
    cached; acme is revoked with the CLI. After the tier's keyring check: acme's G3 blocks are deleted (logged once,
    counted) and stay gone across a restart, the cached hits are misses (the pool not asked), a load job submitted
    before the check reads nothing and leaves the primary untouched, acme's new stores are not put; globex is served
    from G3 as before, its own bytes. Before the fix G3 kept, offered and loaded acme's chunks and stored new ones."""
    kr = str(tmp_path / "keys" / "keyring.json")
    for t in (ACME, GLOBEX):
        _keys(t, "create", kr=kr)
    h = harnesses(_tiers(tmp_path, kr))
    tier = h.tier
    ka, kg, ka2 = keys_for(N, "acme"), keys_for(N, "globex"), keys_for(N, "acme-next")
    da, dg = payloads(h, N, seed=1), payloads(h, N, seed=2)
    h.store(ka, da, ctx=_ctx(h, ACME))
    h.store(kg, dg, ctx=_ctx(h, GLOBEX))
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()  # every later load comes from G3
    assert _held(tier, ka, ACME) == N and _held(tier, kg, GLOBEX) == N
    cached = _ctx(h, ACME)
    tier.on_new_request(cached)
    assert set(_resolve(tier, cached, ka).values()) == {LookupResult.HIT}  # cached G3 hits

    _keys(ACME, "revoke", kr=kr)
    with caplog.at_level(logging.INFO, logger="kvbm_backend.connector"):
        _check(tier)
    assert _held(tier, ka, ACME) == 0, "the revoked tenant's chunks are still in G3"
    assert _held(tier, kg, GLOBEX) == N
    assert _counts(tier)[:2] == (1, N)
    assert caplog.text.count("blocks of revoked tenant pseudonym") == 1, caplog.text
    assert f"deleted {N} blocks of revoked tenant pseudonym" in caplog.text and ACME not in caplog.text
    read = tier.pool.stats()["bytes_read"]
    assert {tier.lookup(k, cached) for k in ka} == {LookupResult.MISS}  # the cached hits too
    assert _counts(tier)[2] == 1  # one request
    h.primary[7:7 + N] = 0xA5
    res = _load_job(tier, 901, ka, list(range(7, 7 + N)), cached)  # submitted before the check, run after it
    assert not res.success and not res.successful_keys
    assert _counts(tier)[3] == N and tier.pool.stats()["bytes_read"] == read  # nothing read
    assert (h.primary[7:7 + N] == 0xA5).all()
    tier.on_request_finished(cached)
    assert h.load(ka, ctx=_ctx(h, ACME), timeout=HANG_S) == []  # a new request: missed, G3 not asked
    assert _counts(tier)[2] == 2 and tier.pool.stats()["bytes_read"] == read
    h.store(ka2, da, ctx=_ctx(h, ACME))  # the revoked tenant's next chunks
    h.wait_idle(timeout=HANG_S)
    assert _held(tier, ka2, ACME) == 0 and _counts(tier)[4] == N
    got = h.load(kg, ctx=_ctx(h, GLOBEX), timeout=HANG_S)  # another tenant: G3 as before
    assert len(got) == N and all(np.array_equal(a, b) for a, b in zip(got, dg))
    _check(tier)  # once per revocation: a later check deletes nothing more
    assert _counts(tier)[:2] == (1, N) and _held(tier, kg, GLOBEX) == N
    h.shutdown()
    again = harnesses(_tiers(tmp_path, kr))  # a restart finds none of acme's blocks
    tags = {k.tag if type(k) is TagKey else tag_of(k.tenant) for k in again.tier.pool.keys()}
    assert tag_of(ACME) not in tags and tag_of(GLOBEX) in tags


def test_blocks_restored_by_tag_of_a_tenant_revoked_while_down_are_purged_when_the_tier_starts(
        tmp_path, kek, harnesses):
    """acme and globex stored; the engine stops; acme is revoked meanwhile; a new engine's G3 tier restores both
    tenants' blocks by tag only (no tenant id in its journal), and G3's tenant labels (:mod:`kvbm_backend.pool.g3.
    tenant_labels`) name acme's tag: the tier deletes acme's restored blocks as it starts, before any request of acme
    (before the fix they stayed until acme's first request or their eviction). acme's request misses; globex's chunks
    stay and are served. ``keys create`` of acme then stores and serves its new chunks."""
    kr = str(tmp_path / "keys" / "keyring.json")
    for t in (ACME, GLOBEX):
        _keys(t, "create", kr=kr)
    h = harnesses(_tiers(tmp_path, kr))
    ka, kg = keys_for(N, "acme"), keys_for(N, "globex")
    da, dg = payloads(h, N, seed=3), payloads(h, N, seed=4)
    h.store(ka, da, ctx=_ctx(h, ACME))
    h.store(kg, dg, ctx=_ctx(h, GLOBEX))
    h.wait_idle(timeout=HANG_S)
    h.shutdown()
    _keys(ACME, "revoke", kr=kr)  # while the engine is down
    h = harnesses(_tiers(tmp_path, kr))
    tier = h.tier
    restored = tier.pool.keys()
    assert tier.pool.stats()["restored_blocks"] == 2 * N
    assert len(restored) == N and all(type(k) is TagKey and k.tag != tag_of(ACME) for k in restored)
    assert _counts(tier)[:2] == (1, N)
    _check(tier)
    assert h.load(ka, ctx=_ctx(h, ACME), timeout=HANG_S) == [], "the revoked tenant's restored chunks were served"
    rev = getattr(tier, "_revoked", None)
    assert rev is not None
    rev.gate.drain(HANG_S)
    assert _counts(tier)[:3] == (1, N, 1)  # purged once in this process: acme's first sighting finds it done
    got = h.load(kg, ctx=_ctx(h, GLOBEX), timeout=HANG_S)
    assert len(got) == N and all(np.array_equal(a, b) for a, b in zip(got, dg))
    _keys(ACME, "create", kr=kr)  # re-created: a new key, the same pseudonym
    _check(tier)
    h.reset_primary()
    ka2, da2 = keys_for(N, "acme-new"), payloads(h, N, seed=5)
    h.store(ka2, da2, ctx=_ctx(h, ACME))
    h.wait_idle(timeout=HANG_S)
    h.reset_primary()
    got = h.load(ka2, ctx=_ctx(h, ACME), timeout=HANG_S)
    assert len(got) == N and all(np.array_equal(a, b) for a, b in zip(got, da2))
    assert _counts(tier)[0] == 1 and _counts(tier)[4] == 0  # no purge more; nothing of the new tenant refused


def test_a_g3_tier_follows_the_keyring_of_the_g4_tier_beside_it(tmp_path, kek, harnesses):
    """The usual native config names the keyring in the G4Tier's own ``g4`` key only: the G3Tier above it (built
    first) follows that G4Tier's keyring, the same instance, and deletes a revoked tenant's G3 chunks. Before the fix
    it kept and served them."""
    kr = str(tmp_path / "keys" / "keyring.json")
    _keys(ACME, "create", kr=kr)
    g4 = {"type": "G4Tier", "module_path": MOD, "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2,
          "g4": {"url": f"file://{tmp_path / 'g4'}", "keyring": {"path": kr, "reload_interval_s": NEVER_S}}}
    h = harnesses([g3_tier(tmp_path / "g3"), g4])
    g3t, g4t = h.manager.secondary_tiers
    ka, da = keys_for(N, "acme"), payloads(h, N, seed=6)
    h.store(ka, da, ctx=_ctx(h, ACME))
    h.wait_idle(timeout=HANG_S)
    assert _held(g3t, ka, ACME) == N
    _keys(ACME, "revoke", kr=kr)
    _check(g3t)
    assert _held(g3t, ka, ACME) == 0, "the revoked tenant's chunks are still in G3"
    assert g3t._revoked.keyring is g4t.pool.keyring and _counts(g3t)[:2] == (1, N)
    h.reset_primary()
    assert h.load(ka, ctx=_ctx(h, ACME), timeout=HANG_S) == []  # G4 refuses the revoked tenant too


def test_a_g3_tier_without_a_keyring_follows_none_and_one_that_does_not_open_is_refused(tmp_path, kek, harnesses):
    """No keyring named and no G4Tier beside it: the G3Tier follows no revocation (documented) and its counters
    stay 0. A keyring its config names that does not open (here: its KEK file is gone) refuses the tier with an
    error naming ``g4.keyring``, instead of serving revoked tenants."""
    h = harnesses([g3_tier(tmp_path / "g3")])
    assert getattr(h.tier, "_revoked", None) is None and _counts(h.tier) == (0, 0, 0, 0, 0)
    h.shutdown()
    kr = tmp_path / "keys" / "keyring.json"
    _keys(ACME, "create", kr=str(kr))
    (tmp_path / "keys" / "keyring.json.kek").unlink()
    with pytest.raises(ConfigError, match=r"g4\.keyring.*G3Tier follows the revocations"):
        harnesses([g3_tier(tmp_path / "g3", g4={"keyring": {"path": str(kr)}})])
