"""``kvbm-backend keys revoke`` reaches G3 on a worker whose G4 pool has the keyring
(:mod:`kvbm_backend.integrations.revoked_tenants`; docs/configuration.md "Revocation and G3").

Before 2026-12 a revoked tenant's G3 blocks (plaintext, local) were neither checked against the keyring nor
deleted: the same prompt was still offered from G3 and loaded, and new saves were stored, until eviction and across
restarts. Now, once the worker's keyring check sees the revocation: the scheduler's lookup does not ask G3 for the
tenant, the worker loads none of its G3 blocks and stores none, and its G3 blocks are deleted (those restored by tag
after a restart too: as the worker starts, found by G3's tenant labels or the keyring's ids); other tenants' blocks stay; after ``keys create`` the
re-created tenant's new saves are stored and served, and nothing saved before the revocation is.

Real parts: the CPU engine's tensors, the connector's scheduler and worker roles, real G3 files, a ``file://`` G4
store with its keyring file, changed by the ``kvbm-backend keys`` CLI as an operator would (another keyring
instance on the same file). The keyring checks run on the check thread and are waited for (``check_now``).
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402

from kvbm_backend.apps.cli import app  # noqa: E402
from kvbm_backend.config import G4Config  # noqa: E402
from kvbm_backend.integrations.revoked_tenants import RevokedTenants  # noqa: E402
from kvbm_backend.integrations.vllm import stats  # noqa: E402
from kvbm_backend.integrations.vllm.metadata import LoadJob  # noqa: E402
from kvbm_backend.integrations.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvbm_backend.integrations.vllm.worker_side import WorkerSide  # noqa: E402
from kvbm_backend.model.hashing import salt_bytes, salt_hash, sequence_hashes, token_digests  # noqa: E402
from kvbm_backend.model.namespace import Namespace  # noqa: E402
from kvbm_backend.pool.g3.index import TagKey, tag_of  # noqa: E402
from kvbm_backend.pool.g4.pool import G4Pool  # noqa: E402
from tests.helpers.pools import G4_TIMEOUT_S, LOOKUP_S, open_g3  # noqa: E402
from tests.integrations.vllm.test_failed_load_paths import _ask, _plan  # noqa: E402
from tests.integrations.vllm.test_worker_device_path import LOAD_S, _block_bytes, _engine  # noqa: E402

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (a lookup's answer, a load's end, a check)
ACME, GLOBEX = "acme", "globex"
N = 4  # blocks of the prompt that may be loaded
NEVER_S = 3600.0  # the checks' own interval: never reached here, every check is run by the test (check_now)


def _prompt(bs: int, tenant: str) -> tuple[list[int], list[int], bytes]:
    """``(tokens, sequence hashes, token digests)`` of a prompt of ``N`` full blocks plus one token, as the scheduler
    computes them for ``tenant`` (its ``cache_salt``): the same tokens for every tenant, other hashes."""
    toks = list(range(1000, 1000 + N * bs + 1))
    sb = salt_bytes(tenant, None, None)
    return toks, list(sequence_hashes(toks, bs, salt=salt_hash(sb))), bytes(token_digests(toks, bs, sb))[:16 * N]


def _req(rid: str, toks: list[int], tenant: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=toks, cache_salt=tenant, lora_request=None)


def _load(w: WorkerSide, jobs: list) -> set[int]:
    """Run ``jobs`` (one request's); the engine block ids whose load failed."""
    w.start_loads(jobs)
    end = time.monotonic() + HANG_S
    while jobs[0].req_id not in w.get_finished():
        assert time.monotonic() < end, "load never finished"
        time.sleep(0.01)
    return w.load_errors()


def _save(w: WorkerSide, g3, g4, ids: list[int], tenant: str) -> None:
    """The step's save of engine blocks ``ids`` as the prompt's blocks ``0..len(ids)-1`` of ``tenant``."""
    from kvbm_backend.integrations.vllm.metadata import SaveJob
    _, hs, dg = _prompt(w.kv.layout.page_size, tenant)
    w.save([SaveJob(f"save-{tenant}", ids, hs[:len(ids)], tenant, digests=dg[:16 * len(ids)])])
    assert w.flush_saves(HANG_S)
    assert g3.flush(HANG_S) and g4.flush(HANG_S)


def _keys(tenant: str, *args: str, kr: str) -> None:
    """``kvbm-backend keys <args> --keyring kr --tenant tenant``: the operator's command, its own keyring instance."""
    r = CliRunner().invoke(app, ["keys", *args, "--keyring", kr, "--tenant", tenant, "--json"])
    assert r.exit_code == 0, r.output


def _held(g3, ns: Namespace, tenant: str) -> int:
    """How many of ``tenant``'s prompt blocks G3 holds (an index look-up: restored keys by tag too)."""
    hs = _prompt(ns.layout.page_size, tenant)[1][:N]
    return sum(g3.contains(k) for k in ns.keys(hs, tenant, 0))


def _served_from_g3(p, kv, rid: str, tenant: str) -> None:
    """A request ``rid`` of ``tenant``'s prompt is offered all ``N`` blocks from G3 and loads, into engine blocks
    14-17, the bytes the saves of engine blocks 5-8 stored."""
    r = _req(rid, _prompt(p.bs, tenant)[0], tenant)
    assert _ask(p.s, r) == N * p.bs
    jobs = _plan(p.s, r, N * p.bs, [14, 15, 16, 17])
    assert [j.tiers for j in jobs] == [["G3"] * N] and _load(p.w, jobs) == set()
    assert all(torch.equal(_block_bytes(kv, a), _block_bytes(kv, b)) for a, b in zip([14, 15, 16, 17], [5, 6, 7, 8]))


def _delta(before: dict, *names: str) -> list[float]:
    now = stats.snapshot()
    return [now.get(n, 0) - before.get(n, 0) for n in names]


class _Worker:
    """A worker process: its G3 and G4 pools (one keyring file), the worker role and the scheduler role, each role
    with its :class:`RevokedTenants` as the wiring builds them (the worker's purges G3, the scheduler's refuses)."""

    def __init__(self, tmp_path, kv, *, gates: bool = True):
        self.kv, self.bs = kv, kv.layout.page_size
        self.ns = Namespace(model="test/revoked-tenants", revision="r1", layout=kv.layout, tp_world_size=1)
        self.kr = str(tmp_path / "keys" / "keyring.json")
        self.g4 = G4Pool(G4Config(enabled=True, url=f"file://{tmp_path / 'g4'}", keyring={"path": self.kr},
                                  timeout_s=G4_TIMEOUT_S), self.ns)
        assert self.g4.keyring is not None
        self.g4.keyring.reload_every_s = 0  # the CLI's change is read at the next check (the bound: keyring tests)
        self.g3 = open_g3(tmp_path / "g3", self.ns, files_per_path=1, load_timeout_s=LOAD_S)
        kr = self.g4.keyring
        self.wg = RevokedTenants(kr, [self.g3], interval_s=NEVER_S, count=stats.add) if gates else None
        self.sg = RevokedTenants(kr, (), interval_s=NEVER_S, count=stats.add) if gates else None
        self.w = WorkerSide(self.ns, 0, self.g3, self.g4, load_timeout_s=LOAD_S, revoked=self.wg)
        self.w.register(kv)
        self.s = SchedulerSide(self.ns, self.bs, self.g3, self.g4, save=False, lookup_timeout_s=LOOKUP_S)
        self.s.revoked = self.sg

    def check(self) -> None:
        """Both roles' keyring checks, now (and the purges they find due), on their check thread."""
        for g in (self.sg, self.wg):
            if g is not None:
                g.check_now(HANG_S)

    def close(self) -> None:
        for g in (self.sg, self.wg):
            if g is not None:
                g.close()
        self.w.shutdown()
        self.g3.close()
        self.g4.close()


@pytest.fixture
def kek(monkeypatch):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)  # the KEK file beside the keyring, as the CLI finds it


