"""Object names of G4 blocks.

``{ns_fingerprint}/{tenant_pseudonym_hex}/{rank}/{fanout}/{seq_hash:016x}`` under the store's prefix,
where ``fanout = seq_hash % dir_fanout`` in fixed-width lowercase hex, so no directory (or S3 listing
level) holds more than ~1/dir_fanout of a tenant's blocks. The namespace's canonical JSON lives at
``{ns_fingerprint}/namespace.json``. The tenant id never appears: only its keyed pseudonym.
"""
from __future__ import annotations

NAMESPACE_JSON = "namespace.json"


def fanout_width(dir_fanout: int) -> int:
    """Hex digits of a fan-out directory name (256 -> 2, 4096 -> 3, 1 -> 1)."""
    return max(1, len(f"{dir_fanout - 1:x}"))


def block_name(ns_fp: str, pseudonym_hex: str, rank: int, seq_hash: int, dir_fanout: int) -> str:
    fan = f"{seq_hash % dir_fanout:0{fanout_width(dir_fanout)}x}"
    return f"{ns_fp}/{pseudonym_hex}/{rank}/{fan}/{seq_hash:016x}"


def tenant_prefix(ns_fp: str, pseudonym_hex: str) -> str:
    return f"{ns_fp}/{pseudonym_hex}/"


def namespace_name(ns_fp: str) -> str:
    return f"{ns_fp}/{NAMESPACE_JSON}"


def parse_block_name(name: str) -> dict | None:
    """``{"ns": str, "tenant": pseudonym hex, "rank": int, "seq_hash": int}`` or None if ``name`` is
    not a block name (namespace.json, foreign files)."""
    parts = name.split("/")
    if len(parts) < 5:
        return None
    ns, ten, rank, _fan, seq = parts[-5:]
    try:
        if len(ns) != 16 or len(ten) != 32 or len(seq) != 16:
            return None
        int(ns, 16), int(ten, 16)
        return {"ns": ns, "tenant": ten, "rank": int(rank), "seq_hash": int(seq, 16)}
    except ValueError:
        return None
