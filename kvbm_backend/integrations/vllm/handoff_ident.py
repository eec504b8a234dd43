"""The hand-off's identity, ``{"namespace": F, "tenant": T, "salt": S}`` (:mod:`.handoff`), and the WARNINGs of its
mismatches.

**S, keyed.** S names the request's salt hash (the 64-bit seed of its blocks' names: cache_salt, LoRA adapter name and
path, reset epoch; :func:`~.identity.request_salt`). Until 2026-12-03 it was that hash in hex, an unkeyed xxh3: anyone
reading ``kv_transfer_params`` or the logs could confirm a guessed cache_salt or LoRA adapter path by hashing it. Where
G4 has a keyring, S is now ``HMAC-SHA256(name key, SALT_LABEL || salt hash (u64 LE))[:8]`` in hex (:func:`salt_tag`),
the name key being the tenant's G4 naming key (:meth:`~kvbm_backend.crypto.keyring.Keyring.naming`, derived from the
keyring's secret pseudonym key by :func:`~kvbm_backend.crypto.names.derive_name_key`): the prefill and decode workers
of one tenant sharing a keyring file agree, and nobody without the key can test a guess. A G4 without a keyring keeps
the unkeyed hex (its block names are unkeyed too: they hide nothing), as does an engine without G4.

**Mismatch WARNINGs.** Each field (F, T, S) has its own budget: the first :data:`FIRST_PAIRS` pairs of values
(theirs, ours) each get a WARNING at first sight. Until 2026-12-03 later pairs of a field shared one line a minute, so a
flood of distinct forged values (a client's ``kv_transfer_params``) took that line every minute and a real
misconfiguration found later (its pair recurring on every request it touches) was never named. Now the field's later
pairs are counted, between two of its lines, in a heavy-hitters summary (:class:`PairBudget`: Space-Saving with
:data:`HELD_PAIRS` counters, bounded entries), and the field's once-a-minute line names, besides the mismatch at hand,
the pairs seen most since its last line (by count - error, each seen more than once, at most :data:`NAMED_PER_LINE`,
none named within :data:`NAMED_QUIET_S`) and how many mismatches and distinct pairs had no line of their own (the
pairs exact up to :data:`DISTINCT_EXACT`, beyond that "about"). A pair that is more than 1/:data:`HELD_PAIRS` of the
field's mismatches between two lines is held whatever else is sent and how often, its count - error at least its
excess over that share, so it is named unless :data:`NAMED_PER_LINE` other pairs were seen more (a forger must outsend
it with new values every minute: named ones are quiet for the hour). From b51c685 to 2026-12-03 the summary was a 1,024-pair reservoir whose pairs seen twice were never evicted, so forged values each
sent twice filled it for good and a misconfiguration starting after that was never named; its "pairs new to it"
counted a pair the reservoir turned away again at each repeat.
"""
from __future__ import annotations

import hashlib
import heapq
import hmac
import logging
import os
import reprlib
import time
from typing import Any, Callable

from . import stats

log = logging.getLogger("kvbm_backend.handoff")

#: HMAC message prefix of a keyed S (:func:`salt_tag`): never a G4 block id's message (20 bytes, :mod:`~kvbm_backend.
#: pool.g4.naming`), so S says nothing of a block name under the same key
SALT_LABEL = b"kvbm-backend/handoff-salt/v1\x00"


def g4_fingerprint(g4: Any) -> str | None:
    """The fingerprint of the namespace ``g4``'s blocks are stored under (the canonical namespace with
    ``g4.layout: canonical``, which every TP size shares; else the engine's per-rank namespace), or None
    without G4."""
    if g4 is None:
        return None
    heads = getattr(g4, "heads", None)  # CanonicalG4
    ns = heads.canonical if heads is not None else getattr(g4, "namespace", None)
    return getattr(ns, "fingerprint", None)


