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
NAME_KEY_LABEL = b"kvbm-backend/g4-block-names/v1\x00"  # HMAC message prefix of a tenant's G4 naming key

__all__ = ["NAME_KEY_LABEL", "UNKEYED_PSEUDONYM_KEY", "derive_name_key"]


def derive_name_key(pseudonym_key: bytes, pseudonym: bytes) -> bytes:
    """A tenant's 32-byte G4 naming key: ``HMAC-SHA256(pseudonym_key, NAME_KEY_LABEL || pseudonym)``,
    ``pseudonym`` being the tenant's 16-byte pseudonym. Secret exactly as long as ``pseudonym_key`` is
    (:data:`UNKEYED_PSEUDONYM_KEY`, public, for pools without a keyring: such names hide nothing)."""
    return hmac.new(pseudonym_key, NAME_KEY_LABEL + pseudonym, hashlib.sha256).digest()


def check_storable_tenant(tenant: str, where: str | os.PathLike[str]) -> None:
    """Refuse a tenant id the keyring file (JSON) cannot keep: JSON writes a lone surrogate as ``\\udXXX``
    and reads a high/low pair back as the one character they form, i.e. another tenant. Such ids (possible
    only from a client's ``cache_salt`` decoded with surrogateescape) get no data key: their offloads are
    dropped as an unknown tenant, their loads miss.

    Raises:
        UnknownTenant: naming the keyring (``where``) and why.
    """
    import json

    from .kek import UnknownTenant
    if json.loads(json.dumps(tenant)) != tenant:
        raise UnknownTenant(f"keyring {where}: a tenant id holding a UTF-16 surrogate pair cannot have a data key "
                            "(JSON would read it back as another tenant)")