def test_a_revoked_tenant_is_neither_offered_nor_loaded_nor_stored_nor_kept_in_g3(tmp_path, kek):
    """acme's and globex's prompts are in G3 (and G4); acme is revoked with the CLI. After the worker's keyring
    check: acme's G3 blocks are deleted (and stay gone across a G3 restart), the scheduler offers acme's prompt
    nothing (G3 is not asked: G4 misses a revoked tenant), a load planned before the revocation reads none of acme's
    G3 blocks, acme's new saves are not stored in G3; globex is served from G3 as before. Before the fix G3 offered
    and loaded acme's blocks and kept them."""
    kv = _engine("cpu", seed=61)
    p = _Worker(tmp_path, kv)
    try:
        _save(p.w, p.g3, p.g4, [1, 2, 3, 4], ACME)
        _save(p.w, p.g3, p.g4, [5, 6, 7, 8], GLOBEX)
        toks, _, _ = _prompt(p.bs, ACME)
        r0 = _req("r0", toks, ACME)
        assert _ask(p.s, r0) == N * p.bs
        jobs = _plan(p.s, r0, N * p.bs, [10, 11, 12, 13])
        assert [j.tiers for j in jobs] == [["G3"] * N]  # served from G3

        before = stats.snapshot()
        _keys(ACME, "revoke", kr=p.kr)
        p.check()
        assert _held(p.g3, p.ns, ACME) == 0 and _held(p.g3, p.ns, GLOBEX) == N
        assert _delta(before, "g3_revoked_purges", "g3_revoked_deleted_blocks") == [1, N]
        assert _ask(p.s, _req("r1", toks, ACME)) == 0
        assert _delta(before, "lookup_g3_revoked") == [1]
        assert _load(p.w, jobs) == {10, 11, 12, 13}  # planned before the check: not read from G3
        assert _delta(before, "load_g3_revoked_blocks") == [N]
        _save(p.w, p.g3, p.g4, [1, 2, 3, 4], ACME)  # the revoked tenant's next step
        assert _held(p.g3, p.ns, ACME) == 0 and _delta(before, "save_g3_revoked_blocks") == [N]
        g = _req("g", toks, GLOBEX)  # another tenant: G3 as before
        assert _ask(p.s, g) == N * p.bs
        gjobs = _plan(p.s, g, N * p.bs, [14, 15, 16, 17])
        assert [j.tiers for j in gjobs] == [["G3"] * N] and _load(p.w, gjobs) == set()
        assert all(torch.equal(_block_bytes(kv, a), _block_bytes(kv, b)) for a, b in zip([14, 15, 16, 17],
                                                                                         [5, 6, 7, 8]))
        p.check()  # once per revocation: a later check deletes nothing more
        assert _delta(before, "g3_revoked_purges") == [1] and _held(p.g3, p.ns, GLOBEX) == N
    finally:
        p.close()
    g3 = open_g3(tmp_path / "g3", p.ns, files_per_path=1, load_timeout_s=LOAD_S)  # a restart finds none of acme's
    try:
        tags = {k.tag if type(k) is TagKey else tag_of(k.tenant) for k in g3.keys()}
        assert tag_of(ACME) not in tags and tag_of(GLOBEX) in tags and g3.stats()["blocks"] == N
    finally:
        g3.close()


