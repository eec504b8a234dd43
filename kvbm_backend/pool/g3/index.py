"""The in-memory G3 index: key -> slot in LRU order, with read pins.

A slot being read is pinned; eviction never picks a pinned slot, and a pinned slot that is deleted
or found corrupt is freed only when its last reader unpins it, so a reader is never handed a slot
that is being overwritten. Not thread-safe: the pool holds its lock around every call.

Tenant pseudonyms: the journal stores a block's tenant as its 16-byte tag (``tenant_tag``, the value
the frame header holds), never the tenant string. A restored entry whose tag is not a known tenant's
(only ``""``, the unsalted tenant, is known at restore) is kept under a :class:`TagKey`
``(namespace, tag, rank, seq_hash)``, in its LRU place. The first :meth:`LruIndex.get` / ``in`` /
:meth:`LruIndex.remove` / :meth:`LruIndex.put` with the real :class:`BlockKey` that misses looks the
tag form up and re-keys the entry under the BlockKey ("adoption", which makes it most recently used);
that fallback costs one tag hash per miss, and only while tag-keyed entries remain.
"""
from __future__ import annotations

import operator
from collections import OrderedDict
from typing import Iterable, Iterator, NamedTuple, Union

from ...model.namespace import BlockKey, tenant_tag

Slot = tuple[int, int]


class TagKey(NamedTuple):
    """A restored key whose tenant string is not known yet (the journal holds only the tenant tag)."""

    namespace: str
    tag: bytes
    rank: int
    seq_hash: int

    @property
    def tenant(self) -> str:
        """A placeholder naming the tag (never equal to a real key's tenant in lookups)."""
        return f"<tenant tag {self.tag.hex()}>"


def key_tag(k: Union[BlockKey, TagKey]) -> bytes:
    """The 16-byte tenant tag ``k``'s frames carry: a restored :class:`TagKey`'s own ``tag``, else its tenant's
    (every read path checks frames against this: host gets, device gets, layer-wise loads)."""
    return k.tag if type(k) is TagKey else tag_of(k.tenant)


def valid_key(k: Union[BlockKey, TagKey]) -> bool:
    """A key a G3 slot can hold: seq_hash an integer in [0, 2**64), rank in [0, 2**32), and a str tenant
    (BlockKey) or a 16-byte tag (a restored :class:`TagKey`). Anything else is never looked up (a get misses
    it, ``invalid_key``, so it cannot reach, let alone drop, another key's slot) nor stored (a put drops
    only it, ``invalid_key``)."""
    try:
        if not (0 <= operator.index(k.seq_hash) <= _U64 and 0 <= operator.index(k.rank) <= _U32):
            return False
    except TypeError:
        return False
    if type(k) is TagKey:
        return type(k.tag) is bytes and len(k.tag) == 16
    return isinstance(k.tenant, str)


_U64, _U32 = (1 << 64) - 1, (1 << 32) - 1
_KNOWN = {tenant_tag(""): ""}  # tags resolved at restore: the unsalted tenant
_tags: dict[str, bytes] = {}


_CACHE_TENANT_CHARS = 256  # longer tenant ids are hashed each time (the cache holds ids, bounded in bytes)


def tag_of(tenant: str) -> bytes:
    """``tenant_tag(tenant)``, cached (at most 4097 ids of at most 256 chars). Any str is a tenant
    (lone surrogates, NULs: see ``tenant_bytes``); TypeError for a non-str."""
    t = _tags.get(tenant)
    if t is None:
        t = tenant_tag(tenant)
        if len(tenant) <= _CACHE_TENANT_CHARS:
            if len(_tags) > 4096:
                _tags.clear()
            _tags[tenant] = t
    return t


class SlotPins:
    """Read pins of slots, and the frees deferred until a slot's last reader unpins it: a part each
    index class owns (it calls :meth:`release` for every slot it removes)."""

    def __init__(self) -> None:
        self._pins: dict[Slot, int] = {}
        self._deferred: set[Slot] = set()  # removed while pinned: freed on the last unpin

    def __len__(self) -> int:
        """Pinned slots."""
        return len(self._pins)

    def __iter__(self) -> Iterator[Slot]:
        """The pinned slots."""
        return iter(self._pins)

    def pin(self, slot: Slot) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def pin_many(self, slots: Iterable[Slot]) -> None:
        """:meth:`pin` of each slot (a repeated slot is pinned as often)."""
        pins = self._pins
        get = pins.get
        for slot in slots:
            pins[slot] = get(slot, 0) + 1

    def unpin(self, slot: Slot) -> Slot | None:
        """Returns the slot if it must be freed now (it was removed while pinned)."""
        n = self._pins.get(slot, 0) - 1
        if n > 0:
            self._pins[slot] = n
            return None
        self._pins.pop(slot, None)
        if slot in self._deferred:
            self._deferred.discard(slot)
            return slot
        return None

    def is_pinned(self, slot: Slot) -> bool:
        return bool(self._pins.get(slot))

    def release(self, slot: Slot) -> Slot | None:
        """``slot`` was removed from the index: returned when it is to be freed now, None when pinned
        (then :meth:`unpin` returns it on the last unpin)."""
        if self._pins.get(slot):
            self._deferred.add(slot)
            return None
        return slot

    @property
    def deferred(self) -> int:
        """Removed slots waiting for their last unpin."""
        return len(self._deferred)


