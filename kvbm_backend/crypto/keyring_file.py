"""The keyring file: reading it into a :class:`FileState` (document, unwrapped data keys, owners,
pseudonym key, change stamp) without touching any keyring's in-memory state, and the edits of its
document (new tenant, new key version). The
:class:`~kvbm_backend.crypto.keyring.Keyring` reads the file and unwraps its keys (a KMS provider's
round trips included) outside its mutex, then installs the result under it, so a mutation's file I/O
never holds up the readers of the keyring (see :meth:`~kvbm_backend.crypto.keyring.Keyring._mutate`).
"""
from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

from .kek import KEY_BYTES, KeyProvider, KeyringError, _b64, _now_iso, _stamp, _unb64, read_trusted
from .keyring_persist import Doc

FORMAT = "kvbm-backend-keyring/1"


class FileState(NamedTuple):
    """One version of the keyring file, read, checked and unwrapped."""
    doc: Doc
    keys: dict[tuple[int, int], bytes]  # (key_id, version) -> unwrapped data key
    owner: dict[int, str]  # key_id -> tenant
    pseudonym_key: bytes
    stamp: tuple[int, int, int, int, int]


def read_keyring(path: Path, provider: KeyProvider) -> FileState:
    """Read, check and unwrap the keyring file at ``path`` under ``provider``'s KEK. The change stamp
    comes from the same open file, so a replacement during the read is seen by the next check.
    Raises KeyringError (missing, another uid's, in a directory others can write, insecure mode, not JSON, other format or KEK, malformed entry)."""
    text, st = read_trusted(path, "keyring")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise KeyringError(f"keyring {path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise KeyringError(f"keyring {path}: format {doc.get('format') if isinstance(doc, dict) else None!r}, "
                           f"this reader knows {FORMAT!r}")
    if doc.get("kek_id") != provider.key_id:
        raise KeyringError(f"keyring {path}: wrapped under KEK {doc.get('kek_id')}, "
                           f"but the KEK given ({getattr(provider, 'source', 'provider')}) is {provider.key_id}")
    try:
        pk = provider.unwrap(_unb64(doc["pseudonym_key"]))
        keys, owner = {}, {}
        for name, t in doc.get("tenants", {}).items():
            owner[int(t["key_id"])] = name
            for v, ent in t["versions"].items():
                keys[(int(t["key_id"]), int(v))] = provider.unwrap(_unb64(ent["wrapped"]))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, KeyringError):
            raise
        raise KeyringError(f"keyring {path}: malformed entry ({type(e).__name__}: {e})") from None
    return FileState(doc, keys, owner, pk, _stamp(st))


# ---- edits of the document (applied by the keyring's mutations, under the file lock, without its mutex) --
def new_version(doc: Doc, tenant: str, provider: KeyProvider) -> None:
    """Add a fresh data key version to ``tenant`` (wrapped under ``provider``) and make it current."""
    t = doc["tenants"][tenant]
    v = max((int(x) for x in t["versions"]), default=0) + 1
    t["versions"][str(v)] = {"wrapped": _b64(provider.wrap(secrets.token_bytes(KEY_BYTES))),
                             "created": _now_iso(), "uses": 0}
    t["current"] = v


def add_tenant(doc: Doc, tenant: str, pseudonym_hex: str, provider: KeyProvider) -> None:
    """Add ``tenant`` with a fresh key id (never 0, unique in ``doc``: no current tenant's, and no key id a
    revocation recorded, so a frame's key id never names both a revoked and a current key) and its first
    data key version."""
    used = {int(t["key_id"]) for t in doc["tenants"].values()} | set().union(
        *(revoked_key_ids(r) for r in doc.get("revoked", {}).values()))
    kid = 0
    while kid == 0 or kid in used:
        kid = secrets.randbits(32)
    doc["tenants"][tenant] = {"pseudonym": pseudonym_hex, "key_id": kid, "current": 0, "versions": {}}
    new_version(doc, tenant, provider)


def rotate_tenant(doc: Doc, tenant: str, provider: KeyProvider, where: Path, from_version: int | None) -> None:
    """A new current version for ``tenant`` (KeyringError if it has none). ``from_version``: only if that
    is still the current version, and a tenant gone (revoked meanwhile) is left alone: the automatic
    rotation, where threads or workers that all saw one version reach its limit add one version, not one each."""
    t = doc["tenants"].get(tenant)
    if t is None:
        if from_version is not None:
            return
        raise KeyringError(f"keyring {where}: no tenant {tenant!r}")
    if from_version is None or t["current"] == from_version:
        new_version(doc, tenant, provider)


def tenant_rows(doc: Doc, pending: Callable[[str, int], int]) -> list[dict[str, Any]]:
    """:meth:`~kvbm_backend.crypto.keyring.Keyring.info`'s rows of ``doc``: tenants by name, their versions
    with use counts (the file's plus ``pending(tenant, version)``, not yet in it); never key material."""
    rows = []
    for name, t in sorted(doc["tenants"].items()):
        vers = []
        for v, ent in sorted(t["versions"].items(), key=lambda kv: int(kv[0])):
            uses = int(ent.get("uses", 0)) + pending(name, int(v))
            vers.append({"version": int(v), "created": ent["created"], "uses": uses, "current": int(v) == t["current"]})
        rows.append({"tenant": name, "pseudonym": t["pseudonym"], "key_id": t["key_id"],
                     "current_version": t["current"], "versions": vers})
    return rows


def rewrap_doc(doc: Doc, keys: dict[tuple[int, int], bytes], pseudonym_key: bytes, provider: KeyProvider) -> int:
    """Wrap ``doc``'s pseudonym key and every data key (``keys``: their unwrapped values) under ``provider``'s
    KEK, in place, and name that KEK. Returns the data keys re-wrapped."""
    doc["pseudonym_key"] = _b64(provider.wrap(pseudonym_key))
    n = 0
    for t in doc["tenants"].values():
        for v, ent in t["versions"].items():
            ent["wrapped"] = _b64(provider.wrap(keys[(int(t["key_id"]), int(v))]))
            n += 1
    doc["kek_id"] = provider.key_id
    return n


def revoke_tenant(doc: Doc, tenant: str, where: Path) -> str:
    """Remove ``tenant``'s entry (every wrapped key: crypto-shred) and record its pseudonym in ``revoked``:
    ``revoked_at`` now and ``key_ids``, the key ids revoked for that pseudonym (those of earlier revocations
    of the same pseudonym kept). Returns the pseudonym hex. Raises KeyringError for an unknown tenant."""
    if tenant not in doc["tenants"]:
        raise KeyringError(f"keyring {where}: no tenant {tenant!r}")
    t = doc["tenants"].pop(tenant)
    ps: str = t["pseudonym"]
    ids = revoked_key_ids(doc.get("revoked", {}).get(ps, {})) | {int(t["key_id"])}
    doc.setdefault("revoked", {})[ps] = {"revoked_at": time.time(), "key_ids": sorted(ids)}
    return ps


def revoked_key_ids(record: dict[str, object]) -> frozenset[int]:
    """The key ids a ``revoked`` record names (empty for records written before 2026-11-30, which had none)."""
    ids = record.get("key_ids", ())
    return frozenset(k for k in ids if isinstance(k, int)) if isinstance(ids, list) else frozenset()
