"""G4 announcements and the keyring (``g4.announce``), on a real file:// G4 store and a real keyring file.

* A plaintext pool (``g4.encrypt: false``) with a keyring writes no announcement for a revoked tenant, as it
  writes none of its blocks (:class:`~kvbm_backend.pool.g4.writer.G4Writer`). Before (2026-11-30) it did.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.crypto.keyring import Keyring, TenantRevoked, provider_for
from kvbm_backend.pool.g4.announce import Announcements
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come; returns as soon as it does
RELOAD_S = 0.2  # g4.keyring.reload_interval_s of the pools


def _until(pred) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < HANG_S, "hang guard"
        time.sleep(0.05)


def _cfg(tmp_path, encrypt: bool = True) -> G4Config:
    return G4Config(url=f"file://{tmp_path / 'store'}", encrypt=encrypt, announce=True, dir_fanout=16,
                    timeout_s=60.0, keyring={"path": str(tmp_path / "keys" / "keyring.json"),
                                             "reload_interval_s": RELOAD_S})


def _operator(tmp_path) -> Keyring:
    """The operator's own view of the keyring file (``kvbm-backend keys ...``)."""
    p = tmp_path / "keys" / "keyring.json"
    return Keyring(p, provider_for(p), reload_every_s=0)


def test_a_plaintext_pool_writes_no_announcement_for_a_revoked_tenant(tmp_path, monkeypatch):
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    with G4Pool(_cfg(tmp_path, encrypt=False), namespace()) as pool:
        op = _operator(tmp_path)
        op.create("tenant-x")
        ann = Announcements(pool.store, pool.namespace.fingerprint, pool.keyring, False, pool.pseudonym)
        ann.write("tenant-x", {"v": 2, "b": []})
        ann.write("tenant-unknown", {"v": 2, "b": []})  # no data key needed in plaintext: written, as its blocks
        assert len(ann.list()) == 2
        op.revoke("tenant-x")
        _until(lambda: pool.keyring.tenant_state("tenant-x") == "revoked")
        with pytest.raises(TenantRevoked):
            ann.write("tenant-x", {"v": 2, "b": []})  # the old code wrote it
        assert len(ann.list()) == 2  # nothing published
        block = np.zeros(namespace().layout.bytes_per_block, np.uint8)
        res = pool.put(namespace().keys([1], tenant="tenant-x"), [block]).result(HANG_S)
        assert res.dropped == 1  # as the pool's own block writes for the tenant
