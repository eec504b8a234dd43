"""``mem://NAME``: an :class:`~kvbm_backend.pool.g4.store.ObjectStore` in this process's memory, for unit
tests (no disk, no server).

Objects live in one process-wide dict per NAME, so every store opened on the same URL -- two pools, a
pool and a ``gc`` run -- sees the same objects, as pools on one real bucket do. Nothing survives the
process. Same contract as the other stores: ``put_if_absent`` is create-exclusive, objects are whole
(a put stores a copy), absent objects are None/False results. :func:`clear` drops a NAME's objects.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Iterator
from urllib.parse import ParseResult

from .store import ObjectInfo, ObjectStore, byte_view

if TYPE_CHECKING:
    from .factory import StoreOptions
    from .store import DataIn

_LOCK = threading.Lock()
_SPACES: dict[str, dict[str, tuple[bytes, float]]] = {}  # NAME -> object name -> (bytes, mtime epoch s)


def clear(name: str | None = None) -> None:
    """Drop every object of store ``name`` (all stores when None)."""
    with _LOCK:
        if name is None:
            _SPACES.clear()
        else:
            _SPACES.pop(name, None)


class MemoryStore(ObjectStore):
    """Objects of ``mem://{name}`` in a process-wide dict (shared by every store of that name)."""

    def __init__(self, name: str):
        if not name:
            raise ValueError("g4.url: mem:// URL needs a name (mem://NAME)")
        self.name = name
        self.url = f"mem://{name}"
        with _LOCK:
            self._objs = _SPACES.setdefault(name, {})

    @classmethod
    def from_url(cls, url: str, parsed: ParseResult, opts: StoreOptions) -> "MemoryStore":
        """``mem://NAME`` (NAME may contain ``/``). Raises ValueError naming ``g4.url`` without a NAME."""
        name = (parsed.netloc + parsed.path).strip("/")
        if not name:
            raise ValueError(f"g4.url {url!r}: mem:// URL needs a name (mem://NAME)")
        return cls(name)

    @staticmethod
    def _check(name: str) -> None:
        if name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"object name {name!r}: must be relative without '..'")

    def put_if_absent(self, name: str, data: DataIn) -> bool:
        self._check(name)
        blob = bytes(byte_view(data))
        with _LOCK:
            if name in self._objs:
                return False
            self._objs[name] = (blob, time.time())
            return True

    def put(self, name: str, data: DataIn) -> None:
        self._check(name)
        blob = bytes(byte_view(data))
        with _LOCK:
            self._objs[name] = (blob, time.time())

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes | None:
        with _LOCK:
            ent = self._objs.get(name)
        if ent is None:
            return None
        end = None if length is None else offset + length
        return ent[0][offset:end]

    def head(self, name: str) -> int | None:
        with _LOCK:
            ent = self._objs.get(name)
        return None if ent is None else len(ent[0])

    def delete(self, name: str) -> None:
        with _LOCK:
            self._objs.pop(name, None)

    def delete_if_matches(self, name: str, data: DataIn, size: int) -> bool:
        """Delete ``name`` only when it holds ``size`` bytes starting with ``data``, compared and deleted under
        the store's lock (atomic): see :meth:`~.store.ObjectStore.delete_if_matches`."""
        want = byte_view(data)
        with _LOCK:
            ent = self._objs.get(name)
            if ent is None or len(ent[0]) != size or memoryview(ent[0])[:len(want)] != want:
                return False
            del self._objs[name]
            return True

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with _LOCK:
            items = [(k, len(v[0]), v[1]) for k, v in self._objs.items() if k.startswith(prefix)]
        for k, size, mtime in sorted(items):
            yield ObjectInfo(k, size, mtime)