class LruIndex:
    """Key -> (file, slot) in LRU order with read pins, in an OrderedDict (the reference the compact
    index is checked against)."""

    def __init__(self) -> None:
        self._map: "OrderedDict[BlockKey | TagKey, Slot]" = OrderedDict()
        self._pins = SlotPins()
        self._tagged = 0  # entries still keyed by TagKey (restored, tenant not seen yet)
        self.touches = 0  # hits that moved a held entry to the most recently used end (no journal record has them)

    def pin(self, slot: Slot) -> None:
        """A reader holds ``slot``: no eviction picks it, and its free waits for the last :meth:`unpin`."""
        self._pins.pin(slot)

    def pin_many(self, slots: Iterable[Slot]) -> None:
        """:meth:`pin` of each slot (a repeated slot is pinned as often)."""
        self._pins.pin_many(slots)

    def unpin(self, slot: Slot) -> Slot | None:
        """Returns the slot if it must be freed now (it was removed while pinned)."""
        return self._pins.unpin(slot)

    @property
    def pinned(self) -> int:
        """Pinned slots."""
        return len(self._pins)

    @property
    def deferred(self) -> int:
        """Removed slots whose free waits for their last unpin."""
        return self._pins.deferred

    def __len__(self) -> int:
        return len(self._map)

    def _adopt(self, key: BlockKey) -> Slot | None:
        """Re-key the restored TagKey entry of ``key`` (if any) under ``key``; it becomes most recently
        used (it is being used; an OrderedDict cannot re-key in place in O(1))."""
        s = self._map.pop(TagKey(key.namespace, tag_of(key.tenant), key.rank, key.seq_hash), None)
        if s is None:
            return None
        self._map[key] = s
        self._tagged -= 1
        self.touches += 1
        return s

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._map or (self._tagged > 0 and self._adopt(key) is not None)

    def get(self, key: BlockKey, touch: bool = False) -> Slot | None:
        s = self._map.get(key)
        if s is None and self._tagged > 0:
            s = self._adopt(key)
        if s is not None and touch:
            self._map.move_to_end(key)
            self.touches += 1
        return s

    def get_many(self, keys: Iterable[BlockKey], namespace: str | None = None) -> list[Slot | None]:
        """``[get(k, touch=True) for k in keys]``, None (not looked up) for a key of another ``namespace`` when
        given (the compact index's batch, key by key)."""
        return [self.get(k, touch=True) if namespace is None or k.namespace == namespace else None for k in keys]

    def put(self, key: BlockKey, slot: Slot) -> None:
        if self._tagged > 0 and self._map.pop(TagKey(key.namespace, tag_of(key.tenant), key.rank, key.seq_hash),
                                              None) is not None:
            self._tagged -= 1
        self._map[key] = slot
        self._map.move_to_end(key)

    def restore(self, key: "BlockKey | TagKey", slot: Slot) -> None:
        """Insert a journal entry (oldest first) at restore: a TagKey of a known tag becomes its BlockKey."""
        if isinstance(key, TagKey):
            tenant = _KNOWN.get(key.tag)
            if tenant is not None:
                key = BlockKey(key.namespace, tenant, key.rank, key.seq_hash)
            elif key not in self._map:
                self._tagged += 1
        self._map[key] = slot
        self._map.move_to_end(key)

    def restore_many(self, entries: Iterable[tuple[BlockKey | TagKey, Slot]]) -> None:
        """:meth:`restore` of each (key, slot), oldest first."""
        for key, slot in entries:
            self.restore(key, slot)

    def lookup_prefix(self, keys: Iterable[BlockKey], namespace: str | None = None) -> int:
        """How many leading ``keys`` are held (a key of another ``namespace``, when given, ends the
        prefix); the found ones become most recently used (``get(k, touch=True)`` each)."""
        n = 0
        for k in keys:
            if (namespace is not None and k.namespace != namespace) or self.get(k, touch=True) is None:
                break
            n += 1
        return n

    def items(self) -> list[tuple[BlockKey | TagKey, Slot]]:
        """(key, slot) oldest first; restored keys whose tenant was not seen yet are :class:`TagKey`."""
        return list(self._map.items())

    def remove(self, key: BlockKey, slot: Slot | None = None) -> Slot | None:
        """Remove ``key`` (only if it still maps to ``slot`` when given). Returns the slot to free now,
        or None (absent, or pinned: freed by the last :meth:`unpin`)."""
        s = self._map.get(key)
        if s is None and self._tagged > 0:
            s = self._adopt(key)
        if s is None or (slot is not None and s != slot):
            return None
        del self._map[key]
        return self._pins.release(s)

    def evict(self, n: int) -> list[tuple[BlockKey | TagKey, Slot]]:
        """Remove up to ``n`` least recently used unpinned entries; returns them."""
        out: list[tuple[BlockKey | TagKey, Slot]] = []
        for key, slot in self._map.items():
            if len(out) >= n:
                break
            if not self._pins.is_pinned(slot):
                out.append((key, slot))
        for key, _ in out:
            del self._map[key]
            if type(key) is TagKey:
                self._tagged -= 1
        return out
