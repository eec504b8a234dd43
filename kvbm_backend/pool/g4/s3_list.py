"""Listing an S3 store (:meth:`.s3_store.S3Store.list_patient`): ListObjectsV2 pages, one request each, a throttled
page retried after a backoff (:func:`.throttle.call_attempts`). What a server or proxy that does not keep to the
protocol answers is never taken as this store's objects:

* A key outside the listed prefix (``{store prefix}/{prefix}``: a server, gateway or proxy that ignores ``Prefix``)
  is skipped, never cut into a name: each counts in :attr:`.s3_store.S3Store.listed_outside_prefix` (gc's
  ``outside_prefix``) and one WARNING per listing names how many. Before 2026-12-03 the store's prefix length was
  cut off any key: another prefix's objects became this store's block names (their bytes counted toward gc's
  capacity target, so gc deleted this store's good blocks down to it).
* A continuation token the listing was handed before (a server that answers a token with itself, or a cycle of
  tokens), and a page marked truncated that hands out no token, end the listing with
  :class:`~.store.ListIncomplete` once every object listed so far was yielded (gc: an ``unlisted`` line and an
  error; it acts only on what was listed). Before 2026-12-03 a repeated token listed the same page for ever (gc
  hung) and a truncated page without a token ended the listing silently.
* A listing that does not advance, whatever its tokens: a page naming no key the listing has not named before
  (a page repeated, a cycle of pages, a listing that starts over, however re-sliced, an empty page). A few are
  passed on (a server repeating a page now and then: gc counts each object once, ``listed_duplicates``; S3 may
  answer an empty truncated page); more than :data:`STALLED_PAGES_MAX` in a row end the listing with
  ListIncomplete (that page not yielded). Before 2026-12-03 only a token seen before counted as a loop: a server
  handing out a fresh token with every repeated page made gc list for ever.
* Pages need not come in key order. AWS S3 lists keys in ascending (UTF-8 binary) order, but S3-compatible servers
  and gateways over other backends (a POSIX tree walked in directory order, some MinIO / Ceph gateways) may not.
  Which keys were named is remembered by :class:`SeenKeys` (a scalable Bloom filter: a lookup takes a key never
  named for one named less than 5 % of the time however long the listing; about 1.5-1.7 bytes per key named, up to
  ~3.3 just after it grows: ~106 MiB at 50M keys). A key above every key named so far is new without a look, so an
  ordered listing never depends on its false positives; in any order a healthy page is taken for a stalled one only
  when every key on it is one (at 50M keys under 3.6 % each: a 1,000-key page under 10^-1400, and it takes
  :data:`STALLED_PAGES_MAX` + 1 such pages in a row to end a listing: ~10^-146 even at one key per page). Before
  (2026-12-03, the first stall guard) a page naming no key above the highest listed was taken as nothing new: on a
  server listing in another order more than 100 such pages in a row (every page after the first, listed highest
  key first) ended every listing as incomplete (gc: an ``unlisted`` error on every pass, the rest never listed).

Sizes are passed on as the server states them (gc judges impossible ones: :mod:`.gc_sizes`).
"""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Iterator

from botocore.exceptions import BotoCoreError, ClientError

from .store import ListIncomplete, ObjectInfo
from .throttle import call_attempts

if TYPE_CHECKING:
    from .s3_store import S3Store

log = logging.getLogger(__name__)
STALLED_PAGES_MAX = 100  # pages in a row naming no key not named before: more is a stuck listing (module doc)
MASK64 = (1 << 64) - 1