def test_a_tenant_revoked_and_recreated_between_checks_gets_only_its_new_blocks(tmp_path, kek):
    """``keys revoke`` then ``keys create`` of acme before the worker's next keyring check (it never sees acme
    revoked, only the new revocation record): its blocks saved before the revocation are deleted at that check, before
    acme is served again; then its new saves are stored and served (their own bytes), and later checks delete nothing.
    Before the fix the old blocks were served to the re-created tenant."""
    kv = _engine("cpu", seed=62)
    p = _Worker(tmp_path, kv)
    try:
        _save(p.w, p.g3, p.g4, [1, 2, 3, 4], ACME)
        before = stats.snapshot()
        _keys(ACME, "revoke", kr=p.kr)
        _keys(ACME, "create", kr=p.kr)
        p.check()
        assert _held(p.g3, p.ns, ACME) == 0
        assert _delta(before, "g3_revoked_purges", "g3_revoked_deleted_blocks") == [1, N]
        toks, _, _ = _prompt(p.bs, ACME)
        r0 = _req("r0", toks, ACME)  # G4 still names the shredded blocks (until gc), which no load opens
        assert _ask(p.s, r0) == N * p.bs
        jobs = _plan(p.s, r0, N * p.bs, [10, 11, 12, 13])
        assert [j.tiers for j in jobs] == [["G4"] * N] and _load(p.w, jobs) == {10, 11, 12, 13}
        _save(p.w, p.g3, p.g4, [5, 6, 7, 8], ACME)  # the re-created tenant's new KV
        assert _held(p.g3, p.ns, ACME) == N and _delta(before, "save_g3_revoked_blocks") == [0]
        p.check()
        assert _held(p.g3, p.ns, ACME) == N and _delta(before, "g3_revoked_purges") == [1]
        _served_from_g3(p, kv, "r1", ACME)
    finally:
        p.close()


