"""Per-tenant data keys, wrapped by a key-encryption key (KEK), in a versioned keyring file.

File format: JSON ``"format": "kvbm-backend-keyring/1"`` (fields and version rules: docs/format.md, "G4 keyring"),
written atomically with mode 0600 under an advisory lock (``PATH.lock``) so several worker processes on one host
can share it.

* Data keys are 256-bit AES-GCM keys, wrapped with AES key wrap (RFC 3394) under the KEK. The KEK
  comes from a :class:`KeyProvider`: :class:`LocalKek` reads it from an env var (base64 of 32 bytes)
  or a KEK file; a KMS-backed provider only has to implement ``wrap``/``unwrap``.
* ``rotate`` adds a version used for new writes; older versions stay for reads. ``rewrap`` re-wraps
  every key under a new KEK without touching stored blocks. ``revoke`` deletes a tenant's keys
  (crypto-shred) and records its pseudonym and time so ``kvbm-backend gc`` can reclaim its blocks.
* Use counts per key version are kept in memory and merged into the file periodically and at
  :meth:`Keyring.close`; a version is rotated automatically once it reaches ``rotate_after_uses``
  encryptions (default 2**31, half the SP 800-38D 8.3 limit of 2**32 for random 96-bit nonces).
* Tenant ids appear only inside the keyring; stored names and frames carry the pseudonym
  ``HMAC-SHA256(pseudonym_key, tenant)[:16]``. Nothing here prints or logs key material.
* **Read-only keyrings** (a read-only mount, a Kubernetes Secret/ConfigMap volume, or
  ``read_only=True``): no write, no lock file, no key creation or rotation; use counts stay in memory
  (per process). Every keyring, read-only or not, re-reads the file when its mtime/ctime/size/inode
  changed, checked at most every ``reload_every_s`` seconds on use: a change (revocation, new tenant,
  rotation) reaches a running process within ``reload_every_s`` of being visible at ``path``. A file
  that stops loading (missing, unparsable, a member missing or mistyped, insecure mode, other KEK) fails
  closed: no key is served until it loads again.
* **Reload on a missing key.** A read needing a key id or version this keyring does not hold
  (:meth:`read_key`: a tenant or rotation of another worker), or :meth:`write_key` about to refuse an
  unknown tenant, runs the same check at once (at most one per ``miss_reload_min_s``, default 0.1 s) and
  looks the key up once more; still absent, it is a miss. :meth:`stats` counts loads and on-miss checks.
* A keyring file deleted while a process runs (a crypto-shred of every tenant) is not written back: a change
  publishes only over the version it read (:mod:`.keyring_publish`; a plain ``rm`` racing the rename itself, a
  window of microseconds, still loses: ``kvbm-backend keys destroy`` deletes under the lock). A new file made
  there (``keys create``) has a new pseudonym key: :meth:`naming_generation` counts such changes.
* **Tenants are created explicitly** (:meth:`Keyring.create`, ``kvbm-backend keys create``), or on
  first write only when ``auto_create_tenants`` and the keyring is writable. A revoked tenant is never
  re-created implicitly: :meth:`write_key` raises :class:`TenantRevoked` until an explicit ``create``.
* A data key serves only its own tenant: :meth:`read_key` with ``tenant`` returns None for a key id
  that belongs to another tenant (a blob sealed with B's key under A's name is not A's).
* **Locking.** Changes to the file hold its inter-process lock (``PATH.lock``) first and the keyring's
  in-process mutex only briefly inside it, to install what was read and to take or put back use
  counts: the file read, the KEK wraps and the write with its fsyncs run without the mutex, so
  :meth:`tenant_state`, :meth:`read_key` and the encryptions of other tenants never wait for them
  (an implicit tenant creation or rotation on the seal path held the mutex through its fsyncs until
  2026-12: other tenants' G4 loads timed out behind a slow disk and opened the G4 breaker).

Errors are :class:`KeyringError` with a message naming the file or variable at fault.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, TypeVar, overload

from ..fsmodes import makedirs_private
from ..model.namespace import tenant_bytes
from .kek import (KEY_BYTES, DataKey, KeyProvider, KeyringError, LocalKek, TenantRevoked, UnknownTenant, _stamp,
                  check_kek_env, dir_is_read_only, generate_kek_b64, locked_file, provider_for)
from .keyring_file import (FORMAT, FileState, create_tenant, limit_msg, read_keyring, revoke_tenant, revoked_key_ids,
                           rewrap_doc, rotate_tenant, tenant_rows)
from .keyring_persist import Doc, Stamp, UseCounts
from .keyring_publish import create_keyring, publish_keyring, retry_replaced  # publish: only over what was read
from .names import NAME_KEY_LABEL, UNKEYED_PSEUDONYM_KEY, auto_creatable, check_storable_tenant, derive_name_key

NIST_GCM_RANDOM_NONCE_LIMIT = 2 ** 32
DEFAULT_ROTATE_AFTER = 2 ** 31
DEFAULT_MISS_RELOAD_MIN_S = 0.1  # on-miss keyring checks: at most one per this many seconds per keyring
DEFAULT_MAX_AUTO_TENANTS = 4096  # implicit tenant creation stops at this many tenants in the file

__all__ = ["DEFAULT_MAX_AUTO_TENANTS", "DEFAULT_MISS_RELOAD_MIN_S", "DEFAULT_ROTATE_AFTER", "FORMAT", "KEY_BYTES",
           "NAME_KEY_LABEL", "NIST_GCM_RANDOM_NONCE_LIMIT", "UNKEYED_PSEUDONYM_KEY", "derive_name_key", "DataKey",
           "KeyProvider", "Keyring", "KeyringError", "LocalKek", "TenantRevoked", "UnknownTenant", "dir_is_read_only",
           "generate_kek_b64", "provider_for"]  # the KEK names: from .kek; the naming keys: from .names

log = logging.getLogger(__name__)
T = TypeVar("T")
if TYPE_CHECKING:
    from ..config import KeyringConfig


class Keyring:
    """A keyring file plus its KEK provider. Thread-safe; several processes may share the file. Lock
    order: the file lock, then ``_mu``; ``_mu`` is never held during file writes (module docstring).

    Args:
        path: the keyring JSON file.
        provider: the KEK (:func:`provider_for` builds one from config).
        create: create an empty keyring when ``path`` does not exist (else KeyringError).
        rotate_after_uses: encryptions per key version before automatic rotation (<= 2**32).
        persist_every_s: how often use counts are merged into the file (also at :meth:`close`), on a
            background thread: the fsyncs of a persist never hold up :meth:`write_key` (it once held
            every G4 writer of a worker for 3 s on a loaded disk).
        reload_every_s: the file is checked for changes at most this often (on use); the bound within
            which a revocation, rotation or new tenant reaches this process.
        miss_reload_min_s: the least time between two on-miss checks (a read needs a key this keyring
            does not hold: the file is checked at once, then the key looked up once more).
        read_only: never write (no lock file, no creation, no rotation; use counts in memory);
            None: read-only when the keyring's directory cannot be written (:func:`dir_is_read_only`).
        auto_create_tenants: :meth:`write_key` creates a data key for an unknown tenant (writable
            keyrings only; never for a revoked tenant). Off: :class:`UnknownTenant`.
        max_auto_tenants: :meth:`write_key` creates no tenant once the file holds this many
            (:class:`UnknownTenant`; checked again under the file lock): a flood of client-chosen tenant
            ids cannot grow the file, every worker's copy of it and each rewrite without bound.
            :meth:`create` by the operator is not limited.
    """

    def __init__(self, path: str | os.PathLike[str], provider: KeyProvider, *, create: bool = True,
                 rotate_after_uses: int = DEFAULT_ROTATE_AFTER, persist_every_s: float = 30.0,
                 reload_every_s: float = 2.0, read_only: bool | None = None, auto_create_tenants: bool = True,
                 miss_reload_min_s: float = DEFAULT_MISS_RELOAD_MIN_S,
                 max_auto_tenants: int = DEFAULT_MAX_AUTO_TENANTS) -> None:
        if not 1 <= rotate_after_uses <= NIST_GCM_RANDOM_NONCE_LIMIT:
            raise KeyringError(f"rotate_after_uses: must be in [1, 2**32], got {rotate_after_uses}")
        if not miss_reload_min_s >= 0:
            raise KeyringError(f"miss_reload_min_s: must be >= 0, got {miss_reload_min_s}")
        self.path = Path(path)
        self.provider = provider
        self.rotate_after = rotate_after_uses
        self.persist_every_s = persist_every_s
        self.reload_every_s = reload_every_s
        self.miss_reload_min_s = float(miss_reload_min_s)
        self.read_only = dir_is_read_only(self.path) if read_only is None else bool(read_only)
        self.auto_create_tenants = bool(auto_create_tenants)
        if not max_auto_tenants >= 0:
            raise KeyringError(f"max_auto_tenants: must be >= 0, got {max_auto_tenants}")
        self.max_auto_tenants = int(max_auto_tenants)
        self._mu = threading.RLock()
        self._doc: Doc = {}
        self._keys: dict[tuple[int, int], bytes] = {}  # (key_id, version) -> unwrapped key
        self._owner: dict[int, str] = {}  # key_id -> tenant
        self._naming: tuple[int, bytes] = (0, b"")  # (generation, pseudonym key): one tuple, read without _mu
        self._stamp: tuple[int, int, int, int, int] | None = None
        self._error: str | None = None  # set while the file does not load: fail closed
        self._logged_errors: set[str] = set()
        self._last_check = 0.0
        self._last_miss_check = float("-inf")
        self._n = {"loads": 0, "miss_reloads": 0, "miss_reload_loads": 0, "miss_reloads_limited": 0}
        self._uses = UseCounts(mu=self._mu, file_lock=self._locked, reload=self._reload,
                               write=partial(publish_keyring, self.path),
                               warn_once=self._warn_once, every_s=persist_every_s, writable=not self.read_only,
                               where=str(self.path))  # uses not yet in the file, persisted in the background
        if self.path.exists():
            self._load()  # writers publish with an atomic rename: reading needs no lock
        elif self.read_only:
            raise KeyringError(f"keyring {self.path}: not found (read-only keyring: create it where it is writable "
                               "with `kvbm-backend keys create`, then mount it)")
        elif create:
            makedirs_private(self.path.parent)  # 0700, parents too, whatever the umask
            with self._locked():
                if self.path.exists():
                    self._load()
                else:
                    create_keyring(self.path, provider)
                    self._load()
        else:
            raise KeyringError(f"keyring {self.path}: not found")

    @classmethod
    def from_config(cls, cfg: KeyringConfig, *, create: bool = True) -> "Keyring":
        """Open the keyring a :class:`kvbm_backend.config.KeyringConfig` names (a leading ``~`` of ``path`` and
        ``kek_file`` is the home directory, as ``doctor`` reads them: docs/configuration.md). Raises KeyringError."""
        if not cfg.path:
            raise KeyringError("g4.keyring.path: required when g4.encrypt is true (a keyring file, created 0600)")
        check_kek_env(cfg)  # KeyringError: a non-default kek_env is unset (never a node-local KEK file instead)
        path, kf = os.path.expanduser(cfg.path), getattr(cfg, "kek_file", None)  # before 2026-12-03: ./~/... made
        ro = dir_is_read_only(path) if (ro := getattr(cfg, "read_only", None)) is None else ro
        prov = provider_for(path, cfg.kek_env, kf and os.path.expanduser(kf), create=create and not ro)
        return cls(path, prov, create=create,
                   rotate_after_uses=getattr(cfg, "rotate_after_uses", DEFAULT_ROTATE_AFTER),
                   reload_every_s=getattr(cfg, "reload_interval_s", 2.0), read_only=ro,
                   auto_create_tenants=getattr(cfg, "auto_create_tenants", True),
                   max_auto_tenants=getattr(cfg, "max_auto_tenants", DEFAULT_MAX_AUTO_TENANTS))

    # ---- file handling ---------------------------------------------------------------------
    def _locked(self) -> ContextManager[None]:
        return locked_file(f"{self.path}.lock")  # the keyring's inter-process lock: PATH.lock, flock'd

    def _load(self) -> None:
        """Read the file (:func:`read_keyring`) and install it. Raises KeyringError."""
        self._install(read_keyring(self.path, self.provider))

    def _install(self, st: FileState) -> None:
        """Make ``st`` the keyring's state. Caller holds ``_mu`` (or is the constructor)."""
        self._doc, self._keys, self._owner = st.doc, st.keys, st.owner
        if st.pseudonym_key != self._naming[1]:  # another pseudonym key: the file was replaced (a new keyring)
            self._naming = (self._naming[0] + bool(self._naming[1]), st.pseudonym_key)  # 0: the first loaded
        self._stamp, self._error, self._last_check = st.stamp, None, time.monotonic()
        self._n["loads"] += 1

    def _reload(self) -> tuple[Doc, Stamp]:
        """:meth:`_load`; the document and its version's stamp. The file exists from construction on: missing,
        it was deleted (a crypto-shred), so KeyringError (before 2026-11-29 a flush or close wrote it back)."""
        self._load()
        assert self._stamp is not None  # set by every load
        return self._doc, self._stamp

    def _check_writable(self) -> None:
        if self.read_only:
            raise KeyringError(f"keyring {self.path}: read-only here (read-only mount or g4.keyring.read_only); "
                               "change it where it is writable (`kvbm-backend keys ...`)")

    def _mutate(self, fn: Callable[[Doc], T]) -> T:
        """Under the file lock: re-read the file, merge pending use counts, apply ``fn`` to a copy of the
        document, write it, re-read. ``_mu`` is taken only to install what was read and to take (or put
        back) the counts; the reads, ``fn`` (its KEK wraps) and the write (its fsyncs) run without it, so
        no reader waits for them. The caller must not hold ``_mu`` (lock order: file lock, then ``_mu``).
        If ``fn`` or the write fails the counts stay pending (before 2026-11-29 a refused tenant id dropped
        them all)."""
        self._check_writable()
        with self._locked():
            out = retry_replaced(partial(self._mutate_once, fn))  # again: the file was replaced without the lock
            st = read_keyring(self.path, self.provider)
            with self._mu:
                self._install(st)
            return out

    def _mutate_once(self, fn: Callable[[Doc], T]) -> T:
        """One try of :meth:`_mutate`, file lock held. Raises KeyringReplaced (file replaced since read)."""
        st = read_keyring(self.path, self.provider)  # missing (deleted: a crypto-shred): never written back
        with self._mu:
            self._install(st)
            merged = self._uses.merge_into(self._doc)  # counted in the document from now on (rotation)
            doc = json.loads(json.dumps(self._doc))
        try:
            out = fn(doc)
            publish_keyring(self.path, doc, st.stamp)  # only over the version read; gone: KeyringError, as at the read
        except BaseException:
            try:
                back: FileState | None = read_keyring(self.path, self.provider)  # the file as it is
            except KeyringError:
                back = None
            with self._mu:
                self._uses.restore(merged)
                if back is not None:
                    self._install(back)  # without the merged counts, now pending again
            raise
        return out

    def _maybe_reload(self, *, on_miss: bool = False) -> bool:
        """Re-read the file if it changed. Periodic (the default): checked at most every
        ``reload_every_s``. ``on_miss`` (a key this keyring does not hold was asked for): checked now,
        unless another on-miss check ran less than ``miss_reload_min_s`` ago. A file that does not load
        fails closed (:attr:`error` set, no key served) and is retried on the next check. Returns True
        when a new version of the file was loaded. Caller holds ``_mu``."""
        now = time.monotonic()
        if on_miss:
            if now - self._last_miss_check < self.miss_reload_min_s:
                self._n["miss_reloads_limited"] += 1
                return False
            self._last_miss_check = now
            self._n["miss_reloads"] += 1
        elif now - self._last_check < self.reload_every_s:
            return False
        self._last_check = now
        try:
            changed = _stamp(self.path.stat()) != self._stamp
        except OSError:
            changed = True
        if not changed and self._error is None:
            return False
        try:
            self._load()
        except KeyringError as e:
            self._fail(str(e))
            return False
        except Exception as e:  # noqa: BLE001 - e.g. a KMS provider's error: fail closed, never raise here
            self._fail(f"keyring {self.path}: {type(e).__name__}: {e}")
            return False
        if on_miss:
            self._n["miss_reload_loads"] += 1
        return True

    def _fail(self, msg: str) -> None:
        self._error = msg
        self._last_check = time.monotonic()
        self._warn_once(msg, logging.ERROR, "%s; serving no G4 keys until it loads again")

    def _warn_once(self, msg: str, level: int = logging.WARNING, fmt: str = "%s") -> None:
        """Log ``msg`` the first time only (at most 64 distinct messages are remembered)."""
        if msg not in self._logged_errors and len(self._logged_errors) < 64:
            self._logged_errors.add(msg)
            log.log(level, fmt, msg)

    def flush(self) -> None:
        """Merge in-memory use counts into the file (under the lock), after a background persist in
        flight has written its share. Read-only keyrings keep them in memory (this process's counts)."""
        self._uses.wait()
        with self._mu:
            pending = len(self._uses) > 0 and not self.read_only
        if pending:
            self._mutate(lambda doc: None)

    def close(self) -> None:
        """Persist use counts (:meth:`flush`)."""
        self.flush()

    @property
    def error(self) -> str | None:
        """Why the keyring file does not load right now (None when it does)."""
        return self._error

    def stats(self) -> dict[str, int]:
        """Counters: ``loads`` (file versions read, the first included), ``miss_reloads`` (on-miss
        checks run), ``miss_reload_loads`` (of those, the ones that found and loaded a new version),
        ``miss_reloads_limited`` (on-miss checks skipped by the ``miss_reload_min_s`` rate limit)."""
        with self._mu:
            return dict(self._n)

    # ---- tenants ---------------------------------------------------------------------------
    def pseudonym(self, tenant: str) -> bytes:
        """16-byte pseudonym of ``tenant``: HMAC-SHA256(pseudonym key, UTF-8 tenant id)[:16]."""
        return hmac.new(self._naming[1], tenant_bytes(tenant), hashlib.sha256).digest()[:16]

    def name_key(self, pseudonym: bytes) -> bytes:
        """The 32-byte key G4 names a tenant's blocks with (:func:`derive_name_key` under the keyring's
        pseudonym key), from the tenant's 16-byte ``pseudonym``: the same in every process sharing the
        file, unchanged by ``rewrap``; nothing is stored for it (no file format change)."""
        return derive_name_key(self._naming[1], pseudonym)

    def naming(self, tenant: str) -> tuple[int, bytes, bytes]:
        """``(naming_generation, pseudonym, name key)`` of ``tenant`` (16 and 32 bytes), from one pseudonym key."""
        gen, pk = self._naming
        ps = hmac.new(pk, tenant_bytes(tenant), hashlib.sha256).digest()[:16]
        return gen, ps, derive_name_key(pk, ps)

    def naming_generation(self) -> int:
        """Which pseudonym key this keyring holds: 0 for the first loaded, one more each time a reload brings
        another (the file replaced: deleted, then ``keys create``): every tenant's pseudonym and G4 names
        change. Checks the file for changes first (at most every ``reload_every_s``); never raises."""
        with self._mu:
            self._maybe_reload()
            return self._naming[0]

    def create(self, tenant: str, *, implicit: bool = False) -> dict[str, Any]:
        """Create the tenant's first data key (no-op if it has one). Returns its :meth:`info` row.

        Explicit (operator) creation also re-creates a revoked tenant, with a new key id (its old
        blocks stay unreadable; the revocation record stays for ``gc``). ``implicit`` (a worker's
        first write) raises :class:`TenantRevoked` for a revoked tenant, checked under the file lock."""
        self._mutate(self._create_fn(tenant, implicit))
        return self.info(tenant)

    def _create_fn(self, tenant: str, implicit: bool) -> Callable[[Doc], None]:
        return partial(create_tenant, tenant=tenant, pseudonym=self.pseudonym, provider=self.provider,
                       where=self.path, implicit=implicit, max_auto=self.max_auto_tenants)

    def rotate(self, tenant: str) -> dict[str, Any]:
        """New data key version for new writes; older versions stay readable. Raises TenantRevoked (revoked,
        maybe since a :meth:`write_key` caller's last reload) or KeyringError (unknown), naming the pseudonym only."""
        ps = self.pseudonym(tenant).hex()

        def fn(doc: Doc) -> None:
            if tenant not in doc["tenants"]:
                raise (TenantRevoked if ps in doc.get("revoked", {}) else KeyringError)(
                    f"keyring {self.path}: no tenant {ps} (pseudonym; revoked tenants: `keys create` re-creates)")
            rotate_tenant(doc, tenant, self.provider, self.path, None)
        self._mutate(fn)
        return self.info(tenant)

    def revoke(self, tenant: str) -> dict[str, Any]:
        """Crypto-shred ``tenant``, record it revoked (:func:`~.keyring_file.revoke_tenant`). KeyringError: unknown."""
        ps = self._mutate(partial(revoke_tenant, tenant=tenant, where=self.path))
        return {"tenant": tenant, "pseudonym": ps, "revoked": True}

    def rewrap(self, new_provider: KeyProvider) -> int:
        """Re-wrap every key under ``new_provider``'s KEK (no block is rewritten). Returns keys re-wrapped."""
        self._check_writable()
        with self._locked(), self._mu:  # an operator's change: readers wait for its write (lock order kept)
            n = retry_replaced(partial(self._rewrap_once, new_provider))
            self.provider = new_provider
            self._load()
            return n

    def _rewrap_once(self, new_provider: KeyProvider) -> int:
        cur, read = self._reload()  # file lock and _mu held
        doc = json.loads(json.dumps(cur))
        merged = self._uses.merge_into(doc)
        try:
            n = rewrap_doc(doc, self._keys, self._naming[1], new_provider)
            publish_keyring(self.path, doc, read)
        except BaseException:
            self._uses.restore(merged)
            raise
        return n

    @overload
    def info(self, tenant: None = None) -> list[dict[str, Any]]: ...

    @overload
    def info(self, tenant: str) -> dict[str, Any]: ...

    def info(self, tenant: str | None = None) -> list[dict[str, Any]] | dict[str, Any]:
        """Tenants, versions, use counts, created dates; never key material."""
        with self._mu:
            rows = tenant_rows(self._doc, self._uses.pending)
            if tenant is not None:
                for r in rows:
                    if r["tenant"] == tenant:
                        return r
                raise KeyringError(f"keyring {self.path}: no tenant {tenant!r}")
            return rows

    def revoked(self) -> dict[str, float]:
        """Pseudonym hex -> revocation time (epoch seconds) of revoked tenants."""
        with self._mu:
            self._maybe_reload()
            return {k: float(v["revoked_at"]) for k, v in self._doc.get("revoked", {}).items()}

    def revoked_key_ids(self, pseudonym_hex: str) -> frozenset[int]:
        """Data key ids revoked for pseudonym ``pseudonym_hex`` (empty: none recorded); never readable again."""
        with self._mu:
            self._maybe_reload()
            return revoked_key_ids(self._doc.get("revoked", {}).get(pseudonym_hex, {}))

    def tenant_state(self, tenant: str) -> str:
        """``"active"`` (has a data key), ``"revoked"``, ``"unknown"``, or ``"unavailable"`` (the file
        does not load right now), as of the last reload (at most ``reload_every_s`` old)."""
        return self.tenant_key(tenant)[0]

    def tenant_key(self, tenant: str) -> tuple[str, int | None]:
        """``(tenant_state, its current data key's id)``; the id None unless active (re-created: a new id)."""
        with self._mu:
            self._maybe_reload()
            st = "unavailable" if self._error is not None else "active" if tenant in self._doc["tenants"] else (
                "revoked" if self.pseudonym(tenant).hex() in self._doc.get("revoked", {}) else "unknown")
            return st, int(self._doc["tenants"][tenant]["key_id"]) if st == "active" else None

    def key_owner(self, key_id: int) -> str | None:
        """The tenant whose data key has ``key_id`` (None: no current tenant has it)."""
        with self._mu:
            return self._owner.get(int(key_id))

    # ---- hot path --------------------------------------------------------------------------
    def write_key(self, tenant: str) -> DataKey:
        """The current data key of ``tenant`` for one encryption, counting the use and rotating first
        if the version reached ``rotate_after_uses``.

        An unknown tenant is created only when ``auto_create_tenants`` and the keyring is writable
        (else :class:`UnknownTenant`); a revoked one never (:class:`TenantRevoked`). A read-only keyring
        refuses a version that reached ``rotate_after_uses`` encryptions in this process (KeyringError:
        rotate it with ``keys rotate``). A keyring file that does not load: KeyringError.

        A creation or rotation runs without ``_mu`` (:meth:`_mutate`), then the look-up is repeated:
        two threads creating one tenant at once both get the one key the file lock let through."""
        created = False
        while True:
            with self._mu:
                t = self._tenant_for_write(tenant, created)
                if t is not None:
                    ver = t["current"]
                    uses = int(t["versions"][str(ver)].get("uses", 0)) + self._uses.pending(tenant, ver)
                    if uses < self.rotate_after:
                        self._uses.count(tenant, ver)  # starts a background persist once per persist_every_s
                        return DataKey(int(t["key_id"]), ver, self._keys[(int(t["key_id"]), ver)])
                    if self.read_only:
                        raise KeyringError(f"keyring {self.path}: key version {ver} of tenant {t['pseudonym']} "
                                           f"(pseudonym) reached {self.rotate_after} encryptions and this keyring "
                                           "is read-only; rotate it with `kvbm-backend keys rotate`")
            if t is None:  # the file I/O without _mu: readers and other tenants' seals go on
                self._mutate(self._create_fn(tenant, True))
                created = True
            else:
                self._mutate(partial(rotate_tenant, tenant=tenant, provider=self.provider, where=self.path,
                                     from_version=ver))

    def _tenant_for_write(self, tenant: str, created: bool) -> dict[str, Any] | None:
        """``tenant``'s entry for :meth:`write_key`, or None: create it (implicitly). Raises what
        :meth:`write_key` documents. Caller holds ``_mu``."""
        self._maybe_reload()
        if self._error is not None:
            raise KeyringError(self._error)
        t: dict[str, Any] | None = self._doc["tenants"].get(tenant)
        if t is None and (self.read_only or not self.auto_create_tenants or not auto_creatable(tenant)
                          or len(self._doc["tenants"]) >= self.max_auto_tenants):
            if self._maybe_reload(on_miss=True):
                t = self._doc["tenants"].get(tenant)  # created elsewhere since our last reload
            elif self._error is not None:
                raise KeyringError(self._error)
        if t is not None:
            return t
        if self.pseudonym(tenant).hex() in self._doc.get("revoked", {}):
            raise TenantRevoked(f"keyring {self.path}: tenant {self.pseudonym(tenant).hex()} (pseudonym) was "
                                "revoked; only `kvbm-backend keys create` re-creates it")
        if created:  # our creation went in, yet the tenant is gone: revoked since (or the file replaced)
            raise TenantRevoked(f"keyring {self.path}: tenant {self.pseudonym(tenant).hex()} was revoked")
        if self.read_only or not self.auto_create_tenants:
            why = "read-only" if self.read_only else "g4.keyring.auto_create_tenants is off"
            raise UnknownTenant(f"keyring {self.path}: no key for tenant {self.pseudonym(tenant).hex()} "
                                f"(pseudonym) and {why}; create it with `kvbm-backend keys create`")
        if len(self._doc["tenants"]) >= self.max_auto_tenants:
            raise UnknownTenant(limit_msg(self.path, self.pseudonym(tenant).hex(), self.max_auto_tenants))
        check_storable_tenant(tenant, self.path, implicit=True)  # a long id: UnknownTenant, never created
        return None

    def read_key(self, key_id: int, version: int, tenant: str | None = None) -> bytes | None:
        """The data key a frame names, or None if this keyring does not hold it (revoked/foreign), the
        file does not load right now, or (with ``tenant``) the key id belongs to another tenant.

        A key not held as of the last reload triggers an on-miss check of the file (rate-limited,
        ``miss_reload_min_s``) and one more look-up: a tenant created, or a version rotated, by another
        process is served as soon as the file holding it is visible at ``path``."""
        with self._mu:
            self._maybe_reload()
            if self._error is not None:
                return None
            key = self._held_key(key_id, version, tenant)
            if key is None and self._maybe_reload(on_miss=True):  # True: a new version loaded
                key = self._held_key(key_id, version, tenant)
            return key

    def _held_key(self, key_id: int, version: int, tenant: str | None) -> bytes | None:
        if tenant is not None and self._owner.get(int(key_id)) != tenant:
            return None
        return self._keys.get((int(key_id), int(version)))
