"""Tenant naming keys: the keyed HMACs that name a tenant (pseudonym) and its G4 blocks (block ids).

Code outside the keyring (pools without one, ``kvbm-backend g4 migrate``) derives the same keys from here;
:class:`~kvbm_backend.crypto.keyring.Keyring` uses its secret pseudonym key. Layout: ``docs/format.md``
("G4 names", "G4 keyring").
"""
from __future__ import annotations

import hashlib
import hmac
import os

UNKEYED_PSEUDONYM_KEY = b"kvbm-backend/unkeyed-tenant-pseudonym/v1"  # public: pools without a keyring
#: the longest tenant id (UTF-8 bytes, ``tenant_bytes``) a worker creates a data key for implicitly
#: (``g4.keyring.auto_create_tenants``); ``kvbm-backend keys create`` takes any length
MAX_AUTO_TENANT_BYTES = 1024
NAME_KEY_LABEL = b"kvbm-backend/g4-block-names/v1\x00"  # HMAC message prefix of a tenant's G4 naming key

__all__ = ["MAX_AUTO_TENANT_BYTES", "NAME_KEY_LABEL", "UNKEYED_PSEUDONYM_KEY", "auto_creatable",
           "check_storable_tenant", "derive_name_key"]


def derive_name_key(pseudonym_key: bytes, pseudonym: bytes) -> bytes:
    """A tenant's 32-byte G4 naming key: ``HMAC-SHA256(pseudonym_key, NAME_KEY_LABEL || pseudonym)``,
    ``pseudonym`` being the tenant's 16-byte pseudonym. Secret exactly as long as ``pseudonym_key`` is
    (:data:`UNKEYED_PSEUDONYM_KEY`, public, for pools without a keyring: such names hide nothing)."""
    return hmac.new(pseudonym_key, NAME_KEY_LABEL + pseudonym, hashlib.sha256).digest()


def auto_creatable(tenant: str) -> bool:
    """Whether a worker may create ``tenant``'s data key implicitly by its length: at most
    :data:`MAX_AUTO_TENANT_BYTES` UTF-8 bytes (``tenant_bytes``)."""
    from ..model.namespace import tenant_bytes
    return len(tenant_bytes(tenant)) <= MAX_AUTO_TENANT_BYTES


def check_storable_tenant(tenant: str, where: str | os.PathLike[str], implicit: bool = False) -> None:
    """Refuse a tenant id the keyring file (JSON) cannot keep: JSON writes a lone surrogate as ``\\udXXX``
    and reads a high/low pair back as the one character they form, i.e. another tenant. Such ids (possible
    only from a client's ``cache_salt`` decoded with surrogateescape) get no data key: their offloads are
    dropped as an unknown tenant, their loads miss. ``implicit`` (a worker's creation, not ``keys create``):
    also refuse an id over :data:`MAX_AUTO_TENANT_BYTES` bytes. The tenant is a client's ``cache_salt``, and
    every creation rewrites the whole file that every worker re-reads: before 2026-11-30 a flood of
    ``max_auto_tenants`` (4096) salts of 1 MB each could grow it to 4 GB, rewritten at each of the 4096 creations.

    Raises:
        UnknownTenant: naming the keyring (``where``) and why (never the tenant id).
    """
    import json

    from .kek import UnknownTenant
    if implicit and not auto_creatable(tenant):
        raise UnknownTenant(f"keyring {where}: a tenant id over {MAX_AUTO_TENANT_BYTES} bytes is never created "
                            "implicitly; create it with `kvbm-backend keys create`")
    if json.loads(json.dumps(tenant)) != tenant:
        raise UnknownTenant(f"keyring {where}: a tenant id holding a UTF-16 surrogate pair cannot have a data key "
                            "(JSON would read it back as another tenant)")
