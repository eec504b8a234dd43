"""The keyring file: reading it into a :class:`FileState` (document, unwrapped data keys, owners,
pseudonym key, change stamp) without touching any keyring's in-memory state, and the edits of its
document (new tenant, new key version). The
:class:`~kvbm_backend.crypto.keyring.Keyring` reads the file and unwraps its keys (a KMS provider's
round trips included) outside its mutex, then installs the result under it, so a mutation's file I/O
never holds up the readers of the keyring (see :meth:`~kvbm_backend.crypto.keyring.Keyring._mutate`).
"""
from __future__ import annotations

import base64
import json
import math
import re
import secrets
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, NoReturn

from .kek import (KEY_BYTES, KeyProvider, KeyringError, TenantRevoked, UnknownTenant, _b64, _now_iso, _stamp,
                  read_trusted)
from .keyring_persist import Doc
from .names import check_storable_tenant

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
    Raises KeyringError naming the file and, for a bad member, that member (:func:`check_doc`): missing,
    another uid's, in a directory others can write, insecure mode, not JSON, other format or KEK, a member
    missing or mistyped, a wrapped key that does not unwrap."""
    text, st = read_trusted(path, "keyring")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise KeyringError(f"keyring {path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise KeyringError(f"keyring {path}: format {doc.get('format') if isinstance(doc, dict) else None!r}, "
                           f"this reader knows {FORMAT!r}")
    if not isinstance(doc.get("kek_id"), str):
        _bad(path, "kek_id", _problem(doc, "kek_id", "a string: the id of the KEK that wrapped the keys"))
    if doc["kek_id"] != provider.key_id:
        raise KeyringError(f"keyring {path}: wrapped under KEK {doc.get('kek_id')}, "
                           f"but the KEK given ({getattr(provider, 'source', 'provider')}) is {provider.key_id}")
    check_doc(doc, path)
    pk = _unwrap(provider, doc["pseudonym_key"], path, "pseudonym_key")
    keys, owner = {}, {}
    for i, (name, t) in enumerate(doc["tenants"].items()):
        owner[t["key_id"]] = name
        for v, ent in t["versions"].items():
            keys[(t["key_id"], int(v))] = _unwrap(provider, ent["wrapped"], path, f"tenants[{_label(t, i)}].versions.{v}.wrapped")
    return FileState(doc, keys, owner, pk, _stamp(st))


# ---- the document's members (docs/format.md, "G4 keyring") ----------------------------------------------------
_HEX32 = re.compile(r"[0-9a-f]{32}")
_VERSION = re.compile(r"[1-9][0-9]*")
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
               float: "a number", type(None): "null"}


def check_doc(doc: Doc, where: Path) -> None:
    """Check every member the keyring code reads besides ``format`` and ``kek_id``: ``pseudonym_key`` a string;
    ``tenants`` an object whose entries hold ``pseudonym`` (32 lowercase hex), ``key_id`` (an integer, u32,
    unique in the file), ``versions`` (at least one, named ``1``, ``2``, ..., each an object with the strings
    ``wrapped`` and ``created`` and, if present, ``uses`` an integer >= 0) and ``current`` (an integer naming one
    of them); ``revoked``, if present, an object of pseudonym hex -> ``{"revoked_at": <number>, "key_ids":
    [<integer>, ...] (optional)}``. Members it does not know are ignored. Until 2026-12 only part of this was
    checked: a hand-edited file without ``tenants`` or a tenant's ``current`` loaded, and the first use raised a
    bare KeyError (a traceback from ``keys list``, an exception out of a worker's G4 offload).

    Raises:
        KeyringError: naming ``where`` and the member, e.g. ``tenants[pseudonym 5f0c...].current: missing``. A
            tenant is named by its pseudonym, or by its place in the file when that is unusable: never by its
            id (a worker logs this message; tenant ids stay inside the keyring).
    """
    if not isinstance(doc.get("pseudonym_key"), str):
        _bad(where, "pseudonym_key", _problem(doc, "pseudonym_key", "a string: the wrapped pseudonym key, base64"))
    tenants = doc.get("tenants")
    if not isinstance(tenants, dict):
        _bad(where, "tenants", _problem(doc, "tenants", "an object: tenant id -> entry, {} for none"))
    by_key_id: dict[int, str] = {}
    for i, t in enumerate(tenants.values()):
        field = f"tenants[{_label(t, i)}]"
        if not isinstance(t, dict):
            _bad(where, field, f"{_JSON_TYPES.get(type(t), type(t).__name__)}, expected an object")
        if not (isinstance(t.get("pseudonym"), str) and _HEX32.fullmatch(t["pseudonym"])):
            _bad(where, f"{field}.pseudonym", _problem(t, "pseudonym", "32 lowercase hex characters"))
        if not (_is_int(t.get("key_id")) and 0 <= t["key_id"] < 2 ** 32):
            _bad(where, f"{field}.key_id", _problem(t, "key_id", "an integer in [0, 2**32)"))
        if not (isinstance(t.get("versions"), dict) and t["versions"]):
            _bad(where, f"{field}.versions", _problem(t, "versions", "an object: version -> wrapped key, at least one"))
        if t["key_id"] in by_key_id:
            _bad(where, f"{field}.key_id", f"{t['key_id']} is also tenants[{by_key_id[t['key_id']]}]'s: key ids "
                                           "are unique in the file (a key id names one tenant)")
        by_key_id[t["key_id"]] = _label(t, i)
        for vname, ent in t["versions"].items():
            vfield = f"{field}.versions.{vname}"
            if _VERSION.fullmatch(vname) is None:
                _bad(where, vfield, "a version is named by its number, 1, 2, ... (no sign, no leading zero)")
            if not isinstance(ent, dict):
                _bad(where, vfield, f"{_JSON_TYPES.get(type(ent), type(ent).__name__)}, expected an object")
            for name, what in (("wrapped", "a string: the wrapped data key, base64"),
                               ("created", "a string: the ISO-8601 UTC creation time")):
                if not isinstance(ent.get(name), str):
                    _bad(where, f"{vfield}.{name}", _problem(ent, name, what))
            if "uses" in ent and not (_is_int(ent["uses"]) and ent["uses"] >= 0):
                _bad(where, f"{vfield}.uses", _problem(ent, "uses", "an integer >= 0: encryptions counted"))
        if not _is_int(t.get("current")):
            _bad(where, f"{field}.current", _problem(t, "current", "an integer: the version new writes use"))
        if str(t["current"]) not in t["versions"]:
            _bad(where, f"{field}.current", f"{t['current']} names no version (versions: {', '.join(t['versions'])})")
    _check_revoked(doc, where)


def _check_revoked(doc: Doc, where: Path) -> None:
    """:func:`check_doc`'s part for ``revoked`` (absent: none)."""
    revoked = doc.get("revoked", {})
    if not isinstance(revoked, dict):
        _bad(where, "revoked", _problem(doc, "revoked", "an object: pseudonym hex -> revocation record"))
    for i, (ps, rec) in enumerate(revoked.items()):
        field = f"revoked.{ps}" if _HEX32.fullmatch(ps) else f"revoked[#{i + 1} in file order]"
        if _HEX32.fullmatch(ps) is None:
            _bad(where, field, "a revoked tenant is named by its pseudonym, 32 lowercase hex characters")
        if not isinstance(rec, dict):
            _bad(where, field, f"{_JSON_TYPES.get(type(rec), type(rec).__name__)}, expected an object")
        at = rec.get("revoked_at")
        if not _is_time(at):
            _bad(where, f"{field}.revoked_at", _problem(rec, "revoked_at", "a number: the revocation's Unix time"))
        ids = rec.get("key_ids", [])
        if not (isinstance(ids, list) and all(_is_int(k) for k in ids)):
            _bad(where, f"{field}.key_ids", _problem(rec, "key_ids", "an array of integers: the key ids revoked"))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true/false are no integers


def _is_time(v: object) -> bool:
    """A JSON number that is a finite float (``revoked()`` returns it as one)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an integer past float's range
        return False


def _label(t: object, i: int) -> str:
    """How a message names the ``i``-th tenant entry (0-based, file order): by its pseudonym, else by place."""
    ps = t.get("pseudonym") if isinstance(t, dict) else None
    if isinstance(ps, str) and _HEX32.fullmatch(ps):
        return f"pseudonym {ps}"
    return f"#{i + 1} in file order"


def _problem(obj: dict[str, Any], name: str, what: str) -> str:
    """``missing (WHAT)`` or ``<its JSON type or value>, expected WHAT``."""
    if name not in obj:
        return f"missing ({what})"
    v = obj[name]  # a string is not shown: it may be key material (wrapped) or hold a tenant id
    shown = repr(v) if _is_int(v) else _JSON_TYPES.get(type(v), "a value")
    return f"{shown}, expected {what}"


def _bad(where: Path, field: str, problem: str) -> NoReturn:
    raise KeyringError(f"keyring {where}: {field}: {problem} (docs/format.md, \"G4 keyring\"; fix the file or "
                       "restore a good copy)")


def _unwrap(provider: KeyProvider, b64: str, where: Path, field: str) -> bytes:
    """Unwrap the key ``field`` holds (base64 ``b64``). KeyringError naming ``where`` and ``field``."""
    try:
        wrapped = base64.b64decode(b64, validate=True)
    except ValueError as e:
        raise KeyringError(f"keyring {where}: {field}: not base64 ({e})") from None
    try:
        return provider.unwrap(wrapped)
    except KeyringError as e:
        raise KeyringError(f"keyring {where}: {field}: {e}") from None
    except ValueError as e:  # not the size of a wrapped key
        raise KeyringError(f"keyring {where}: {field}: not a wrapped key ({e})") from None


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


def create_tenant(doc: Doc, tenant: str, *, pseudonym: Callable[[str], bytes], provider: KeyProvider, where: Path,
                  implicit: bool, max_auto: int) -> None:
    """Add ``tenant`` (:func:`add_tenant`) unless ``doc`` has it; ``pseudonym``: the keyring's (read when
    applied: the pseudonym key of the version read). ``implicit`` (a worker's first write) raises
    :class:`TenantRevoked` for a revoked tenant and :class:`UnknownTenant` once ``doc`` holds ``max_auto``
    tenants; either way :func:`~.names.check_storable_tenant` (an id the file cannot keep)."""
    if tenant in doc["tenants"]:
        return
    check_storable_tenant(tenant, where, implicit)
    ps = pseudonym(tenant).hex()
    if implicit and ps in doc.get("revoked", {}):
        raise TenantRevoked(f"keyring {where}: tenant {ps} (pseudonym) was revoked; only `kvbm-backend keys create` "
                            "re-creates it")
    if implicit and len(doc["tenants"]) >= max_auto:
        raise UnknownTenant(limit_msg(where, ps, max_auto))
    add_tenant(doc, tenant, ps, provider)


def limit_msg(where: Path, pseudonym_hex: str, max_auto: int) -> str:
    """The refusal of an implicit creation at ``g4.keyring.max_auto_tenants``."""
    return (f"keyring {where}: no key for tenant {pseudonym_hex} (pseudonym) and the keyring holds "
            f"g4.keyring.max_auto_tenants={max_auto} tenants: no more are created implicitly; create it with "
            "`kvbm-backend keys create`")


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