def test_a_revoked_tenant_never_seen_by_the_check_is_found_in_g3s_index_and_purged(tmp_path, kek):
    """Blocks saved before this worker's check knew the tenant (its keyring check never saw a request of acme: here a
    worker role without one saved them): the check that finds acme's revocation record reads the tenant ids of G3's
    index and deletes acme's blocks, globex's stay; nothing waits for acme to send another request."""
    kv = _engine("cpu", seed=63)
    p = _Worker(tmp_path, kv, gates=False)
    try:
        _save(p.w, p.g3, p.g4, [1, 2, 3, 4], ACME)
        _save(p.w, p.g3, p.g4, [5, 6, 7, 8], GLOBEX)
        assert p.g4.keyring is not None
        gate = RevokedTenants(p.g4.keyring, [p.g3], interval_s=NEVER_S, count=stats.add)
        try:
            before = stats.snapshot()
            _keys(ACME, "revoke", kr=p.kr)
            gate.check_now(HANG_S)
            assert _held(p.g3, p.ns, ACME) == 0 and _held(p.g3, p.ns, GLOBEX) == N
            assert _delta(before, "g3_revoked_purges", "g3_revoked_deleted_blocks") == [1, N]
        finally:
            gate.close()
    finally:
        p.close()


def test_blocks_restored_by_tag_of_a_tenant_revoked_while_down_are_purged_at_the_restart(tmp_path, kek):
    """acme and globex saved; the worker stops; acme is revoked while it is down and never sends another request; the
    worker starts again: G3 restores both tenants' blocks by tag only (no tenant id in its journal), and its tenant
    labels (the keyring pseudonym of each tenant seen, kept beside the journal: :mod:`kvbm_backend.pool.g3.tenant_labels`)
    name acme's tag, so the worker deletes acme's restored blocks as it starts, before any request of acme: counted, the
    space reclaimed (a second restart restores globex's alone). acme's later request is offered nothing and a load of
    its G3 blocks reads none; globex is served. ``keys create`` of acme then serves its new saves.
    Before the fix acme's restored blocks stayed (refused, unservable) until acme's next request or their eviction:
    the restart's check deleted nothing (0 purges) and G3 held 2 N blocks."""
    kv = _engine("cpu", seed=64)
    p = _Worker(tmp_path, kv)
    try:
        _save(p.w, p.g3, p.g4, [1, 2, 3, 4], ACME)
        _save(p.w, p.g3, p.g4, [5, 6, 7, 8], GLOBEX)
    finally:
        p.close()
    _keys(ACME, "revoke", kr=p.kr)  # while the worker is down
    before = stats.snapshot()
    p = _Worker(tmp_path, kv)  # the restart: no request, no check run yet
    try:
        assert p.g3.stats()["restored_blocks"] == 2 * N
        assert _delta(before, "g3_revoked_purges", "g3_revoked_deleted_blocks") == [1, N], \
            "the restart kept the restored blocks of a tenant revoked while the worker was down"
        assert not any(type(k) is TagKey and k.tag == tag_of(ACME) for k in p.g3.keys())
        assert p.g3.stats()["blocks"] == N and _held(p.g3, p.ns, GLOBEX) == N
    finally:
        p.close()
    p = _Worker(tmp_path, kv)  # gone for good: a second restart restores globex's blocks alone
    try:
        assert p.g3.stats()["restored_blocks"] == N and _delta(before, "g3_revoked_purges") == [1]
        p.check()
        toks, hs, dg = _prompt(p.bs, ACME)
        assert _ask(p.s, _req("r0", toks, ACME)) == 0
        jobs = [LoadJob("r1", [10, 11, 12, 13], hs[:N], ["G3"] * N, ACME, digests=dg)]  # e.g. planned by a peer
        assert _load(p.w, jobs) == {10, 11, 12, 13}
        p.wg.drain(HANG_S)  # its first sighting in this process purges it once more: nothing left to delete
        assert _delta(before, "g3_revoked_purges", "g3_revoked_deleted_blocks", "load_g3_revoked_blocks") == [2, N, N]
        g = _req("g", toks, GLOBEX)
        assert _ask(p.s, g) == N * p.bs
        gjobs = _plan(p.s, g, N * p.bs, [14, 15, 16, 17])
        assert _load(p.w, gjobs) == set() and all(
            torch.equal(_block_bytes(kv, a), _block_bytes(kv, b)) for a, b in zip([14, 15, 16, 17], [5, 6, 7, 8]))
        _keys(ACME, "create", kr=p.kr)
        p.check()
        _save(p.w, p.g3, p.g4, [1, 2, 3, 4], ACME)
        assert _held(p.g3, p.ns, ACME) == N and _delta(before, "g3_revoked_purges") == [2]
        assert _ask(p.s, _req("r2", toks, ACME)) == N * p.bs
    finally:
        p.close()


