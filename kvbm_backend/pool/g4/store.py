"""The object store interface G4 sits on: whole-object create-exclusive puts, ranged gets, listing.

Implementations: :class:`~kvbm_backend.pool.g4.s3_store.S3Store` (S3-compatible servers),
:class:`~kvbm_backend.pool.g4.fs_store.FsStore` (shared POSIX mounts) and
:class:`~kvbm_backend.pool.g4.memory_store.MemoryStore` (in-process, tests), chosen by URL scheme in
:mod:`kvbm_backend.pool.g4.factory`; each has a ``from_url(url, parsed, opts)`` classmethod. Names are
``/``-separated relative keys (see :mod:`kvbm_backend.pool.g4.naming`); a store adds its own bucket/prefix/root.

Contract: an object is either absent or complete (never torn); ``put_if_absent`` of an existing name
leaves it untouched and returns False (losing a race is success). Errors that mean "the store is not
answering" (connection refused, timeouts, 5xx, EIO) raise :class:`StoreUnavailable`; one that answers "no room"
(a full, over-quota or read-only mount) raises :class:`StoreFull` (reads go on); a store that answers
"slow down" (S3 503 SlowDown, 429, ``Throttling``...) raises :class:`StoreThrottled` at once, unretried and
unslept, so the pool's own bounded backoff (:mod:`kvbm_backend.pool.g4.throttle`) owns that wait; absent
objects are ``None``/``False`` results, never exceptions.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol, Union
from urllib.parse import ParseResult


if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from typing_extensions import Buffer, TypeAlias

    from ...config import G4Config
    from .factory import StoreOptions

    #: An object's bytes as a store takes them: bytes, bytearray, memoryview, a contiguous uint8 array.
    DataIn: TypeAlias = Union[Buffer, npt.NDArray[np.uint8]]
    #: What :meth:`ObjectStore.get_into` reads into: one writable buffer, or a list of them (scatter).
    IntoBuf: TypeAlias = Union[Buffer, npt.NDArray[np.uint8], "list[Any]", "tuple[Any, ...]"]


class Blob(Protocol):
    """What :meth:`ObjectStore.get` returns: a bytes-like with a length (bytes, bytearray, memoryview,
    obstore's read-only ``Bytes``)."""

    def __buffer__(self, flags: int, /) -> memoryview: ...

    def __len__(self) -> int: ...


class StoreUnavailable(OSError):
    """The store did not answer in time or failed (counts towards the circuit breaker)."""


class PutUnsettled(StoreUnavailable):
    """A create-exclusive PUT may or may not have landed and the store could not say: its every attempt got
    no answer (or a 5xx) and the HEAD to settle it failed too, or a retried PUT met 412/409 and the HEAD
    comparing the stored ETag failed. The caller settles it later with :meth:`ObjectStore.settle`.
    Only S3 stores raise it (file and memory stores always know).

    Args:
        msg: what failed, for log lines. name: the object's store-relative name.
        md5_hex: lower-case hex MD5 of the bytes sent (S3's ETag of a single-part PUT).
    """

    def __init__(self, msg: str, name: str, md5_hex: str):
        super().__init__(msg)
        self.name, self.md5_hex = name, md5_hex


class StoreFull(OSError):
    """The store answered that it takes no more writes: no space left (``ENOSPC``), over quota (``EDQUOT``) or
    mounted read-only (``EROFS``). It answers, and reads go on: not an outage, so never a circuit-breaker failure
    (the offload is dropped, ``dropped_full``; before 2026-12 a file store raised :class:`StoreUnavailable` for
    these, the breaker opened and every load missed although reads worked). Not a :class:`StoreUnavailable`.

    Args:
        err: the OS error (its ``errno`` and text are kept). what: the request and object, for log lines.
        mount: the mount point holding the store's root (a file store), or None.
    """

    def __init__(self, err: OSError, what: str, mount: str | None = None):
        super().__init__(err.errno, f"{what}: {err.strerror or err}")
        self.mount = mount


class StoreThrottled(OSError):
    """The store answered "slow down" (S3 ``503 SlowDown``, HTTP 429, ``Throttling``, ``RequestLimitExceeded``,
    ...): it is up and shedding load. Not an outage, so never a circuit-breaker failure; the pool retries
    after a full-jitter backoff inside the request's bound (:mod:`kvbm_backend.pool.g4.throttle`). Not a
    :class:`StoreUnavailable`: code that catches only that one treats a throttle as an error answer."""


class ListIncomplete(OSError):
    """A listing that could not read part of the store (a file store's directory: EACCES; on NFS ESTALE,
    EIO), raised once every object it could read was yielded: never a silent partial listing.
    ``errors``: one line per place not listed, naming it. Consume with :func:`listing`."""

    def __init__(self, url: str, errors: list[str]):
        super().__init__(f"{url}: listing incomplete: {'; '.join(errors[:3])}"
                         + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""))
        self.errors = errors


