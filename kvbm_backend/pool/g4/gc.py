"""Retention for G4: remove blocks by age and/or down to a capacity target (oldest first), per tenant
too, plus blocks of revoked tenants (crypto-shredded) and stale writer temp files.

Safe while workers run: only published objects are deleted (a concurrent reader gets a miss, never
wrong bytes: every read verifies), and writer temp files only once older than ``temp_grace_s``.
Ages come from the store (S3 ``LastModified``, POSIX ``mtime``).
"""
from __future__ import annotations

import math
import time

from .naming import parse_block_name
from .store import ObjectStore


def run_gc(store: ObjectStore, *, keyring=None, max_age_s: float | None = None, target_bytes: int | None = None,
           tenant: str | None = None, temp_grace_s: float = 3600.0, dry_run: bool = False,
           now: float | None = None) -> dict:
    """One gc pass over ``store``.

    Args:
        keyring: :class:`~kvbm_backend.crypto.keyring.Keyring`: maps ``tenant`` ids to pseudonyms and
            names revoked tenants whose blocks are reclaimed. Without it, ``tenant`` must be a
            32-hex pseudonym and revoked tenants are not known.
        max_age_s: delete blocks last modified more than this many seconds ago.
        target_bytes: then delete oldest blocks until the (tenant's) blocks total at most this.
        tenant: restrict everything to one tenant (id or pseudonym hex).
        temp_grace_s: writer temp files older than this are removed (crashed writers).
        dry_run: report only.
    Returns:
        dict of counts and bytes: scanned_*, deleted_* and per-reason ``deleted_by``.
    Raises:
        ValueError when ``tenant`` cannot be resolved or a threshold is negative, infinite or NaN
        (before anything is listed or deleted); StoreUnavailable when the store is down.
    """
    for name, v in (("max_age_s", max_age_s), ("target_bytes", target_bytes), ("temp_grace_s", temp_grace_s)):
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}: must be a finite number >= 0 (got {v})")
    now = time.time() if now is None else now
    want = None
    if tenant is not None:
        if keyring is not None:
            want = keyring.pseudonym(tenant).hex()
        elif len(tenant) == 32 and all(c in "0123456789abcdef" for c in tenant):
            want = tenant
        else:
            raise ValueError(f"--tenant {tenant!r}: needs --keyring to map a tenant id to its pseudonym "
                             "(or pass the 32-hex pseudonym)")
    revoked = keyring.revoked() if keyring is not None else {}
    blocks = []
    for o in store.list(""):
        meta = parse_block_name(o.name)
        if meta is None or (want is not None and meta["tenant"] != want):
            continue
        blocks.append((o, meta))
    res = {"dry_run": dry_run, "url": store.url, "scanned_objects": len(blocks),
           "scanned_bytes": sum(o.size for o, _ in blocks),
           "deleted_by": {"revoked": 0, "age": 0, "capacity": 0, "temp": 0}, "deleted_objects": 0,
           "deleted_bytes": 0, "errors": 0}

    def drop(o, why: str) -> None:
        if not dry_run:
            try:
                store.delete(o.name)
            except OSError:
                res["errors"] += 1
                return
        res["deleted_by"][why] += 1
        res["deleted_objects"] += 1
        res["deleted_bytes"] += o.size

    keep = []
    for o, meta in blocks:
        t_rev = revoked.get(meta["tenant"])
        if t_rev is not None and o.mtime <= t_rev + 1.0:
            drop(o, "revoked")
        elif max_age_s is not None and now - o.mtime > max_age_s:
            drop(o, "age")
        else:
            keep.append(o)
    if target_bytes is not None:
        total = sum(o.size for o in keep)
        for o in sorted(keep, key=lambda o: o.mtime):
            if total <= target_bytes:
                break
            drop(o, "capacity")
            total -= o.size
    for o in store.list_temps(""):
        if want is not None and f"/{want}/" not in f"/{o.name}":
            continue
        if now - o.mtime > temp_grace_s:
            drop(o, "temp")
    res["remaining_bytes"] = res["scanned_bytes"] - res["deleted_bytes"] + 0
    return res
