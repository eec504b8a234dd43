"""Tenant pseudonyms, object names and expected frame headers of one G4 pool (:class:`TenantNames`).

A tenant (the request's ``cache_salt``) is never stored or logged: objects are named and headers tagged by
its 16-byte pseudonym, a keyed HMAC under the keyring's pseudonym key (an unkeyed HMAC only for unencrypted
pools without a keyring), and block ids are keyed HMACs under the tenant's naming key
(:class:`~kvbm_backend.pool.g4.naming.TenantNamer`, ``docs/format.md`` "G4 names"). Both cost an HMAC per
tenant, so the last :data:`TENANT_CACHE_ENTRIES` tenants' namers are kept (LRU): a flood of distinct
``cache_salt`` values costs one HMAC per miss, never memory (200k tenants once held 75 MB).
"""
from __future__ import annotations

import functools
import hashlib
import hmac

from ...crypto.keyring import Keyring
from ...crypto.names import UNKEYED_PSEUDONYM_KEY, derive_name_key
from ...model.frame import FrameHeader, identity_bytes
from ...model.layout import KvLayout
from ...model.namespace import BlockKey, tenant_bytes
from .naming import TenantNamer, legacy_block_name

__all__ = ["TENANT_CACHE_ENTRIES", "TenantNames"]

TENANT_CACHE_ENTRIES = 4096  # tenants whose pseudonym and naming key a pool keeps (LRU); more are recomputed


class TenantNames:
    """Names and header identities of one namespace's blocks, per tenant (thread-safe).

    Args:
        keyring: keys the pseudonyms and block names; None: unkeyed (unencrypted pools only).
        namespace: the namespace fingerprint (hex) every name and header carries.
        layout: the namespace's block layout (expected headers).
        world: tensor-parallel world size (expected headers).
        dir_fanout: ``g4.dir_fanout`` (directories per tenant and rank).
    """

    def __init__(self, keyring: Keyring | None, namespace: str, layout: KvLayout, world: int, dir_fanout: int):
        self._keyring = keyring
        self._fp = namespace
        self._ns_bytes = bytes.fromhex(namespace)
        self._layout = layout
        self._world = world
        self._fanout = dir_fanout
        self._namer = functools.lru_cache(maxsize=TENANT_CACHE_ENTRIES)(self._new_namer)

    def pseudonym(self, tenant: str) -> bytes:
        """16-byte tenant pseudonym: keyed HMAC under the keyring's pseudonym key (unkeyed HMAC only
        without a keyring)."""
        if self._keyring is not None:
            return self._keyring.pseudonym(tenant)
        return hmac.new(UNKEYED_PSEUDONYM_KEY, tenant_bytes(tenant), hashlib.sha256).digest()[:16]

    def _new_namer(self, tenant: str) -> TenantNamer:
        ps = self.pseudonym(tenant)
        key = (self._keyring.name_key(ps) if self._keyring is not None
               else derive_name_key(UNKEYED_PSEUDONYM_KEY, ps))  # public: such names hide nothing (format.md)
        return TenantNamer(self._fp, ps, key, self._fanout)

    def tag(self, tenant: str) -> str:
        """The tenant's pseudonym, hex (32 characters): what names, headers and log lines carry."""
        return self._namer(tenant).pseudonym_hex

    def name(self, key: BlockKey) -> str:
        """The store-relative object name of ``key`` (keyed: ``docs/format.md``, "G4 names")."""
        return self._namer(key.tenant).name(key.rank, key.seq_hash)

    def legacy_name(self, key: BlockKey) -> str:
        """The name format 1 gave ``key`` (sequence hash in clear)."""
        return legacy_block_name(self._fp, self.tag(key.tenant), key.rank, key.seq_hash, self._fanout)

    def expected_identity(self, key: BlockKey) -> tuple[bytes, bytes]:
        """``(tenant tag, identity bytes)`` that ``key``'s frame must carry: the 16-byte tag and
        :meth:`~kvbm_backend.model.frame.FrameHeader.identity_bytes` of :meth:`expected_header`, without
        building the header (a load's per-block cost)."""
        tag = self._namer(key.tenant).pseudonym
        return tag, identity_bytes(self._ns_bytes, tag, key.rank, self._world, key.seq_hash, self._layout)

    def expected_header(self, key: BlockKey) -> FrameHeader:
        """The header identity ``key``'s frame must carry (flags, key and integrity fields unset)."""
        return FrameHeader.for_block(key, self._layout, self._world, bytes.fromhex(self.tag(key.tenant)))

    def cache_size(self) -> int:
        """Tenants whose pseudonym and naming key are cached now (at most :data:`TENANT_CACHE_ENTRIES`)."""
        return self._namer.cache_info().currsize