def keyring_view(g4: Any) -> Any:
    """The :class:`~kvbm_backend.pool.g4.keyring_view.KeyringView` of a G4 pool (or of the pool a canonical view
    wraps): what the scheduler thread may ask its keyring without I/O or its lock; None without G4 or a keyring."""
    while g4 is not None and getattr(g4, "keyring_view", None) is None and hasattr(g4, "inner"):
        g4 = g4.inner
    return getattr(g4, "keyring_view", None) if g4 is not None else None


def tenant_tag(g4: Any, tenant: str) -> str | None:
    """The first 8 bytes (16 hex characters) of ``tenant``'s pseudonym in ``g4`` (a keyed HMAC under the pool's
    keyring), or None without G4 or without a keyring. Without a keyring the pseudonym is an HMAC under a public
    key: a client reading ``kv_transfer_params`` could confirm a guessed tenant id with it, so it is left out
    (those workers then match tenants by waiting, as before). Under the pseudonym key the keyring holds now, never
    re-reading its file: vLLM's scheduler thread calls this (before 2026-12-01 it ran the keyring's reload, 82-176
    ms with 4,096 tenants, whenever the file had changed); a key replaced meanwhile gives a stale tag until the
    keyring's next reload elsewhere, at worst a miss (:mod:`~kvbm_backend.pool.g4.keyring_view`)."""
    view = keyring_view(g4)
    return bytes(view.pseudonym(tenant))[:8].hex() if view is not None else None


def salt_tag(g4: Any, tenant: str, salt: int) -> str:
    """S of a request of ``tenant`` whose salt hash is ``salt`` (an unsigned 64-bit int), 16 hex characters: keyed by
    ``tenant``'s G4 naming key where ``g4`` has a keyring (module doc: no file I/O, no keyring lock, the key the
    keyring holds now), else ``salt`` itself in hex (no keyring, or no G4: unkeyed, as before 2026-12-03). Raises
    OverflowError for a ``salt`` outside [0, 2**64)."""
    view = keyring_view(g4)
    if view is None:
        return f"{salt:016x}"
    key = view.keyring.naming(tenant)[2]
    return hmac.new(key, SALT_LABEL + salt.to_bytes(8, "little"), hashlib.sha256).digest()[:8].hex()


def identity(g4: Any, tenant: str, salt: int | None = None) -> dict[str, str]:
    """``{"namespace": F, "tenant": T, "salt": S}`` of this engine's G4 for ``tenant`` and a request's salt hash
    ``salt`` (the 64-bit seed of its sequence hashes: cache_salt, LoRA adapter, reset epoch; S: :func:`salt_tag`);
    keys left out when unknown (no G4, no keyring, ``salt`` None)."""
    out = {"namespace": g4_fingerprint(g4), "tenant": tenant_tag(g4, tenant),
           "salt": None if salt is None else salt_tag(g4, tenant, salt)}
    return {k: v for k, v in out.items() if v is not None}


IDENT_FIELDS = ("namespace", "tenant", "salt")
FIRST_PAIRS = 256  # pairs of values of a field logged at first sight, each its own line
HELD_PAIRS = 1024  # k: the counters of a field's heavy-hitters summary (pairs held between two of its lines)
NAMED_PER_LINE = 4  # pairs a field's once-a-minute line names at most besides the one at hand
NAMED_QUIET_S = 3600.0  # seconds a pair a minute line named is left out of the field's later lines
DISTINCT_EXACT = 4096  # distinct pairs a field counts exactly between two lines (beyond: an estimate, "about")
SHOWN_MAX, RID_MAX = 80, 64  # characters of each value and of the last request id a held pair keeps
_NAMED_MAX = 4096  # pairs a field remembers as named within NAMED_QUIET_S (a bound for any clock)
_WHAT = {"namespace": "G4 namespace (model, revision, dtype, KV layout, TP size: both workers need the same, "
                      "or g4.layout: canonical)",
         "tenant": "tenant (pseudonym prefix; the request's cache_salt, else each worker's default tenant)",
         "salt": "request salt (hash of cache_salt and LoRA adapter: the decode request must name the same as its "
                 "prefill request)"}
