"""A G4 pool's keyring as vLLM's scheduler thread asks it (:mod:`kvbm_backend.pool.g4.keyring_view`): real G4 pools on
``file://`` stores, real keyring files, changed by a second :class:`Keyring` as ``kvbm-backend keys`` does.

What the view predicts of a tenant's offloads must be what the pool's writer then does with them (review finding 2 of
2026-12-01: a prefill worker promised blocks its G4 writer always dropped); the view answers without re-reading the
keyring file on the caller's thread (finding 3: the scheduler thread ran the keyring's reload)."""
from __future__ import annotations

import threading
import time

import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.crypto.keyring import Keyring
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, put_blocks


def _pool(tmp_path, encrypt=True, **keyring) -> G4Pool:
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", encrypt=encrypt, timeout_s=30.0,
                   keyring={"path": str(tmp_path / "keys" / "kr.json"), "reload_interval_s": 0.001, **keyring})
    return G4Pool(cfg, namespace())


HANG_S = 600.0  # a hang guard, not a bound: returns as soon as what must come came


def _refreshed(view, pred) -> None:
    """Refresh ``view`` (as its thread does) until ``pred()``: the keyring re-reads a changed file only once its
    reload interval (1 ms here) passed since its last check, which the view's own thread may have made just now."""
    t0 = time.monotonic()
    while True:
        view.refresh()
        if pred():
            return
        assert time.monotonic() - t0 < HANG_S, "hang guard"
        time.sleep(0.002)


def _operator(pool: G4Pool) -> Keyring:
    """Another process's keyring on the same file (what ``kvbm-backend keys ...`` opens)."""
    return Keyring(pool.keyring.path, pool.keyring.provider)


def _setup(case: str, tmp_path):
    """A started pool (its view refreshed) and a tenant in state ``case``; the expected refusal."""
    if case == "read_only":  # the file made where it is writable, then mounted read-only
        _pool(tmp_path).close()
        pool = _pool(tmp_path, read_only=True)
    else:
        pool = _pool(tmp_path, **({"auto_create_tenants": False} if case == "auto_create_off" else
                                  {"max_auto_tenants": 1} if case == "full" else {}))
    op = _operator(pool)
    tenant = "x" * 1025 if case == "long_id" else "acme"
    if case in ("revoked", "active"):
        op.create(tenant)
    if case == "revoked":
        op.revoke(tenant)
    if case == "full":
        op.create("other")
    if case == "unloadable":
        pool.keyring.path.write_text("{not json")  # (mode kept: 0600) the file stops loading
    op.close()
    pool.keyring_view.start()
    expected = {"revoked": "revoked_tenant", "auto_create_off": "unknown_tenant", "read_only": "unknown_tenant",
                "full": "unknown_tenant", "long_id": "unknown_tenant", "unloadable": "keyring"}.get(case)
    return pool, tenant, expected


@pytest.mark.parametrize("case", ["revoked", "auto_create_off", "read_only", "full", "long_id", "unloadable",
                                  "active", "new"])
def test_the_views_write_refusal_is_what_the_writer_then_does(tmp_path, case):
    """For each keyring state the view names the G4 writer's drop reason for the tenant's offloads (``dropped_`` +
    it), or None for a tenant whose offloads are written (an active one, or a new one the keyring creates)."""
    pool, tenant, expected = _setup(case, tmp_path)
    try:
        assert pool.keyring_view.write_refusal(tenant) == expected
        res = put_blocks(pool, [1, 2], tenant)
        if expected is None:
            assert (res.written, res.dropped) == (2, 0), res
        else:
            assert (res.written, res.dropped) == (0, 2), res
            assert pool.stats()[f"dropped_{expected}"] == 2, pool.stats()
    finally:
        pool.close()


@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "plaintext-keyed"])
def test_read_refusal_names_what_the_pool_cannot_load(tmp_path, encrypt):
    """``read_refusal``: a revoked tenant and an unloadable keyring (lookups and loads miss without store I/O); an
    unknown tenant is none (another worker may create it); a plaintext pool writes an unknown tenant."""
    pool = _pool(tmp_path, encrypt=encrypt)
    try:
        op = _operator(pool)
        op.create("gone")
        op.revoke("gone")
        op.close()
        view = pool.keyring_view.start()
        assert [view.read_refusal(t) for t in ("gone", "nobody")] == ["revoked", None]
        assert view.write_refusal("nobody") is None  # auto-created (encrypted) or needs no key (plaintext)
        pool.keyring.path.write_text("{not json")
        _refreshed(view, lambda: view.read_refusal("nobody") is not None)
        assert view.read_refusal("nobody") == "unavailable" and view.write_refusal("nobody") == "keyring"
    finally:
        pool.close()


def test_a_change_of_the_keyring_reaches_the_view_at_its_refresh(tmp_path):
    """The view answers from its snapshot; its refresh (the ``kvbm-keyring-view`` thread's job, run here too)
    takes in a revocation and a re-creation."""
    pool = _pool(tmp_path)
    try:
        view = pool.keyring_view
        op = _operator(pool)
        op.create("acme")
        view.start()
        assert view.state("acme") == "active" and view.write_refusal("acme") is None
        op.revoke("acme")
        _refreshed(view, lambda: view.state("acme") != "active")
        assert view.state("acme") == "revoked" and view.write_refusal("acme") == "revoked_tenant"
        op.create("acme")  # `keys create` brings it back, with a new key
        _refreshed(view, lambda: view.state("acme") != "revoked")
        assert view.state("acme") == "active"
        op.close()
    finally:
        pool.close()


def test_the_view_never_reloads_the_keyring_on_the_asking_thread(tmp_path):
    """Every answer of the view (pseudonym, state, refusals) on this thread while the keyring file changed: the
    keyring loads no file version on it (its reload, 70-180 ms with 4,096 tenants, is the refresh thread's)."""
    pool = _pool(tmp_path)
    try:
        view = pool.keyring_view.start()
        kr = pool.keyring
        loaders: list[int] = []
        real = kr._load
        kr._load = lambda: loaders.append(threading.get_ident()) or real()  # records who reads the file
        op = _operator(pool)
        op.create("acme")  # the file changed; its reload interval (1 ms) passes
        op.close()
        for t in ("acme", "other", "x" * 2000):
            view.pseudonym(t), view.state(t), view.write_refusal(t), view.read_refusal(t)
        assert threading.get_ident() not in loaders
        assert view.pseudonym("acme") == pool.pseudonym("acme")  # the same key (pool.pseudonym may reload)
    finally:
        pool.close()