def test_a_tenant_recreated_while_down_is_never_offered_restored_blocks_the_worker_refuses(tmp_path, kek):
    """acme saved; the worker stops; acme is revoked and re-created (``keys create``: a new key id, the same name)
    while it is down, and G4's shredded objects are gone (``gc``); the worker starts again. Its G3 restores acme's old
    blocks by tag. The scheduler's lookup must not offer what the worker then refuses: the worker deletes acme's
    restored blocks as it starts (the keyring names the re-created tenant's id), so the scheduler offers acme's prompt
    nothing and the worker does not refuse acme; acme's new saves are stored and served from G3 with no further
    purge. Before the fix the scheduler offered the N restored blocks from G3 and the worker, seeing acme first,
    refused them: every planned block failed (a promised hit became a miss, the request rescheduled)."""
    import shutil

    kv = _engine("cpu", seed=66)
    p = _Worker(tmp_path, kv)
    try:
        _save(p.w, p.g3, p.g4, [1, 2, 3, 4], ACME)
    finally:
        p.close()
    _keys(ACME, "revoke", kr=p.kr)
    _keys(ACME, "create", kr=p.kr)
    shutil.rmtree(tmp_path / "g4")  # G4's gc: the revoked key's objects gone (no G4 offer to muddle the G3 one)
    before = stats.snapshot()
    p = _Worker(tmp_path, kv)  # the restart
    try:
        assert p.g3.stats()["restored_blocks"] == N
        toks, _, _ = _prompt(p.bs, ACME)
        r0 = _req("r0", toks, ACME)
        offered = _ask(p.s, r0)
        if offered:  # the old code: a G3 hit of restored blocks ...
            jobs = _plan(p.s, r0, offered, [10, 11, 12, 13])
            failed = _load(p.w, jobs)  # ... that the worker refuses
            assert not failed, f"the scheduler offered {offered // p.bs} G3 blocks the worker refused ({failed})"
        assert offered == 0 and _held(p.g3, p.ns, ACME) == 0
        assert not p.wg.refused(ACME) and not p.sg.refused(ACME)
        assert _delta(before, "g3_revoked_purges", "g3_revoked_deleted_blocks", "load_g3_revoked_blocks") == [1, N, 0]
        _save(p.w, p.g3, p.g4, [5, 6, 7, 8], ACME)  # the re-created tenant's new KV: stored and served
        assert _held(p.g3, p.ns, ACME) == N and _delta(before, "save_g3_revoked_blocks") == [0]
        p.check()
        _served_from_g3(p, kv, "r1", ACME)
        assert _delta(before, "g3_revoked_purges") == [1]
    finally:
        p.close()