_NONE = "none (its G4 has no keyring)"


def _cut(text: str, n: int) -> str:
    """``text`` in at most ``n`` characters (its head and ``...``)."""
    return text if len(text) <= n else text[:n - 3] + "..."


class Distinct:
    """How many distinct pairs (16-byte keys) were seen: exact up to :data:`DISTINCT_EXACT`, then a k-minimum-values
    estimate (Bar-Yossef et al. 2002; relative error about 1/sqrt(k), 1.6 %) from the k smallest of a keyed 64-bit
    hash of each key (keyed by a per-instance random key, so chosen values cannot skew it). At most k ints held."""

    def __init__(self, k: int = DISTINCT_EXACT) -> None:
        self.k, self._key = k, os.urandom(16)
        self._heap: list[int] = []  # the k smallest hashes, negated (a max-heap)
        self._held: set[int] = set()
        self.exact = True  # False once more than k distinct keys were seen

    def add(self, key: bytes) -> None:
        """Count ``key`` (a repeat changes nothing)."""
        h = int.from_bytes(hashlib.blake2b(key, digest_size=8, key=self._key).digest(), "little")
        if h in self._held:
            return
        if len(self._heap) < self.k:
            self._held.add(h)
            heapq.heappush(self._heap, -h)
            return
        self.exact = False
        if h < -self._heap[0]:
            self._held.discard(-heapq.heapreplace(self._heap, -h))
            self._held.add(h)

    def count(self) -> int:
        """The distinct keys added since :meth:`clear`: exact while :attr:`exact`, else the estimate."""
        if self.exact:
            return len(self._heap)
        return round((self.k - 1) * 2.0 ** 64 / (-self._heap[0] + 1))

    def clear(self) -> None:
        """Start anew."""
        self._heap.clear()
        self._held.clear()
        self.exact = True


