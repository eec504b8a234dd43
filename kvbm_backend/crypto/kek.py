"""Key-encryption keys (KEKs) of the keyring (:mod:`.keyring`): the :class:`KeyProvider` protocol, the
local provider :class:`LocalKek` (env var or 0600 file, AES key wrap RFC 3394) and :func:`provider_for`;
the keyring's errors; the file checks both use (trusted directory and private files of this uid:
:func:`kvbm_backend.fsmodes.open_trusted`; read-only directory; directory fsync);
and the keyring file's small codecs (base64 fields, ISO times, change stamp) and :class:`DataKey`.

Nothing here prints or logs key material. Errors are :class:`KeyringError` naming the file or variable.
"""
from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import secrets
import socket
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, runtime_checkable

from ..fsmodes import UnsafePath, check_trusted_dir, makedirs_private, open_trusted
from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap, aes_key_wrap

KEY_BYTES = 32


class KeyringError(ValueError):
    """Keyring trouble: unreadable, insecure mode, wrong KEK, unknown tenant. Names the file/variable."""


def read_trusted(path: Path, what: str) -> tuple[bytes, os.stat_result]:
    """The bytes and status of ``what`` (the keyring or a KEK file) at ``path``, read from one open of
    :func:`~kvbm_backend.fsmodes.open_trusted` (a regular 0600/0400 file of this uid in a trusted directory;
    links: a Kubernetes Secret volume's only). Raises KeyringError naming ``what`` and ``path`` (missing,
    another uid's, in a directory others can write, insecure mode, unreadable).

    ``path`` a link (a Secret volume's) and its file gone between the links' resolution and the open: the
    kubelet's update renamed a new ``..data`` over the old and removed the old directory; resolved again,
    up to :data:`SWAP_RETRIES` times (before 2026-11-30 that read was "not found", the keyring failed closed)."""
    for attempt in range(SWAP_RETRIES + 1):
        try:
            with os.fdopen(open_trusted(path, what, follow_owned_links=True), "rb") as f:
                st = os.fstat(f.fileno())  # before the read: a change during it shows as a newer stamp next time
                return f.read(), st
        except UnsafePath as e:
            raise KeyringError(str(e)) from None
        except FileNotFoundError:
            if attempt < SWAP_RETRIES and os.path.islink(path):
                continue  # a Secret volume update replaced the file under us: resolve the links again
            raise KeyringError(f"{what} {path}: not found") from None
        except OSError as e:
            raise KeyringError(f"{what} {path}: {e.strerror or e}") from None
    raise AssertionError("unreachable")  # the last attempt returns or raises


SWAP_RETRIES = 3  # read_trusted: re-resolutions of a link whose target a Secret volume update removed


class KeyringReplaced(KeyringError):
    """The keyring file at the path is not the version a change read: another file was put there without
    the keyring's lock (a copy restored with ``cp``/``mv``). Nothing was written; the change is re-read and
    applied again (:func:`~.keyring_publish.retry_replaced`)."""


class UnknownTenant(KeyringError):
    """No data key for the tenant, and this keyring may not create one (read-only or
    ``auto_create_tenants`` off)."""


class TenantRevoked(KeyringError):
    """The tenant was revoked; only an explicit :meth:`Keyring.create` (``keys create``) brings it back."""


def dir_is_read_only(path: str | os.PathLike[str]) -> bool:
    """True when the directory holding keyring ``path`` cannot be written: a read-only filesystem
    (also for root: ``statvfs`` ``ST_RDONLY`` / ``EROFS``) or no write permission. A directory that
    does not exist yet is not read-only (it will be created)."""
    d = Path(path).parent
    if not d.exists():
        return False
    try:
        if os.statvfs(d).f_flag & os.ST_RDONLY:
            return True
    except OSError:
        pass
    return not os.access(d, os.W_OK)


@runtime_checkable
class KeyProvider(Protocol):
    """Wraps and unwraps data keys under a key-encryption key it never reveals (KMS-shaped).

    ``key_id`` is a non-secret identifier stored in the keyring so a wrong KEK is reported clearly.
    ``unwrap`` raises KeyringError when the wrapped key was not made by this KEK.
    """

    key_id: str

    def wrap(self, key: bytes) -> bytes: ...

    def unwrap(self, wrapped: bytes) -> bytes: ...