class SeenKeys:
    """The keys a listing named so far, as a scalable Bloom filter tells (Almeida et al., "Scalable Bloom Filters",
    2007): :meth:`add` is never wrong about a key added before (no false negatives: a page repeated, a listing come
    round again, names nothing new) and takes a key never added for one added (a false positive) less than
    :data:`FPR` (5 %) of the time, however many keys: layer ``i`` holds :data:`FIRST` x 2**i keys and is sized for
    a rate of ``FPR x (1 - RATIO) x RATIO**i`` (the layers' rates sum to under ``FPR``; 3.6 % at 50M keys): 11 bits
    and 8 hashes per key in the first layer, 13.4 bits and 9 hashes in the 12th (50M keys), ~15 bits at 10^9.
    Memory follows the listing: ~1.5-1.7 bytes per key in the layers filled, up to ~3.3 bytes per key just after a
    layer is added (each twice the one before): ~106 MiB at 50M keys, ~215 MiB at 100M. Before (2026-12-03, the
    first version) every layer had 8 bits and 3 hashes per key, ~3 % false positives each, and a lookup looks in
    every layer: ~30 % at 50M keys, growing with each layer (documented as "rarely", and as ~1 byte per key though
    it took up to 2)."""

    FIRST = 1 << 14  # keys the first layer holds
    FPR = 0.05  # a lookup's false-positive rate, all layers together, stays under this
    RATIO = 0.9  # each layer's false-positive rate is this times the one before's (the paper's r)

    def __init__(self) -> None:
        self._layers: list[tuple[bytearray, int, int]] = []  # (bits, how many bits, hashes per key)
        self._room = 0  # keys the newest layer still takes

    def nbytes(self) -> int:
        """Bytes the filter holds."""
        return sum(len(layer) for layer, _m, _k in self._layers)

    def _grow(self) -> None:
        i = len(self._layers)
        bits = -math.log(self.FPR * (1 - self.RATIO) * self.RATIO ** i) / math.log(2) ** 2  # per key, at best k
        keys = self.FIRST << i
        size = math.ceil(keys * bits / 8)
        self._layers.append((bytearray(size), size << 3, max(1, round(bits * math.log(2)))))
        self._room = keys

    def add(self, key: str, new: bool = False) -> bool:
        """Record ``key``; True when it was not (as far as the filter tells) recorded before. ``new``: the caller
        knows it was not (a key above every key recorded): recorded without a look."""
        h = hash(key) & MASK64  # the process's str hash (SipHash): any key, one per process
        # the probe step: h mixed (a splitmix64-style finalizer); a rotation of h, as before, gave small layers up to
        # twice the false positives their size is for. Odd: never 0 modulo a layer's bits (a multiple of 8).
        z = (h * 0x9E3779B97F4A7C15 + 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ z >> 31) * 0x94D049BB133111EB) & MASK64
        b = (z ^ z >> 29) | 1
        if not new:
            for layer, m, k in self._layers:
                i, step = h % m, b % m
                for _ in range(k):
                    if not layer[i >> 3] >> (i & 7) & 1:
                        break
                    i = i + step - m if i + step >= m else i + step
                else:
                    return False
        if not self._room:
            self._grow()
        layer, m, k = self._layers[-1]
        i, step = h % m, b % m
        for _ in range(k):
            layer[i >> 3] |= 1 << (i & 7)
            i = i + step - m if i + step >= m else i + step
        self._room -= 1
        return True


def list_pages(store: S3Store, prefix: str, attempts: int) -> Iterator[ObjectInfo]:
    """The objects of ``store`` whose name starts with ``prefix`` (store-relative names), page by page; a page
    the store throttles is tried up to ``attempts`` times. Raises StoreUnavailable, StoreThrottled, an OSError
    naming a missing bucket or the server's answer, and :class:`~.store.ListIncomplete` at the end (module doc)."""
    from .s3_store import _code  # the store module imports this one

    base = f"{store.prefix}/" if store.prefix else ""
    want = base + prefix
    kw: dict[str, Any] = {"Bucket": store.bucket, "Prefix": want}
    tokens: set[str] = set()  # handed out so far: one seen again is a loop
    outside = stalled = 0
    seen = SeenKeys()  # the keys named so far (module doc: pages in any order)
    high = ""  # the highest key named so far: a key above it is new without a look

    def page_once() -> Any:
        return store._call("list", prefix, lambda _r: store.client.list_objects_v2(**kw))
    try:
        while True:
            page = call_attempts(page_once, attempts)
            contents = page.get("Contents", [])
            fresh = False
            for o in contents:  # every key recorded, also when one before was new
                key = str(o["Key"])
                fresh = seen.add(key, key > high) or fresh
                high = max(high, key)
            if fresh:
                stalled = 0
            else:  # nothing not named before: a repeated or empty page, a listing come round again
                stalled += 1
                if stalled > STALLED_PAGES_MAX:
                    raise ListIncomplete(store.url, [
                        f"cannot list {store.url}/{prefix}: {stalled} pages in a row named nothing new (no key not "
                        "listed before: pages repeated, empty or listed again; the listing does not advance); the "
                        "rest of the listing was not read"])
            for o in contents:
                key = str(o["Key"])
                if not key.startswith(want):  # a server ignoring Prefix: another prefix's object, never ours
                    outside += 1
                    continue
                yield ObjectInfo(key[len(base):], int(o["Size"]), o["LastModified"].timestamp(),
                                 o.get("ETag") or None)
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
            if not token or token in tokens:
                why = ("a page marked truncated handed out no continuation token" if not token else
                       f"the server handed out continuation token {str(token)[:40]!r} again (a loop)")
                raise ListIncomplete(store.url, [f"cannot list {store.url}/{prefix}: {why}; the rest of the "
                                                 "listing was not read"])
            tokens.add(token)
            kw["ContinuationToken"] = token
    except ClientError as e:
        code, _status = _code(e)
        if code == "NoSuchBucket":
            raise OSError(f"list {store.url}: bucket {store.bucket!r} does not exist") from None
        raise store._err("list", prefix, e) from None
    except BotoCoreError as e:
        raise store._unavailable("list", prefix, e) from None
    finally:
        if outside:
            with store._mu:
                store.listed_outside_prefix += outside
            log.warning("list %s/%s: skipped %d key(s) outside the prefix %r the listing asked for: the server or a "
                        "proxy in front of it ignores Prefix (docs/format.md, \"gc and listings\")", store.url,
                        prefix, outside, want)