class PairBudget:
    """What one identity field's mismatch WARNINGs have said (module doc). Pairs are keyed by a 16-byte digest of their
    values; a held pair keeps its count, its error bound, both values shown in at most :data:`SHOWN_MAX` characters
    and its last request id in at most :data:`RID_MAX`, so a forged value of any size costs a bounded entry. The
    pairs without a line of their own are counted in a Space-Saving summary (Metwally, Agrawal, El Abbadi, "Efficient
    computation of frequent and top-k elements in data streams", ICDT 2005) of :data:`HELD_PAIRS` (k) counters: a pair
    not held takes the place of a least-counted one (the longest at that count), starting at that count + 1 with that
    count as its error, so any pair seen more than N/k times of the N mismatches since the field's last line is held,
    its count - error (the requests since it was held: a lower bound of its own) at least its share less N/k, and no
    sequence of values evicts it. Deterministic (no random choice). Scheduler thread only. ``clock``: seconds,
    monotonic (for :data:`NAMED_QUIET_S`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.logged: set[bytes] = set()  # pairs that had a first-sight line (<= FIRST_PAIRS)
        self.named: dict[bytes, float] = {}  # pairs a minute line named -> when (oldest first)
        self.held: dict[bytes, list[Any]] = {}  # pair -> [count, error, theirs shown, ours shown, last request id]
        self._at: dict[int, dict[bytes, None]] = {}  # count -> the held pairs at it (an ordered set: longest first)
        self._low = 0  # the least count held (when ``held`` is full)
        self._top: list[tuple[int, int, bytes]] = []  # (-(count - error), push order, pair): a lazy max-heap
        self._pushes = 0
        self.unlogged = 0  # mismatches of pairs without a line of their own since the last line
        self.distinct = Distinct()  # those pairs, distinct

    def note(self, key: bytes, theirs: str, ours: str, rid: str) -> str | None:
        """One mismatch of pair ``key`` (``theirs``, ``ours``: the values as shown; ``rid``: its request id):
        ``"first"`` (log it now: a first-sight line), ``"held"`` (no line of its own: the field's once-a-minute line
        may come, :meth:`summary`) or None (it had its line: at first sight, or named within :data:`NAMED_QUIET_S`)."""
        if key in self.logged:
            return None
        when = self.named.get(key)
        if when is not None:
            if self.clock() - when < NAMED_QUIET_S:
                return None
            del self.named[key]
        if len(self.logged) < FIRST_PAIRS:
            self.logged.add(key)
            return "first"
        self.unlogged += 1
        self.distinct.add(key)
        rid = _cut(str(rid), RID_MAX)
        e = self.held.get(key)
        if e is not None:
            self._move(key, e[0], e[0] + 1)
            e[0] += 1
            e[4] = rid
        else:
            err = 0
            if len(self.held) >= HELD_PAIRS:  # the longest-held of the least counted gives its place
                err = self._low
                del self.held[self._move(next(iter(self._at[err])), err, None)]
            self.held[key] = e = [err + 1, err, _cut(theirs, SHOWN_MAX), _cut(ours, SHOWN_MAX), rid]
            self._move(key, None, err + 1)
        if e[0] - e[1] >= 2:  # seen more than once since held: a candidate for the line
            self._pushes += 1
            heapq.heappush(self._top, (e[1] - e[0], self._pushes, key))
            if len(self._top) > 4 * HELD_PAIRS:  # drop the stale entries
                self._top = [(v[1] - v[0], i, k) for i, (k, v) in enumerate(self.held.items()) if v[0] - v[1] >= 2]
                heapq.heapify(self._top)
        return "held"

    def _move(self, key: bytes, old: int | None, new: int | None) -> bytes:
        """Move held pair ``key`` from count ``old`` to count ``new`` (None: not held: an eviction from the least count,
        which the caller fills at ``old`` + 1 at once); returns ``key``."""
        if old is not None:
            at = self._at[old]
            del at[key]
            if not at:
                del self._at[old]
                if old == self._low:  # evicted (new None): its successor comes in at old + 1
                    self._low = old + 1
        if new is not None:
            self._at.setdefault(new, {})[key] = None
            if len(self.held) <= 1 or new < self._low:
                self._low = new
        return key

    def recurring(self, key: bytes) -> list[bytes]:
        """The held pairs other than ``key`` seen more than once since they were held, most first by count - error
        (ties: the first to reach it), at most :data:`NAMED_PER_LINE`."""
        out: list[bytes] = []
        back: list[tuple[int, int, bytes]] = []
        while self._top and len(out) < NAMED_PER_LINE:
            item = heapq.heappop(self._top)
            e = self.held.get(item[2])
            if e is None or e[1] - e[0] != item[0] or any(b[2] == item[2] for b in back):
                continue  # stale: evicted, counted again since, or a duplicate
            back.append(item)
            if item[2] != key:
                out.append(item[2])
        for item in back:
            heapq.heappush(self._top, item)
        return out

    def summary(self, key: bytes) -> tuple[str, tuple[Any, ...], list[bytes]]:
        """The once-a-minute line's addition (text, its args) and the pairs it names (``key`` first)."""
        named = self.recurring(key)
        pairs = "; ".join(f"prefilled under {e[2]}, this engine's {e[3]} ({_requests(e)}, last {e[4]})"
                          for e in (self.held[k] for k in named))
        n = self.distinct.count()
        text = (" [the first %d pairs of values of this field each had a line; since its last line %d mismatches of "
                "%s pairs new to it had none (forged kv_transfer_params? each is counted in "
                "handoff_identity_mismatches)%s]")
        return text, (FIRST_PAIRS, self.unlogged, str(n) if self.distinct.exact else f"about {n}",
                      "; seen more than once, likely a misconfiguration: " + pairs if pairs else ""), [key, *named]

    def said(self, keys: list[bytes]) -> None:
        """The field's line was logged naming ``keys``: none of them is named again for :data:`NAMED_QUIET_S`; the
        summary and the counts start anew."""
        now = self.clock()
        for k in keys:
            self.named.pop(k, None)
            self.named[k] = now
        while self.named and (len(self.named) > _NAMED_MAX or now - next(iter(self.named.values())) >= NAMED_QUIET_S):
            del self.named[next(iter(self.named))]  # oldest first: named longer ago than NAMED_QUIET_S (or too many)
        self.held.clear()
        self._at.clear()
        self._top.clear()
        self._low = self.unlogged = 0
        self.distinct.clear()


