"""G4 announcements: small sealed records naming the blocks a worker published to G4, so every worker can
tell Dynamo's router that it can load them (``g4.announce``; :mod:`kvbm_backend.integrations.vllm.g4_announce`).

One object per tenant per flush (a batch of records, never one object per block), named
``{ns_fp}/announce/{tenant_pseudonym_hex}/{batch_id:016x}`` under the store's prefix: a directory of its
own, so listing announcements never lists blocks, and a name :func:`~.naming.parse_block_name` rejects (G4
``gc`` leaves them alone). The object is a G4 frame (``docs/format.md``): the 4 KiB header with
``rank = ANNOUNCE_RANK``, ``seq_hash = batch_id``, all layout fields 0 and ``payload_len`` the record
bytes, then the records (UTF-8 JSON) sealed exactly as a block: AES-256-GCM under the tenant's data key,
AAD = the header identity (namespace, tenant pseudonym, rank, batch id, length), so records moved to
another name, tenant or namespace fail to open; an unencrypted pool (``g4.encrypt: false``) stores them
xxh3-checksummed like its blocks. Token ids are prompt content: with encryption on they never reach the
store in clear. A plaintext pool with a keyring writes no records for a revoked tenant (TenantRevoked), as
it writes none of its blocks (:class:`~.writer.G4Writer`); before (2026-11-30) its announcements were written.

Readers (:meth:`Announcements.read`) accept a record batch only when its header names this namespace,
the tenant of its directory, ``ANNOUNCE_RANK`` and the batch id of its name, and its tag (or checksum)
verifies under a key this keyring holds for that very tenant; anything else is ``None`` with a reason
(``foreign``: a key this keyring does not hold, or in a plaintext pool with a keyring a checksummed batch of a
tenant it records revoked and not re-created; ``corrupt``: anything else). Such a plaintext pool no longer
serves a revoked tenant's blocks (:func:`~.reader.tenant_miss`), so its batches written before the revocation
are withdrawn like sealed ones (:meth:`key_held`); before (2026-11-30) checksummed batches counted as held for
good and kept the router crediting blocks whose loads missed. Listing (:meth:`list`) is for
background pollers only, never the serving path.

Size: an object the listing sizes above :data:`MAX_OBJECT_BYTES` is ``corrupt`` without a byte of it read,
and a read never asks for more than that (one that grew since it was listed is cut short, so corrupt too).
Before (2026-11-30) every poller read any object under ``announce/`` whole before checking its size (a 1 GiB
sparse file cost each of them 1 GiB per poll). Records nested too deep to parse (RecursionError) or too large
to hold (MemoryError) are ``corrupt`` too, never a retried error.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from ...crypto.aead import AeadError, key_check, key_check_differs, new_nonce, open_into, seal_into
from ...crypto.keyring import KeyringError, TenantRevoked
from ...model.frame import FLAG_CHECKSUM, FLAG_ENCRYPTED, HEADER_BYTES, FrameError, FrameHeader, payload_checksum
from .store import ObjectInfo, ObjectStore

ANNOUNCE_DIR = "announce"
ANNOUNCE_RANK = 0xFFFFFFFE  # never a TP rank: a block frame is never taken for records, nor the reverse
MAX_RECORD_BYTES = 64 << 20  # a batch larger than this is refused when read (corrupt or hostile)
MAX_OBJECT_BYTES = HEADER_BYTES + MAX_RECORD_BYTES  # larger objects are never read (module doc, "Size")


def batch_prefix(name: str) -> bool:
    """True when ``name`` (store-relative) lies under some namespace's ``announce/`` directory."""
    parts = name.split("/", 2)
    return len(parts) == 3 and parts[1] == ANNOUNCE_DIR and len(parts[0]) == 16


def parse_batch_name(name: str) -> tuple[str, int] | None:
    """``(tenant pseudonym hex, batch id)`` of an announcement object name, None when it is not one."""
    parts = name.split("/")
    if len(parts) != 4 or parts[1] != ANNOUNCE_DIR or len(parts[0]) != 16 or len(parts[2]) != 32 or len(parts[3]) != 16:
        return None
    try:
        bytes.fromhex(parts[0] + parts[2])
        return parts[2], int(parts[3], 16)
    except ValueError:
        return None


@dataclass(frozen=True)
class Batch:
    """One announcement object as listed: ``name``, ``tenant_hex`` (pseudonym), ``batch_id``, ``mtime``
    (epoch s, the store's), ``size`` (bytes, as listed)."""
    name: str
    tenant_hex: str
    batch_id: int
    mtime: float
    size: int = 0