def listing(objects: Iterator[ObjectInfo], errors: list[str]) -> Iterator[ObjectInfo]:
    """``objects`` (a :meth:`ObjectStore.list`), where a :class:`ListIncomplete` at its end adds its lines to
    ``errors`` instead of raising (gc and migrate act on what was listed and count the rest as errors)."""
    try:
        yield from objects
    except ListIncomplete as e:
        errors.extend(line for line in e.errors if line not in errors)  # a second listing names them again


class BucketMissing(OSError):
    """The S3 bucket of ``g4.url`` does not exist (the store answered: not an outage). kvbm-backend
    never creates buckets; ``bucket`` names it for the operator's log line."""

    def __init__(self, msg: str, bucket: str):
        super().__init__(msg)
        self.bucket = bucket


@dataclass(frozen=True)
class ObjectInfo:
    name: str  # relative key
    size: int  # bytes
    mtime: float  # epoch seconds (S3 LastModified, POSIX st_mtime)
    #: which object the name held when listed, for :meth:`ObjectStore.delete_if_listed`: S3 the listed ETag
    #: (quoted, as the server sent it), file stores ``"{st_ino}:{st_mtime_ns}:{st_size}"``; None where the store
    #: gives none (then that delete is by name). Not compared: two listings of one object are equal.
    version: str | None = field(default=None, compare=False)