def _requests(e: list[Any]) -> str:
    """A held pair's requests since it was held: exact without an error bound, else the range."""
    return f"{e[0]} requests" if e[1] == 0 else f"{e[0] - e[1]} to {e[0]} requests"


_warned_pairs: dict[str, PairBudget] = {}  # field -> its budget (``.clear()``: every field's anew)


def differs(f: str, v: dict, mine: str | None) -> bool:
    """Whether identity field ``f`` of the handoff ``v`` rules out this engine's (``mine``) finding its blocks. A field
    the prefill worker did not send is not compared (older prefill workers: neither F nor T nor S), except T after an F:
    that prefill worker's G4 has no keyring, so its blocks are under unkeyed names, which a G4 with a keyring (``mine``
    not None) never reads. S is compared only where this engine knows its own (``mine`` not None)."""
    theirs = v.get(f)
    if theirs is None:
        return f == "tenant" and mine is not None and v.get("namespace") is not None
    return theirs != mine and (f != "salt" or mine is not None)


def mismatch(request: Any, v: dict, ours: dict[str, str] | None, limited: Any) -> bool:
    """The handoff's identity fields name another namespace, tenant or request salt than ``ours`` (:func:`identity`
    of this engine with the request's ``salt``; None or no G4: it can load nothing a prefill worker wrote, so any
    identity mismatches), as :func:`differs` judges them; counted ``handoff_identity_mismatches``. Logged at
    WARNING per field (F, T, S: each its own :class:`PairBudget`): the first :data:`FIRST_PAIRS` pairs of values at
    first sight, later ones by the field's ``identity_<field>`` line of ``limited`` (a
    :class:`~kvbm_backend.log_limits.LimitedLog`: one a minute), which names the pairs seen most meanwhile."""
    for f in IDENT_FIELDS:
        mine = (ours or {}).get(f)
        if not differs(f, v, mine):
            continue
        stats.add(handoff_identity_mismatches=1)
        theirs = v.get(f)
        shown = reprlib.repr(theirs) if theirs is not None else _NONE
        if mine is None:  # no G4 (no F, no T), or a G4 without a keyring (no T); S is never compared to None
            mine = _NONE if (ours or {}).get("namespace") is not None else "none (no G4)"
        rid = getattr(request, "request_id", "?")
        key = hashlib.blake2b(repr((theirs, mine)).encode("utf-8", "surrogatepass"), digest_size=16).digest()
        text = ("kvbm_backend handoff: request %s was prefilled under %s %s, this engine's is %s: the prefill "
                "worker's blocks are not ones this worker reads; served without waiting")
        args = (rid, _WHAT[f], shown, mine)
        budget = _warned_pairs.get(f)
        if budget is None:  # built once per field
            budget = _warned_pairs[f] = PairBudget()
        how = budget.note(key, shown, mine, rid)
        if how == "first":
            log.warning(text, *args)
        elif how == "held":
            more, more_args, named = budget.summary(key)
            if limited.warning(f"identity_{f}", text + more, *args, *more_args):
                budget.said(named)
        return True
    return False
