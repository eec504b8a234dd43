"""Object names of G4 blocks (``docs/format.md``, "G4 names").

``{ns_fingerprint}/{tenant_pseudonym_hex}/{rank}/{fanout}/{block_id_hex}`` under the store's prefix, where
``block_id = HMAC-SHA256(name_key, ns_fp (8 bytes) || rank (u32 LE) || seq_hash (u64 LE))[:16]`` (32 hex
chars) under the tenant's naming key (:func:`kvbm_backend.crypto.names.derive_name_key`, from the keyring's
pseudonym key: :meth:`kvbm_backend.crypto.keyring.Keyring.name_key`), and
``fanout = int(block_id[:4 bytes], big-endian) % dir_fanout`` in fixed-width lowercase hex: no directory (or
S3 listing level) holds more than ~1/dir_fanout of a tenant's blocks. Without the naming key a name says
nothing about the sequence hash: a guessed prompt prefix cannot be confirmed from a listing, and two
tenants or namespaces holding the same prefix share no name. The tenant id never appears: only its keyed
pseudonym. The namespace's canonical JSON lives at ``{ns_fingerprint}/namespace.json``.

Format 1 names (``.../{seq_hash % dir_fanout:hex}/{seq_hash:016x}``, the sequence hash in clear) are
read only by ``kvbm-backend g4 migrate`` (:mod:`.migrate`), which renames them: :func:`legacy_block_name`.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import Any

from ...model.namespace import Namespace

NAMESPACE_JSON = "namespace.json"
NAMESPACE_JSON_MAX = 64 << 10  # bytes of a store's namespace.json read at most (a real one is a few KiB)
MAX_DIR_FANOUT = 4096  # g4.dir_fanout's upper bound
BLOCK_ID_BYTES = 16  # truncated HMAC-SHA256 in a block name: 128 bits, 32 hex chars
_MSG = struct.Struct("<8sIQ")


def fanout_width(dir_fanout: int) -> int:
    """Hex digits of a fan-out directory name (256 -> 2, 4096 -> 3, 1 -> 1)."""
    return max(1, len(f"{dir_fanout - 1:x}"))


class TenantNamer:
    """Names one tenant's blocks in one namespace (a pre-keyed HMAC; thread-safe: each name copies it).

    Args:
        ns_fp: namespace fingerprint, 16 hex chars.
        pseudonym: the tenant's 16-byte pseudonym.
        name_key: the tenant's 32-byte naming key.
        dir_fanout: ``g4.dir_fanout`` (1..4096).
    """

    __slots__ = ("ns_fp", "_ns", "pseudonym", "pseudonym_hex", "_mac", "_fan", "_w", "_dir")

    def __init__(self, ns_fp: str, pseudonym: bytes, name_key: bytes, dir_fanout: int):
        self.ns_fp, self._ns = ns_fp, bytes.fromhex(ns_fp)
        self.pseudonym, self.pseudonym_hex = pseudonym, pseudonym.hex()
        self._mac = hmac.new(name_key, digestmod=hashlib.sha256)
        self._fan, self._w = dir_fanout, fanout_width(dir_fanout)
        self._dir = f"{ns_fp}/{self.pseudonym_hex}/"

    def block_id(self, rank: int, seq_hash: int) -> bytes:
        """The 16-byte keyed id of block ``(rank, seq_hash)``."""
        m = self._mac.copy()
        m.update(_MSG.pack(self._ns, rank, seq_hash))
        return m.digest()[:BLOCK_ID_BYTES]

    def name(self, rank: int, seq_hash: int) -> str:
        """Store-relative object name of block ``(rank, seq_hash)``."""
        bid = self.block_id(rank, seq_hash)
        fan = int.from_bytes(bid[:4], "big") % self._fan
        return f"{self._dir}{rank}/{fan:0{self._w}x}/{bid.hex()}"


def legacy_block_name(ns_fp: str, pseudonym_hex: str, rank: int, seq_hash: int, dir_fanout: int) -> str:
    """Format 1 name (the sequence hash in clear), kept for :mod:`.migrate` and its tests only."""
    fan = f"{seq_hash % dir_fanout:0{fanout_width(dir_fanout)}x}"
    return f"{ns_fp}/{pseudonym_hex}/{rank}/{fan}/{seq_hash:016x}"


def tenant_prefix(ns_fp: str, pseudonym_hex: str) -> str:
    return f"{ns_fp}/{pseudonym_hex}/"


def namespace_name(ns_fp: str) -> str:
    return f"{ns_fp}/{NAMESPACE_JSON}"


def namespace_doc(namespace: Namespace, dir_fanout: int) -> bytes:
    """The bytes of a G4 store's ``{ns_fp}/namespace.json``: the namespace's canonical members (what its fingerprint
    is computed over) plus ``"g4": {"dir_fanout": N}``, the fan-out every block name under it uses (a property of
    the store, not of the namespace: not in the fingerprint). Canonical form: sorted keys, no spaces."""
    return json.dumps({**namespace.to_dict(), "g4": {"dir_fanout": dir_fanout}}, sort_keys=True,
                      separators=(",", ":")).encode()


def recorded_fanout(body: bytes) -> int | None:
    """The ``dir_fanout`` a store's ``namespace.json`` (``body``) records; None when it records none (written
    before 2026-12-01, by workers whose ``g4.dir_fanout`` it does not say). Raises ValueError when ``body`` is
    not a JSON object, or its ``g4.dir_fanout`` not an integer in [1, 4096]."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    g4 = doc.get("g4")
    if g4 is None:
        return None
    fan = g4.get("dir_fanout") if isinstance(g4, dict) else None
    if type(fan) is not int or not 1 <= fan <= MAX_DIR_FANOUT:
        raise ValueError(f"g4.dir_fanout: {fan!r} is not an integer in [1, {MAX_DIR_FANOUT}]")
    return fan


def _hex(s: str, n: int) -> bool:
    return len(s) == n and all(c in "0123456789abcdef" for c in s)


def parse_block_name(name: str, nested: bool = False) -> dict[str, Any] | None:
    """What a block name says, or None if ``name`` is not a block name (namespace.json, foreign files).

    Keyed names: ``{"ns": str, "tenant": pseudonym hex, "rank": int, "fan": str, "block_id": 32 hex,
    "legacy": False}``. Format 1 names: the same with ``"seq_hash": int`` instead of ``block_id`` and
    ``"legacy": True``.

    ``name`` is store-relative (as a listing gives it): a block name has exactly five components. A name with
    more (``team-b/{ns}/...``) is another store's object below this store's root (a second fleet's G4 prefix
    nested in this one's): None, so gc never deletes it (before 2026-11-30 the last five components were
    parsed and the outer fleet's gc deleted the inner fleet's blocks). ``nested``: parse the last five
    components of a deeper name too (``g4 migrate``, which renames a block in place, under its own prefix)."""
    parts = name.split("/")
    if len(parts) < 5 or (len(parts) > 5 and not nested):
        return None
    ns, ten, rank, fan, last = parts[-5:]
    if not (_hex(ns, 16) and _hex(ten, 32) and rank.isdigit() and fan and _hex(fan, len(fan))):
        return None
    meta = {"ns": ns, "tenant": ten, "rank": int(rank), "fan": fan}
    if _hex(last, 2 * BLOCK_ID_BYTES):
        return {**meta, "block_id": last, "legacy": False}
    if _hex(last, 16):
        return {**meta, "seq_hash": int(last, 16), "legacy": True}
    return None
