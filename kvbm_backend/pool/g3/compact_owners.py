"""The owners of :class:`~.compact_index.CompactLruIndex` entries: interned (namespace, tenant tag) pairs.

An entry stores its owner as an int32 id. :class:`Owners` maps ids to (namespace, 16-byte tenant tag)
pairs (what the journal and the frame headers hold) and back, and learns a tag's tenant string the
first time a :class:`BlockKey` of that tenant is interned or found, so entries can be reported as
BlockKeys. Only the unsalted tenant ``""`` is known from its tag alone (:data:`KNOWN`).

Memory stays bounded by the live owners, not by every tenant ever seen: :meth:`Owners.collect` forgets
the ids no live entry uses once the interned ones exceed twice the live ones at the last collection
plus ``OWNER_SLACK``, and their ids are reused.
"""
from __future__ import annotations

import numpy as np

from ...model.namespace import BlockKey, KeyRun, tenant_tag
from .index import TagKey, tag_of

OWNER_SLACK = 4096  # owners interned beyond twice the live ones before a collection runs
KNOWN = {tenant_tag(""): ""}  # tags resolved without a BlockKey: the unsalted tenant


class Owners:
    """Owner ids (0 .. 2**31-1) of (namespace, tenant tag) pairs, with their tenant strings once known.

    :attr:`pairs` and :attr:`tenants` are indexed by owner id (read them, never change them): the pair
    (or None for a collected id) and the tenant string (None while unknown). Not thread-safe.
    """

    def __init__(self) -> None:
        self.pairs: list[tuple[str, bytes] | None] = []
        self.tenants: list[str | None] = []
        self._by_tag: dict[tuple[str, bytes], int] = {}
        self._by_tenant: dict[str, dict[str, int]] = {}  # namespace -> tenant -> owner
        self._free: list[int] = []  # collected ids, reused by intern
        self._collect_at = OWNER_SLACK

    def __len__(self) -> int:
        """Interned owners (collected ids excluded)."""
        return len(self._by_tag)

    def find(self, key: BlockKey | TagKey | KeyRun) -> tuple[int, bool]:
        """(owner id or -1, key is a TagKey) of a BlockKey, TagKey or KeyRun; never interns. A BlockKey
        whose tag is interned teaches the owner its tenant string."""
        if type(key) is TagKey:
            return self._by_tag.get((key.namespace, key.tag), -1), True
        d = self._by_tenant.get(key.namespace)
        if d is not None:
            o = d.get(key.tenant)
            if o is not None:
                return o, False
        o = self._by_tag.get((key.namespace, tag_of(key.tenant)))
        if o is None:
            return -1, False
        self._by_tenant.setdefault(key.namespace, {})[key.tenant] = o
        self.tenants[o] = key.tenant
        return o, False

    def intern(self, namespace: str, tag: bytes, tenant: str | None) -> int:
        """The owner id of (``namespace``, ``tag``), interned when new; ``tenant`` (the tag's tenant
        string, None when unknown) is learned when given.

        Raises:
            OverflowError: more than 2**31 owners.
        """
        o = self._by_tag.get((namespace, tag))
        if o is None:
            if self._free:  # an id no live entry uses (see collect)
                o = self._free.pop()
                self.pairs[o] = (namespace, tag)
                self.tenants[o] = KNOWN.get(tag) if tenant is None else tenant
            else:
                o = len(self.pairs)
                if o >= 1 << 31:
                    raise OverflowError("more than 2**31 (namespace, tenant) pairs")
                self.pairs.append((namespace, tag))
                self.tenants.append(KNOWN.get(tag) if tenant is None else tenant)
            self._by_tag[(namespace, tag)] = o
            t = self.tenants[o]
            if t is not None:
                self._by_tenant.setdefault(namespace, {})[t] = o
        elif tenant is not None and self.tenants[o] is None:
            self.tenants[o] = tenant
            self._by_tenant.setdefault(namespace, {})[tenant] = o
        return o

    def collect_due(self) -> bool:
        """Whether :meth:`collect` would run: the interned owners exceed twice the live ones at the last
        collection plus ``OWNER_SLACK`` (amortised: one collection per that many new owners)."""
        return len(self._by_tag) > self._collect_at

    def collect(self, live: np.ndarray) -> None:
        """Forget the owners no live entry uses; their ids are reused by :meth:`intern`. ``live``: the
        owner ids of the live entries (any integer array, repeats allowed). The caller holds no owner id
        of a dead entry across the call."""
        n = len(self.pairs)
        cnt = np.bincount(live, minlength=n) if len(live) else np.zeros(n, np.int64)
        for o in np.flatnonzero(cnt == 0).tolist():
            own = self.pairs[o]
            if own is None:
                continue
            ns = own[0]
            self._by_tag.pop(own, None)
            t = self.tenants[o]
            d = self._by_tenant.get(ns)
            if t is not None and d is not None and d.get(t) == o:
                del d[t]
            self.pairs[o] = None
            self.tenants[o] = None
            self._free.append(o)
        self._collect_at = 2 * len(self._by_tag) + OWNER_SLACK

    def sizes(self) -> dict[str, int]:
        """Lengths of the structures (for bounds checks): ids ever handed out (``pairs``), interned
        pairs (``by_tag``), learned tenant strings (``by_tenant``)."""
        return {"pairs": len(self.pairs), "by_tag": len(self._by_tag),
                "by_tenant": sum(map(len, self._by_tenant.values()))}