class ObjectStore(ABC):
    url: str
    supports_conditional_put: bool = True

    @classmethod
    def from_url(cls, url: str, parsed: ParseResult, opts: StoreOptions) -> "ObjectStore":
        """Open the store ``url`` names (called by :func:`kvbm_backend.pool.g4.factory.open_store` for the
        scheme this class is registered under). ``parsed``: ``urllib.parse.urlparse(url)``; ``opts``: a
        :class:`~kvbm_backend.pool.g4.factory.StoreOptions`. Raises ValueError naming ``g4.url`` when the
        URL's form is wrong for this store."""
        raise NotImplementedError(f"{cls.__name__}: no from_url, cannot be opened by URL scheme")

    @abstractmethod
    def put_if_absent(self, name: str, data: DataIn) -> bool:
        """Publish ``data`` (bytes-like) under ``name`` only if absent. True if this call created it,
        False if it already existed. Raises StoreUnavailable, StoreFull (no space, quota, read-only)."""

    @abstractmethod
    def put(self, name: str, data: DataIn) -> None:
        """Create or replace ``name`` atomically (small metadata such as namespace.json)."""

    @abstractmethod
    def get(self, name: str, offset: int = 0, length: int | None = None) -> Blob | None:
        """Bytes-like (bytes, bytearray or memoryview) ``[offset, offset+length)`` of ``name`` (to the end when ``length`` is None), or None
        if absent. May return fewer bytes than asked for when the object is shorter, never more: a store fetches
        at most ``length`` bytes however large the object (S3: a ranged GET), so a bounded read stays bounded."""

    #: True when :meth:`get_into` reads straight into the caller's buffer (no intermediate copy), so
    #: callers holding reusable buffers should prefer it to :meth:`get`.
    reads_into = False

    def get_into(self, name: str, buf: IntoBuf) -> int | None:
        """Read the first ``min(size, len(buf))`` bytes of ``name`` into ``buf`` (writable bytes-like).

        Returns the object's full size in bytes (which may exceed ``len(buf)``; the rest is not read),
        or None if absent. Raises StoreUnavailable like :meth:`get`. This default goes through
        :meth:`get` and copies.
        """
        data = self.get(name)
        if data is None:
            return None
        # one buffer here (lists go only to stores with ``reads_into_parts``); numpy's stubs: see byte_view
        mv = memoryview(buf).cast("B")  # type: ignore[arg-type]
        n = min(len(data), len(mv))
        mv[:n] = memoryview(data).cast("B")[:n]
        return len(data)

    def stored_matches(self, name: str, data: DataIn, size: int) -> bool:
        """True only when the store confirms that the object it holds under ``name`` is ``size`` bytes
        long and starts with ``data`` (bytes-like, what a read returned): the reader drops an object that
        failed verification only then, never one a transport or proxy garbled on the way. False when it
        cannot tell (any error). This default reads the object again and compares; stores whose reads may
        lie consistently (S3 behind a proxy) ask the server for a checksum instead."""
        try:
            fresh = self.get(name)
        except OSError:
            return False
        if fresh is None or len(fresh) != size:
            return False
        want = byte_view(data)
        return memoryview(fresh).cast("B")[:len(want)] == want

    def delete_if_matches(self, name: str, data: DataIn, size: int) -> bool:
        """Delete ``name`` only while it is still the object :meth:`stored_matches` proved bad: ``size`` bytes
        starting with ``data`` (bytes-like, what a read returned). The reader drops corrupt objects with it, so
        a good copy another worker published under the name after that proof (a third worker deleted the bad
        one, then a create-exclusive write succeeded) is never deleted in its place.

        Returns True when this call deleted those bytes; False when ``name`` is absent or holds other bytes
        (kept). Raises :class:`StoreUnavailable`, :class:`StoreThrottled` or OSError when the store fails (the
        object is then kept, or, on a file store, left under a quarantine name that gc collects:
        :mod:`.fs_quarantine`). File stores rename the object to a quarantine name first
        (:mod:`.fs_quarantine`), S3 stores send ``If-Match`` with the ETag (:mod:`.s3_store`), the memory store
        compares and deletes under its lock. This default, for other stores, compares and then deletes: not
        atomic (the race above stays open for them)."""
        if not self.stored_matches(name, data, size):
            return False
        self.delete(name)
        return True

    def delete_if_listed(self, info: ObjectInfo) -> bool:
        """Delete ``info.name`` only while it is still the object listed as ``info`` (gc's deletes; the reader's of an
        object :meth:`stat` proved too long): a copy
        published under the name since the listing (another process deleted the listed one, a worker wrote the
        block again) is kept. True when this call deleted the listed object; False when the name is absent or
        holds another object (kept). S3 stores send ``If-Match:`` the listed ETag (:mod:`.s3_store`), file stores
        rename to a quarantine name and compare inode, mtime and size (:func:`.fs_quarantine.delete_if_listed`).
        This default, for stores that list no ``version`` (``info.version`` None), deletes by name and returns
        True. Raises :class:`StoreUnavailable`, :class:`StoreThrottled` or OSError when the store fails."""
        self.delete(info.name)
        return True

    def settle(self, name: str, md5_hex: str) -> bool | None:
        """Settle a PUT that raised :class:`PutUnsettled`: True when the object ``name`` holds the bytes
        whose MD5 is ``md5_hex`` (lower-case hex; the PUT landed), False when it holds other bytes (another
        writer's copy), None when absent (the PUT was lost). Raises StoreUnavailable / StoreThrottled /
        OSError when the store does not answer this either. Only stores that raise PutUnsettled implement it."""
        raise NotImplementedError(f"{type(self).__name__} never raises PutUnsettled: nothing to settle")

    @abstractmethod
    def head(self, name: str) -> int | None:
        """Size in bytes, or None if absent."""

    def stat(self, name: str) -> ObjectInfo | None:
        """What the store holds under ``name`` now, as a listing names it (size, mtime and the
        :attr:`~ObjectInfo.version` that :meth:`delete_if_listed` deletes only while it still holds), or None if
        absent: an S3 HEAD (ETag), a file's ``stat`` (inode, mtime, size). The reader proves an object it read
        only the first bytes of too long with it, then deletes that very object (:mod:`.bad_objects`). Raises as
        :meth:`head`. This default gives no version (``delete_if_listed`` then deletes by name)."""
        size = self.head(name)
        return None if size is None else ObjectInfo(name, size, 0.0)

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name`` (absent is fine)."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Published objects whose name starts with ``prefix`` (no temp files). Raises
        :class:`ListIncomplete` at the end when part of the store could not be listed."""

    def list_patient(self, prefix: str = "", attempts: int = 10) -> Iterator[ObjectInfo]:
        """:meth:`list` for batch jobs (gc): a LIST request the store throttles is retried after a full-jitter
        backoff, at most ``attempts`` times (:func:`.throttle.call_attempts`), instead of ending the listing.
        Stores that never throttle list as :meth:`list` does."""
        return self.list(prefix)

    def prune_dirs(self, names: Iterable[str]) -> int:
        """Remove the directories the deletion of objects ``names`` left empty (file stores; gc calls it after a
        pass). Returns how many were removed. Default: 0 (an S3 prefix is no object: nothing to remove)."""
        return 0

    def list_temps(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Unpublished writer temp files (POSIX stores only; S3 has none)."""
        return iter(())

    def server_time(self) -> float | None:
        """The store's own clock now (epoch seconds), when it states one (S3: the ``Date`` header of a
        HEAD bucket); None when it does not or cannot say. ``gc`` probes the clock stamping objects too (:func:`.gc.probe_clock`).
        Never raises."""
        return None

    def probe(self) -> None:
        """Check at start-up that the store answers (cheap; no object written). Raises
        StoreUnavailable, BucketMissing or OSError (e.g. access denied). Default: nothing to check."""
        return None

    def close(self) -> None:
        """Release connections and threads. Default: nothing held."""
        return None


def byte_view(data: DataIn) -> memoryview:
    """``data`` (bytes-like or a contiguous uint8 array) as a flat byte memoryview, without a copy."""
    # numpy's stubs give ndarray ``__buffer__`` only for Python >= 3.12 (this code targets 3.11)
    return memoryview(data).cast("B")  # type: ignore[arg-type]


def open_store(url: str, cfg: G4Config | None = None, **opts: Any) -> ObjectStore:
    """Build the store a URL names: :func:`kvbm_backend.pool.g4.factory.open_store` (the scheme registry
    lives there; this module imports no store class). Raises ValueError naming ``g4.url``."""
    from .factory import open_store as _open
    return _open(url, cfg, **opts)