def test_a_save_still_being_written_when_its_tenant_is_purged_is_never_published(tmp_path, kek, monkeypatch):
    """acme's save is handed to G3 and its write hangs in ``fdatasync`` (a stalled drive) when acme is revoked and
    re-created; the worker's check purges acme while the write still waits, and its flush runs out (``FLUSH_S``, here
    0.2 s for the 30 s a drive may stall). The queued write is cancelled, acme stays refused (purge retried, a
    WARNING) until a later check's purge finishes; once the drive resumes nothing of acme's old KV is in G3, and its
    new saves are stored and served. Before the fix the purge ignored its flush's answer: the write was published
    after the purge and the re-created acme was served the KV saved before its revocation (N blocks in G3)."""
    import kvbm_backend.integrations.revoked_tenants as rt
    from kvbm_backend.pool.g3.pool import G3Pool

    monkeypatch.setattr(rt, "FLUSH_S", 0.2)
    kv = _engine("cpu", seed=65)
    p = _Worker(tmp_path, kv)
    inside, release = threading.Event(), threading.Event()
    real = G3Pool._fdatasync

    def held(fd):
        inside.set()
        release.wait(HANG_S)
        real(fd)
    try:
        monkeypatch.setattr(G3Pool, "_fdatasync", staticmethod(held))
        _, hs, dg = _prompt(p.bs, ACME)
        from kvbm_backend.integrations.vllm.metadata import SaveJob
        p.w.save([SaveJob("save-acme", [1, 2, 3, 4], hs[:N], ACME, digests=dg[:16 * N])])
        assert p.w.flush_saves(HANG_S) and inside.wait(HANG_S), "acme's G3 write never reached its fdatasync"
        before = stats.snapshot()
        _keys(ACME, "revoke", kr=p.kr)
        _keys(ACME, "create", kr=p.kr)
        p.check()  # the purge: its flush runs out while the write still waits
        assert _delta(before, "g3_revoked_purges", "g3_revoked_purges_retried") == [0, 1]
        assert p.wg.refused(ACME), "a tenant whose purge did not finish must stay refused"
        release.set()
        assert p.g3.flush(HANG_S)
        assert _held(p.g3, p.ns, ACME) == 0, "acme's write queued before the purge was published after it"
        p.check()  # the retried purge finishes: acme is served again
        assert _delta(before, "g3_revoked_purges", "g3_revoked_purges_retried") == [1, 1]
        assert not p.wg.refused(ACME)
        _save(p.w, p.g3, p.g4, [5, 6, 7, 8], ACME)  # the re-created tenant's new KV: stored and served
        assert _held(p.g3, p.ns, ACME) == N
        _served_from_g3(p, kv, "r", ACME)
    finally:
        release.set()
        p.close()
