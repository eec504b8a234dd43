"""Tenant pseudonyms, object names and expected frame headers of one G4 pool (:class:`TenantNames`).

A tenant (the request's ``cache_salt``) is never stored or logged: objects are named and headers tagged by
its 16-byte pseudonym, a keyed HMAC under the keyring's pseudonym key (an unkeyed HMAC only for unencrypted
pools without a keyring), and block ids are keyed HMACs under the tenant's naming key
(:class:`~kvbm_backend.pool.g4.naming.TenantNamer`, ``docs/format.md`` "G4 names"). Both cost an HMAC per
tenant, so the last :data:`TENANT_CACHE_ENTRIES` tenants' namers are kept (LRU), ids of at most
:data:`CACHE_TENANT_CHARS` characters only: a flood of distinct ``cache_salt`` values, however long, costs one
HMAC per miss, never memory (200k tenants once held 75 MB; 4096 salts of 1 MB, 4 GB).

The cache follows the keyring's pseudonym key: when a reload brings another one (the keyring file replaced,
e.g. deleted, a crypto-shred of every tenant, then made anew by ``keys create``) the keyring's
:meth:`~kvbm_backend.crypto.keyring.Keyring.naming_generation` changes, the cache is dropped (logged once) and
every name, header and pseudonym is the new keyring's from then on. Before 2026-11-30 the cached ones stayed:
a running pool kept naming and tagging blocks with the shredded keyring's pseudonyms while sealing them under
the new keys, so fresh workers never found them and its own offloads of blocks the old generation held were
``skipped_exists`` (their loads ``miss_no_key``) until it restarted.

The fan-out directory of every name follows the store too: ``{ns_fp}/namespace.json`` records the
``g4.dir_fanout`` its blocks are named with (written by the namespace's first worker,
:meth:`~.writer.G4Writer.write_namespace_json`), and a pool configured otherwise names blocks with the recorded
value (:meth:`TenantNames.follow_store`, a WARNING naming both values and the fix). Before 2026-12-01 nothing
recorded or checked it: workers differing only in ``g4.dir_fanout`` found none of each other's blocks and stored
each block once per value, silently.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import threading

from ...crypto.keyring import Keyring
from ...crypto.names import UNKEYED_PSEUDONYM_KEY, derive_name_key
from ...model.frame import FrameHeader, identity_bytes
from ...model.layout import KvLayout
from ...model.namespace import BlockKey, tenant_bytes
from .naming import TenantNamer, legacy_block_name, recorded_fanout

__all__ = ["CACHE_TENANT_CHARS", "TENANT_CACHE_ENTRIES", "TenantNames"]
log = logging.getLogger(__name__)

TENANT_CACHE_ENTRIES = 4096  # tenants whose pseudonym and naming key a pool keeps (LRU); more are recomputed
CACHE_TENANT_CHARS = 256  # longer tenant ids are never cached (recomputed each time): the cache holds the ids,
# so 4096 client salts of 1 MB each kept 4 GB per worker before 2026-11-30 (as G3's tag cache, pool/g3/index.py)


class TenantNames:
    """Names and header identities of one namespace's blocks, per tenant (thread-safe).

    Args:
        keyring: keys the pseudonyms and block names; None: unkeyed (unencrypted pools only).
        namespace: the namespace fingerprint (hex) every name and header carries.
        layout: the namespace's block layout (expected headers).
        world: tensor-parallel world size (expected headers).
        dir_fanout: ``g4.dir_fanout`` (directories per tenant and rank), until the store's ``namespace.json``
            says otherwise (:meth:`follow_store`).
    """

    def __init__(self, keyring: Keyring | None, namespace: str, layout: KvLayout, world: int, dir_fanout: int):
        self._keyring = keyring
        self._fp = namespace
        self._ns_bytes = bytes.fromhex(namespace)
        self._layout = layout
        self._world = world
        self.configured_fanout = dir_fanout  # g4.dir_fanout
        self._fanout = dir_fanout  # what names use: the store's recorded value once known (follow_store)
        self._store_said = False  # follow_store logged its finding once
        self._mu = threading.Lock()
        self._gen = self._generation()  # the keyring's naming generation the cached namers are of
        # (tenant, generation, fan-out) -> namer: one computed under an older key or fan-out is never served once a
        # newer is seen (a namer built while follow_store switched is cached under the old fan-out, never hit)
        self._namer = functools.lru_cache(maxsize=TENANT_CACHE_ENTRIES)(self._new_namer)

    def _generation(self) -> int:
        return self._keyring.naming_generation() if self._keyring is not None else 0

    def namer(self, tenant: str) -> TenantNamer:
        """The tenant's pseudonym and namer under the keyring's current pseudonym key (cached, LRU; an id over
        :data:`CACHE_TENANT_CHARS` characters is not kept). Name a block and build its header from one namer: a
        pseudonym key replaced in between cannot split them."""
        gen = self._generation()
        if gen != self._gen:
            self._switch(gen)
        fan = self._fanout
        return (self._namer(tenant, gen, fan) if len(tenant) <= CACHE_TENANT_CHARS
                else self._new_namer(tenant, gen, fan))

    @property
    def dir_fanout(self) -> int:
        """The fan-out names use now: ``g4.dir_fanout``, or the store's recorded value (:meth:`follow_store`)."""
        return self._fanout

    def follow_store(self, body: bytes) -> None:
        """Name blocks with the ``dir_fanout`` the store's ``namespace.json`` (``body``) records, logging (WARNING)
        when it is not ``g4.dir_fanout``. A file that records none (written before 2026-12-01) or that does not
        parse leaves ``g4.dir_fanout`` in use, logged once (INFO; WARNING)."""
        try:
            fan = recorded_fanout(body)
        except ValueError as e:
            if not self._store_said:
                self._store_said = True
                log.warning("G4 (namespace %s): the store's %s/namespace.json does not parse (%s): block names use "
                            "g4.dir_fanout %d, unchecked", self._fp, self._fp, e, self._fanout)
            return
        if fan is None:
            if not self._store_said:
                self._store_said = True
                log.info("G4 (namespace %s): the store's %s/namespace.json (written before 2026-12-01) records no "
                         "dir_fanout: block names use g4.dir_fanout %d, unchecked; every worker sharing the store "
                         "must have the same (docs/format.md \"G4 names\")", self._fp, self._fp, self._fanout)
            return
        with self._mu:
            if fan == self._fanout:
                return
            self._fanout = fan
            self._namer.cache_clear()
        log.warning("G4 (namespace %s): g4.dir_fanout is %d, but the store's %s/namespace.json records %d, the "
                    "fan-out its blocks are named with: this pool names blocks with %d, as every worker sharing the "
                    "store (with %d it would find none of their blocks and store each again). To use %d, point the "
                    "fleet at a new g4.url prefix (gc --max-age-s reclaims the old one); set g4.dir_fanout: %d to "
                    "silence this", self._fp, self.configured_fanout, self._fp, fan, fan, self.configured_fanout,
                    self.configured_fanout, fan)

    def _switch(self, gen: int) -> None:
        with self._mu:
            if gen <= self._gen:
                return
            old, self._gen = self._gen, gen
            self._namer.cache_clear()
        log.warning("G4 (namespace %s): the keyring's pseudonym key changed (generation %d -> %d: the keyring file "
                    "was replaced): tenant pseudonyms and block names follow the new keyring from now on; blocks "
                    "under the old names are no longer found (gc --max-age-s reclaims them)", self._fp, old, gen)

    def _new_namer(self, tenant: str, gen: int, fan: int) -> TenantNamer:
        if self._keyring is not None:
            _gen, ps, key = self._keyring.naming(tenant)  # newer than gen at most: then never looked up again
        else:
            ps = hmac.new(UNKEYED_PSEUDONYM_KEY, tenant_bytes(tenant), hashlib.sha256).digest()[:16]
            key = derive_name_key(UNKEYED_PSEUDONYM_KEY, ps)  # public: such names hide nothing (format.md)
        return TenantNamer(self._fp, ps, key, fan)

    def pseudonym(self, tenant: str) -> bytes:
        """16-byte tenant pseudonym: keyed HMAC under the keyring's (current) pseudonym key (unkeyed HMAC
        only without a keyring)."""
        return self.namer(tenant).pseudonym

    def tag(self, tenant: str) -> str:
        """The tenant's pseudonym, hex (32 characters): what names, headers and log lines carry."""
        return self.namer(tenant).pseudonym_hex

    def name(self, key: BlockKey, namer: TenantNamer | None = None) -> str:
        """The store-relative object name of ``key`` (keyed: ``docs/format.md``, "G4 names"), by ``namer``
        (default: :meth:`namer` of its tenant)."""
        return (namer or self.namer(key.tenant)).name(key.rank, key.seq_hash)

    def legacy_name(self, key: BlockKey) -> str:
        """The name format 1 gave ``key`` (sequence hash in clear)."""
        return legacy_block_name(self._fp, self.tag(key.tenant), key.rank, key.seq_hash, self._fanout)

    def expected_identity(self, key: BlockKey, namer: TenantNamer | None = None) -> tuple[bytes, bytes]:
        """``(tenant tag, identity bytes)`` that ``key``'s frame must carry: the 16-byte tag and
        :meth:`~kvbm_backend.model.frame.FrameHeader.identity_bytes` of :meth:`expected_header`, without
        building the header (a load's per-block cost); ``namer`` as in :meth:`name`."""
        tag = (namer or self.namer(key.tenant)).pseudonym
        return tag, identity_bytes(self._ns_bytes, tag, key.rank, self._world, key.seq_hash, self._layout)

    def expected_header(self, key: BlockKey, namer: TenantNamer | None = None) -> FrameHeader:
        """The header identity ``key``'s frame must carry (flags, key and integrity fields unset); ``namer``
        as in :meth:`name`."""
        return FrameHeader.for_block(key, self._layout, self._world, (namer or self.namer(key.tenant)).pseudonym)

    def cache_size(self) -> int:
        """Tenants whose pseudonym and naming key are cached now (at most :data:`TENANT_CACHE_ENTRIES`)."""
        return self._namer.cache_info().currsize