class LocalKek:
    """A 256-bit KEK held in process memory (from env or a 0600 file); AES key wrap, RFC 3394."""

    def __init__(self, kek: bytes, source: str = "memory"):
        if len(kek) != KEY_BYTES:
            raise KeyringError(f"{source}: KEK must be {KEY_BYTES} bytes, got {len(kek)}")
        self._kek = kek
        self.source = source
        self.key_id = hmac.new(kek, b"kvbm-backend kek id", hashlib.sha256).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"LocalKek(source={self.source!r}, key_id={self.key_id!r})"

    def wrap(self, key: bytes) -> bytes:
        return aes_key_wrap(self._kek, key)

    def unwrap(self, wrapped: bytes) -> bytes:
        try:
            return aes_key_unwrap(self._kek, wrapped)
        except InvalidUnwrap:
            raise KeyringError(f"KEK from {self.source} does not unwrap this key (wrong KEK?)") from None

    @classmethod
    def from_env(cls, var: str) -> "LocalKek":
        raw = os.environ.get(var)
        if raw is None:
            raise KeyringError(f"${var}: not set")
        try:
            kek = base64.b64decode(raw.strip(), validate=True)
        except ValueError:
            raise KeyringError(f"${var}: not valid base64") from None
        return cls(kek, source=f"${var}")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "LocalKek":
        p = Path(path)
        text, _ = read_trusted(p, "KEK file")
        try:
            kek = base64.b64decode(text.strip(), validate=True)
        except ValueError:
            raise KeyringError(f"KEK file {p}: not valid base64") from None
        return cls(kek, source=f"KEK file {p}")

    @staticmethod
    def generate_file(path: str | os.PathLike[str]) -> "LocalKek":
        """Create a new random KEK file (mode 0600) atomically. Raises KeyringError if it exists.

        The key is written to a unique temp name in the same directory, fsynced, then published with
        ``link()`` (create-exclusive), so a reader never sees a half-written KEK file and two processes
        creating it at once cannot both win.
        """
        p = Path(path)
        trusted_dir(p.parent, "KEK file")
        kek = secrets.token_bytes(KEY_BYTES)
        tmp = p.parent / f".{p.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(base64.b64encode(kek).decode() + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, p)
            except FileExistsError:
                raise KeyringError(f"KEK file {p}: already exists") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        _fsync_dir(p.parent)
        return LocalKek(kek, source=f"KEK file {p}")


def _fsync_dir(d: Path) -> None:
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


