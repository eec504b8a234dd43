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
store in clear.

Readers (:meth:`Announcements.read`) accept a record batch only when its header names this namespace,
the tenant of its directory, ``ANNOUNCE_RANK`` and the batch id of its name, and its tag (or checksum)
verifies under a key this keyring holds for that very tenant; anything else is ``None`` with a reason
(``foreign``: a key this keyring does not hold; ``corrupt``: anything else). Listing (:meth:`list`) is for
background pollers only, never the serving path.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from ...crypto.aead import AeadError, new_nonce, open_into, seal_into
from ...crypto.keyring import KeyringError
from ...model.frame import FLAG_CHECKSUM, FLAG_ENCRYPTED, HEADER_BYTES, FrameError, FrameHeader, payload_checksum
from .store import ObjectInfo, ObjectStore

ANNOUNCE_DIR = "announce"
ANNOUNCE_RANK = 0xFFFFFFFE  # never a TP rank: a block frame is never taken for records, nor the reverse
MAX_RECORD_BYTES = 64 << 20  # a batch larger than this is refused when read (corrupt or hostile)


@dataclass(frozen=True)
class Batch:
    """One announcement object as listed: ``name``, ``tenant_hex`` (pseudonym), ``batch_id``, ``mtime``
    (epoch s, the store's)."""
    name: str
    tenant_hex: str
    batch_id: int
    mtime: float


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
        unreadable) and the store's errors (StoreUnavailable, StoreThrottled, OSError)."""
        plain = json.dumps(records, separators=(",", ":")).encode()
        tag = self._pseudonym(tenant)
        batch_id = int.from_bytes(os.urandom(8), "little")
        hdr = self._header(tag, batch_id, len(plain))
        body = bytearray(len(plain))
        if self.encrypt:
            dk = self.keyring.write_key(tenant)
            hdr.flags, hdr.key_id, hdr.key_version, hdr.nonce = FLAG_ENCRYPTED, dk.key_id, dk.version, new_nonce()
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
        parts = o.name[len(self.prefix):].split("/") if o.name.startswith(self.prefix) else []
        if len(parts) != 2 or len(parts[0]) != 32 or len(parts[1]) != 16:
            return None
        try:
            bytes.fromhex(parts[0])
            return Batch(o.name, parts[0], int(parts[1], 16), o.mtime)
        except ValueError:
            return None

    def read(self, b: Batch) -> tuple[dict[str, Any] | None, str]:
        """``(records, "ok")``, or ``(None, reason)``: ``absent`` (deleted since listed), ``foreign`` (sealed
        under a key this keyring does not hold: another fleet's or a revoked tenant's), ``corrupt`` (bad
        frame, identity, tag, key of another tenant, or not JSON). Raises the store's errors."""
        data = self.store.get(b.name)
        if data is None:
            return None, "absent"
        mv = memoryview(data).cast("B")
        try:
            hdr = FrameHeader.unpack(mv[:HEADER_BYTES])
            want = self._header(bytes.fromhex(b.tenant_hex), b.batch_id, hdr.payload_len)
            if (hdr.identity_bytes() != want.identity_bytes() or hdr.payload_len > MAX_RECORD_BYTES
                    or len(mv) != HEADER_BYTES + hdr.payload_len):
                return None, "corrupt"
            body = mv[HEADER_BYTES:]
            plain = bytearray(len(body))
            if hdr.flags & FLAG_ENCRYPTED:
                if self.keyring is None:
                    return None, "foreign"
                key = self.keyring.read_key(hdr.key_id, hdr.key_version)  # a key not held yet: reloads the file
                owner = self.keyring.key_owner(hdr.key_id) if key is not None else None
                if owner is None:
                    return None, "foreign"
                if self._pseudonym(owner).hex() != b.tenant_hex:
                    return None, "corrupt"  # sealed under another tenant's data key
                open_into(key, hdr.nonce, hdr.identity_bytes(), hdr.integrity, body, plain)
            elif hdr.flags & FLAG_CHECKSUM and not self.encrypt:
                plain[:] = body
                if payload_checksum(plain) != hdr.integrity:
                    return None, "corrupt"
            else:  # plaintext records in an encrypted pool: never trusted
                return None, "corrupt"
            recs = json.loads(bytes(plain))
            return (recs, "ok") if isinstance(recs, dict) else (None, "corrupt")
        except (FrameError, AeadError, ValueError, KeyringError):
            return None, "corrupt"

    def delete(self, b: Batch) -> None:
        """Remove an expired batch (absent is fine). Raises the store's errors."""
        self.store.delete(b.name)
