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
pairs are held in a bounded sample (:class:`PairBudget`: :data:`HELD_PAIRS` pairs, a reservoir sample of the pairs new
to it since its last line, a pair seen again never evicted), and the field's once-a-minute line names, besides the
mismatch at hand, the pairs seen more than once since (the likely misconfigurations, at most :data:`NAMED_PER_LINE`,
most frequent first) and how many mismatches and new pairs had no line of their own. A flood of distinct values is
counted there; a pair that recurs is named within a few lines of it.
"""
from __future__ import annotations

import hashlib
import heapq
import hmac
import logging
import random
import reprlib
from typing import Any

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
HELD_PAIRS = 1024  # later pairs of a field held (a sample) for its once-a-minute line
NAMED_PER_LINE = 4  # recurring pairs a field's once-a-minute line names at most
_LOGGED_MAX = FIRST_PAIRS + 4096  # pairs a field remembers as logged (first sight and named)
_WHAT = {"namespace": "G4 namespace (model, revision, dtype, KV layout, TP size: both workers need the same, "
                      "or g4.layout: canonical)",
         "tenant": "tenant (pseudonym prefix; the request's cache_salt, else each worker's default tenant)",
         "salt": "request salt (hash of cache_salt and LoRA adapter: the decode request must name the same as its "
                 "prefill request)"}
_NONE = "none (its G4 has no keyring)"


class PairBudget:
    """What one identity field's mismatch WARNINGs have said (module doc). Pairs are keyed by a digest of their
    values (a forged value of any size costs 16 bytes here) and shown bounded (:func:`reprlib.repr`). Scheduler thread
    only. ``rng``: the sample's random choices (tests pass a seeded one)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.logged: set[bytes] = set()  # pairs that had a line of their own
        self.first = 0  # first-sight lines given (<= FIRST_PAIRS)
        self.held: dict[bytes, list[Any]] = {}  # pair -> [mismatches, theirs shown, ours shown, last request id]
        self.slots: list[bytes] = []  # the held pairs, in sample slots
        self.again: set[bytes] = set()  # the held pairs seen more than once (never evicted)
        self.arrivals = 0  # pairs new to ``held`` since the last line (the sample's denominator)
        self.unlogged = 0  # mismatches of pairs without a line of their own since the last line
        self.rng = rng or random.Random()

    def note(self, key: bytes, theirs: str, ours: str, rid: str) -> str | None:
        """One mismatch of pair ``key``: ``"first"`` (log it now: a first-sight line), ``"held"`` (no line of its own
        yet: the field's once-a-minute line may come, :meth:`summary`) or None (its line was logged before)."""
        if key in self.logged:
            return None
        if self.first < FIRST_PAIRS:
            self.first += 1
            self.logged.add(key)
            return "first"
        self.unlogged += 1
        e = self.held.get(key)
        if e is not None:
            e[0] += 1
            e[3] = rid
            self.again.add(key)
            return "held"
        self.arrivals += 1
        if len(self.slots) < HELD_PAIRS:
            self.slots.append(key)
        else:  # reservoir sample of this line's new pairs; a pair seen again is never evicted
            j = self.rng.randrange(self.arrivals)
            if j >= HELD_PAIRS or self.held[self.slots[j]][0] > 1:
                return "held"
            del self.held[self.slots[j]]
            self.slots[j] = key
        self.held[key] = [1, theirs, ours, rid]
        return "held"

    def recurring(self, key: bytes) -> list[bytes]:
        """The held pairs other than ``key`` seen more than once since they were held, most mismatches first (at most
        :data:`NAMED_PER_LINE`)."""
        return heapq.nlargest(NAMED_PER_LINE, (k for k in self.again if k != key), key=lambda k: self.held[k][0])

    def summary(self, key: bytes) -> tuple[str, tuple[Any, ...], list[bytes]]:
        """The once-a-minute line's addition (text, its args) and the pairs it names (``key`` first)."""
        named = self.recurring(key)
        pairs = "; ".join(f"prefilled under {e[1]}, this engine's {e[2]} ({e[0]} requests, last {e[3]})"
                          for e in (self.held[k] for k in named))
        text = (" [the first %d pairs of values of this field each had a line; since its last line %d mismatches of "
                "%d pairs new to it had none (forged kv_transfer_params? each is counted in "
                "handoff_identity_mismatches)%s]")
        return text, (FIRST_PAIRS, self.unlogged, self.arrivals,
                      "; seen more than once, likely a misconfiguration: " + pairs if pairs else ""), [key, *named]

    def said(self, keys: list[bytes]) -> None:
        """The field's line was logged naming ``keys``: they are logged pairs now; the counts start anew."""
        for k in keys:
            self.held.pop(k, None)
            self.again.discard(k)
            if len(self.logged) < _LOGGED_MAX:
                self.logged.add(k)
        self.slots = [k for k in self.slots if k in self.held]
        self.unlogged = self.arrivals = 0


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
    :class:`~kvbm_backend.log_limits.LimitedLog`: one a minute), which names the pairs seen again meanwhile."""
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
        budget = _warned_pairs.setdefault(f, PairBudget())
        how = budget.note(key, shown, mine, rid)
        if how == "first":
            log.warning(text, *args)
        elif how == "held":
            more, more_args, named = budget.summary(key)
            if limited.warning(f"identity_{f}", text + more, *args, *more_args):
                budget.said(named)
        return True
    return False