class Announcements:
    """Writes and reads the announcement objects of one G4 namespace.

    Args:
        store: the G4 :class:`~.store.ObjectStore`.
        ns_fp: namespace fingerprint (16 hex chars) the records are about.
        keyring: the G4 keyring (None only with ``encrypt=False``).
        encrypt: seal records (AES-256-GCM) or checksum them (xxh3), as the pool does its blocks.
        pseudonym: ``tenant -> 16-byte pseudonym`` (the pool's :meth:`~.pool.G4Pool.pseudonym`).
    """

    def __init__(self, store: ObjectStore, ns_fp: str, keyring: Any, encrypt: bool,
                 pseudonym: Callable[[str], bytes]):
        if encrypt and keyring is None:
            raise ValueError("g4.announce: an encrypted G4 needs g4.keyring.path")
        self.store, self.ns_fp, self.keyring, self.encrypt = store, ns_fp, keyring, encrypt
        self._ns = bytes.fromhex(ns_fp)
        self._pseudonym = pseudonym
        self.prefix = f"{ns_fp}/{ANNOUNCE_DIR}/"

    def _header(self, tenant_tag: bytes, batch_id: int, n: int) -> FrameHeader:
        return FrameHeader(ns_fp=self._ns, tenant_tag=tenant_tag, rank=ANNOUNCE_RANK, world=0, seq_hash=batch_id,
                           num_layers=0, outer_dim=0, dtype_bytes=0, page_size=0, inner_dim=0,
                           payload_len=n, stored_len=n)

    def write(self, tenant: str, records: dict[str, Any]) -> str:
        """Seal ``records`` (a JSON-able dict) for ``tenant`` and publish them create-exclusive under a fresh
        random batch id. Returns the object name. Raises KeyringError (revoked/unknown tenant, keyring
        unreadable; a plaintext pool with a keyring: TenantRevoked for a revoked tenant and KeyringError while
        the file does not load, as its block writes) and the store's errors (StoreUnavailable, StoreThrottled,
        OSError)."""
        plain = json.dumps(records, separators=(",", ":")).encode()
        dk = self.keyring.write_key(tenant) if self.encrypt else None  # may reload the keyring: before the tag
        if dk is None and self.keyring is not None:  # plaintext with a keyring: its tenant state holds too
            state = self.keyring.tenant_state(tenant)
            if state == "revoked":
                raise TenantRevoked("the tenant was revoked")
            if state == "unavailable":
                raise KeyringError("the keyring file does not load")
        tag = self._pseudonym(tenant)
        batch_id = int.from_bytes(os.urandom(8), "little")
        hdr = self._header(tag, batch_id, len(plain))
        body = bytearray(len(plain))
        if dk is not None:
            hdr.flags, hdr.key_id, hdr.key_version, hdr.nonce = FLAG_ENCRYPTED, dk.key_id, dk.version, new_nonce()
            hdr.key_check = key_check(dk.key)
            hdr.integrity = seal_into(dk.key, hdr.nonce, hdr.identity_bytes(), plain, body)
        else:
            body[:] = plain
            hdr.flags, hdr.integrity = FLAG_CHECKSUM, payload_checksum(plain)
        name = f"{self.prefix}{tag.hex()}/{batch_id:016x}"
        self.store.put_if_absent(name, hdr.pack() + bytes(body))
        return name

    def list(self) -> list[Batch]:
        """Every announcement object of the namespace (a LIST: background pollers only)."""
        out = []
        for o in self.store.list(self.prefix):
            b = self._parse(o)
            if b is not None:
                out.append(b)
        return out

    def _parse(self, o: ObjectInfo) -> Batch | None:
        p = parse_batch_name(o.name) if o.name.startswith(self.prefix) else None
        return None if p is None else Batch(o.name, p[0], p[1], o.mtime, o.size)

    def read(self, b: Batch) -> tuple[dict[str, Any] | None, str]:
        """``(records, "ok")``, or ``(None, reason)``: ``absent`` (deleted since listed), ``foreign`` (sealed
        under a key this keyring does not hold: another fleet's or a revoked tenant's; or checksummed for a
        tenant a plaintext pool's keyring records revoked), ``corrupt`` (bad
        frame, identity, tag, key of another tenant, too large, or not JSON). Raises the store's errors."""
        recs, why, _key = self.open(b)
        return recs, why

    def names_tenant(self, b: Batch, tenant: str) -> bool:
        """True when ``tenant`` (an id, e.g. a record's cache salt) is the tenant whose directory ``b`` is in."""
        try:
            return self._pseudonym(tenant).hex() == b.tenant_hex
        except Exception:  # noqa: BLE001 - not a tenant id the pool can map (e.g. not UTF-8)
            return False

    def key_held(self, key: tuple[int, int] | None, tenant_hex: str | None = None) -> bool:
        """False when a batch :meth:`open` opened is no longer held: ``key`` (its ``(key_id, version)``) is
        gone, its tenant revoked (crypto-shredded); or, for a checksummed batch (``key`` None) of a plaintext
        pool with a keyring, its tenant pseudonym ``tenant_hex`` is revoked now (that pool no longer serves
        its blocks: :func:`~.reader.tenant_miss`). True otherwise, and while the keyring cannot be read (a
        withdrawal needs the keyring to say so). Never raises."""
        if self.keyring is None:
            return True
        if key is None:
            return tenant_hex is None or not self._revoked(tenant_hex)
        try:
            return self.keyring.read_key(key[0], key[1]) is not None and self.keyring.key_owner(key[0]) is not None
        except KeyringError:
            return True

    def _revoked(self, tenant_hex: str) -> bool:
        """True when the keyring records pseudonym ``tenant_hex`` revoked and no current tenant has it (not
        re-created): the reader's ``"revoked"`` tenant state, by pseudonym. False without a keyring and while
        the file does not load."""
        if self.keyring is None:
            return False
        try:
            if tenant_hex not in self.keyring.revoked() or self.keyring.error is not None:
                return False
            return all(r["pseudonym"] != tenant_hex for r in self.keyring.info())
        except KeyringError:
            return False

    def open(self, b: Batch) -> tuple[dict[str, Any] | None, str, tuple[int, int] | None]:
        """:meth:`read` plus the ``(key_id, version)`` the batch was sealed under (None: checksummed)."""
        if b.size > MAX_OBJECT_BYTES:
            return None, "corrupt", None  # never read (module doc, "Size")
        data = self.store.get(b.name, 0, MAX_OBJECT_BYTES + 1)
        if data is None:
            return None, "absent", None
        key = None
        mv = memoryview(data).cast("B")
        try:
            hdr = FrameHeader.unpack(mv[:HEADER_BYTES])
            want = self._header(bytes.fromhex(b.tenant_hex), b.batch_id, hdr.payload_len)
            if (hdr.identity_bytes() != want.identity_bytes() or hdr.payload_len > MAX_RECORD_BYTES
                    or len(mv) != HEADER_BYTES + hdr.payload_len):
                return None, "corrupt", None
            body = mv[HEADER_BYTES:]
            plain = bytearray(len(body))
            if hdr.flags & FLAG_ENCRYPTED:
                if self.keyring is None:
                    return None, "foreign", None
                dk = self.keyring.read_key(hdr.key_id, hdr.key_version)  # a key not held yet: reloads the file
                owner = self.keyring.key_owner(hdr.key_id) if dk is not None else None
                if owner is None or key_check_differs(hdr.key_check, dk):  # not held, or other key material
                    return None, "foreign", None
                if self._pseudonym(owner).hex() != b.tenant_hex:
                    return None, "corrupt", None  # sealed under another tenant's data key
                open_into(dk, hdr.nonce, hdr.identity_bytes(), hdr.integrity, body, plain)
                key = (hdr.key_id, hdr.key_version)
            elif hdr.flags & FLAG_CHECKSUM and not self.encrypt:
                if self._revoked(b.tenant_hex):  # a revoked tenant's: its blocks are not served either
                    return None, "foreign", None
                plain[:] = body
                if payload_checksum(plain) != hdr.integrity:
                    return None, "corrupt", None
            else:  # plaintext records in an encrypted pool: never trusted
                return None, "corrupt", None
            recs = json.loads(bytes(plain))
            return (recs, "ok", key) if isinstance(recs, dict) else (None, "corrupt", None)
        except (FrameError, AeadError, ValueError, KeyringError, RecursionError, MemoryError):
            return None, "corrupt", None  # too deep or too large to parse: corrupt, never retried

    def delete(self, b: Batch) -> None:
        """Remove an expired batch (absent is fine). Raises the store's errors."""
        self.store.delete(b.name)