@contextlib.contextmanager
def locked_file(lock_path: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created 0600 if missing) for the ``with`` block: a
    regular file of this uid in a trusted directory, never a symbolic link (:func:`open_trusted`).
    Raises KeyringError (an unsafe lock file or directory) or OSError."""
    try:
        fd = open_trusted(lock_path, "keyring lock file", os.O_RDWR | os.O_CREAT, private=False)
    except UnsafePath as e:
        raise KeyringError(str(e)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


KEYRING_TMP_MARK = "kvbm-keyring-tmp"  # a keyring temp file: .PATH.kvbm-keyring-tmp.<host>.<pid>.<uuid hex>


def replace_private_json(path: Path, doc: object, before_publish: Callable[[], None] | None = None) -> None:
    """Replace ``path`` with ``doc`` as JSON atomically, mode 0600: a unique temp name in the same
    directory (``.NAME.kvbm-keyring-tmp.<host>.<pid>.<uuid>``), fsync, ``before_publish()`` (an exception
    it raises: nothing published, the temp file removed, the exception raised), rename, fsync the directory.
    The caller holds ``path``'s lock (``PATH.lock``), so any temp file of ``path`` found here is one a
    killed writer left: it is removed first (it holds every tenant's wrapped data key, a revoked one's
    too: left, it would outlive a crypto-shred), and the directory fsync makes that durable.
    Raises OSError, or what ``before_publish`` raises (the temp file removed either way)."""
    prefix = f".{path.name}.{KEYRING_TMP_MARK}."
    with os.scandir(path.parent) as entries:
        stale = [e.path for e in entries if e.name.startswith(prefix)]
    for s in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(s)
    tmp = path.parent / f"{prefix}{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if before_publish is not None:
            before_publish()  # keyring_publish: still the version read (a deletion is never undone here)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def generate_kek_b64() -> str:
    """A fresh random KEK, base64 (for ``export KVBM_BACKEND_KEK=...``)."""
    return base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()


def trusted_dir(d: str | os.PathLike[str], what: str) -> None:
    """:func:`kvbm_backend.fsmodes.check_trusted_dir` of an existing directory ``d`` (a missing one is
    created 0700 by whoever needs it). Raises KeyringError."""
    try:
        check_trusted_dir(d, what)
    except FileNotFoundError:
        pass
    except UnsafePath as e:
        raise KeyringError(str(e)) from None
    except OSError as e:
        raise KeyringError(f"directory {d} of the {what}: {e.strerror or e}") from None


DEFAULT_KEK_ENV = "KVBM_BACKEND_KEK"  # g4.keyring.kek_env when the operator names none


def kek_env_named(kc: Any) -> bool:
    """Whether ``g4.keyring.kek_env`` (``kc``: a :class:`kvbm_backend.config.KeyringConfig`) names a variable other
    than the default ``KVBM_BACKEND_KEK``: the operator chose that variable (e.g. a fleet Secret's), so it must be
    set. The default's name keeps the KEK file as its fallback (the example configs name it, for dev hosts too)."""
    return bool(kc.kek_env != DEFAULT_KEK_ENV)


def check_kek_env(kc: Any, environ: Mapping[str, str] | None = None) -> None:
    """A ``kek_env`` other than the default must be set (non-empty) in ``environ`` (None: this process's). Before 2026-12-03
    a named variable left unset (a Secret not wired into the pod) fell back to the node-local KEK file, and where
    the keyring did not exist yet the worker made a keyring and KEK of its own, silently: pods then could not
    read each other's G4 blocks. The default's name keeps the KEK file as the fallback (:func:`provider_for`).
    Raises KeyringError naming the field and the variable; reads nothing else, writes nothing."""
    if kek_env_named(kc) and not (os.environ if environ is None else environ).get(kc.kek_env):
        raise KeyringError(f"g4.keyring.kek_env: {kc.kek_env} is not set (the KEK variable this config names; "
                           f"without it a worker would use a node-local KEK file, creating one with a keyring of its "
                           f"own: set ${kc.kek_env} to the base64 32-byte KEK, e.g. from its Secret, or leave "
                           f"g4.keyring.kek_env at its default to use the KEK file)")


def provider_for(path: str | os.PathLike[str], kek_env: str = DEFAULT_KEK_ENV, kek_file: str | None = None,
                 create: bool = True) -> KeyProvider:
    """The KEK for keyring ``path``: ``$kek_env`` when set, else ``kek_file`` (default ``PATH.kek``).

    A missing KEK file is generated (0600) only when the keyring itself does not exist yet and
    ``create`` is true; otherwise KeyringError names what is missing. A caller holding a config checks a
    non-default ``kek_env`` first (:func:`check_kek_env`: :meth:`~kvbm_backend.crypto.keyring.Keyring.from_config` does).
    """
    if os.environ.get(kek_env):
        return LocalKek.from_env(kek_env)
    kf = Path(kek_file) if kek_file else Path(f"{path}.kek")
    trusted_dir(kf.parent, "KEK file")  # a KEK planted in a directory others can write is never used
    if os.path.lexists(kf):
        return LocalKek.from_file(kf)
    if create and not Path(path).exists():
        makedirs_private(kf.parent)  # 0700, parents too, whatever the umask
        try:
            return LocalKek.generate_file(kf)
        except KeyringError:
            if os.path.lexists(kf):  # another process (a worker starting beside us) created it first: use theirs
                return LocalKek.from_file(kf)
            raise
    raise KeyringError(f"keyring {path}: no KEK (set ${kek_env} to a base64 32-byte key or provide {kf})")


def _stamp(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What identifies one version of the keyring file (an atomic replace changes the inode)."""
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_dev)


class DataKey:
    """One tenant data key version. ``repr`` never shows the key bytes."""

    __slots__ = ("key_id", "version", "key")

    def __init__(self, key_id: int, version: int, key: bytes):
        self.key_id, self.version, self.key = key_id, version, key

    def __repr__(self) -> str:
        return f"DataKey(key_id={self.key_id}, version={self.version}, key=<redacted>)"


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()
