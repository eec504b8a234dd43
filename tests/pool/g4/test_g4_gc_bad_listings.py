"""gc's capacity pass against objects and listings that lie about sizes and names (review of 2026-12-03: can a bad
server or a bad object make gc delete good G4 blocks?).

1. An object at a block name of an impossible size: a block-named file ``truncate``'d to 1 TiB (sparse), an S3
   listing stating a block's ``Size`` as 1 TiB or negative. Before, the listed sizes were summed as they came and
   the capacity pass deleted the oldest blocks until the total was under the target: every good block went. Now
   such an object is no block (``invalid_size``): junk deleted where its namespace's block size is known
   (``namespace.json``), kept and left out of the total where it is not, and a listing that misstated a good
   block's size is corrected by a HEAD.
2. An S3 server or proxy that ignores ``Prefix``: another prefix's keys were cut into this store's block names
   (their bytes counted toward the target). Now they are skipped and counted (``outside_prefix``).
3. A server that hands out the same continuation token again: the listing looped for ever (gc hung). Now it ends
   with ``ListIncomplete`` (an ``unlisted`` line and an error); a truncated page without a token too, and (review
   of eec6b07) a server handing out a fresh token with every repeated (or empty) page: before, only a token seen
   before was a loop, and such a server made gc list for ever; now more than ``STALLED_PAGES_MAX`` pages in a row
   that name no key not listed before end the listing (pages out of key order: test_g4_gc_unordered_listing.py).
4. Review of eec6b07: an object judged no block (``invalid_size``) that a listing names twice was counted twice
   (the repeat check looked only at the capacity pass's ``keep``, which such an object never enters); a HEAD /
   ``stat`` of such an object that failed was reported as a missing ``namespace.json`` and counted no error.

Real file stores, real SeaweedFS behind a real loopback proxy that rewrites ListObjectsV2 answers.
"""
from __future__ import annotations

import os
import re
import threading
from typing import Iterator

import pytest

from kvbm_backend.model.frame import HEADER_BYTES
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.gc import THROTTLE_ATTEMPTS, run_gc
from kvbm_backend.pool.g4 import s3_list
from kvbm_backend.pool.g4.naming import namespace_doc, namespace_name
from kvbm_backend.pool.g4.s3_store import S3Store
from kvbm_backend.pool.g4.store import ObjectInfo, StoreThrottled, StoreUnavailable
from tests.helpers.lying_proxy import QuietHandler, list_query, reply, serve, stop, upstream
from tests.helpers.pools import tiny_ns

FAKE_NS, TEN = "0123456789abcdef", "ab" * 16  # FAKE_NS: no namespace.json (no block size known)
SIZE = 1000
T0 = 1_700_000_000.0  # block i's mtime: T0 + i (block 0 oldest)
TIB = 1 << 40
HANG_GUARD_S = 120.0  # a pass that has not returned by then is hung (only a guard: passes take seconds)


def _name(i: int, ns: str = FAKE_NS) -> str:
    return f"{ns}/{TEN}/0/00/{i:032x}"  # name order is age order (S3 LastModified ties)


def _fill(root, n: int, size: int = SIZE, ns: str = FAKE_NS) -> FsStore:
    st = FsStore(root, fsync=False)
    for i in range(n):
        assert st.put_if_absent(_name(i, ns), b"x" * size)
        os.utime(root / _name(i, ns), (T0 + i, T0 + i))
    return st


def _left(st) -> list[str]:
    return sorted(o.name for o in st.list("") if not o.name.endswith("namespace.json"))


def test_a_sparse_1_tib_file_at_a_block_name_deletes_no_good_block(tmp_path):
    """The review's repro: 10 blocks of 1,000 B and one block-named file truncated to 1 TiB (4 KiB on disk), a
    target of 20,000 B. Before: all 11 deleted. Its namespace has no namespace.json: gc cannot tell its size is
    wrong for the layout, only that it is over any frame: kept, not counted, a warnings line."""
    root = tmp_path / "store"
    st = _fill(root, 10)
    big = root / _name(99)
    big.parent.mkdir(parents=True, exist_ok=True)
    with open(big, "wb") as f:
        os.truncate(f.fileno(), TIB)
    os.utime(big, (T0 + 50, T0 + 50))  # the newest object: before, every good block was deleted ahead of it
    res = run_gc(st, target_bytes=20_000, now=T0 + 100)
    assert _left(st) == sorted([_name(i) for i in range(10)] + [_name(99)]), res
    assert res["deleted_objects"] == 0 and res["invalid_size"] == 1, res
    assert (res["scanned_objects"], res["scanned_bytes"], res["remaining_bytes"]) == (10, 10 * SIZE, 10 * SIZE), res
    assert any("impossible size" in w for w in res.get("warnings", [])), res
    res = run_gc(st, target_bytes=8 * SIZE, now=T0 + 100)  # the target still works on the good blocks
    assert _left(st) == sorted([_name(i) for i in range(2, 10)] + [_name(99)]), res
    assert res["deleted_by"]["capacity"] == 2 and res["invalid_size"] == 1, res


def test_objects_of_another_size_than_the_namespaces_blocks_are_junk(tmp_path):
    """With the namespace's namespace.json (a real namespace: 8 KiB blocks, frames of 4096 + 8192 B), a block-named
    object of any other size is junk no reader serves: deleted (``deleted_by["invalid_size"]``), never counted
    toward the target. Before: the 1 TiB file made the pass delete every good block."""
    ns = tiny_ns()
    frame = HEADER_BYTES + ns.layout.bytes_per_block
    root = tmp_path / "store"
    st = _fill(root, 10, frame, ns.fingerprint)
    assert st.put_if_absent(namespace_name(ns.fingerprint), namespace_doc(ns, 256))
    with open(root / _name(98, ns.fingerprint), "wb") as f:
        os.truncate(f.fileno(), TIB)
    assert st.put_if_absent(_name(97, ns.fingerprint), b"y" * (frame - 1))  # a short one: junk too
    res = run_gc(st, target_bytes=9 * frame, now=T0 + 100)
    assert _left(st) == sorted(_name(i, ns.fingerprint) for i in range(1, 10)), res
    assert res["deleted_by"]["invalid_size"] == 2 and res["invalid_size"] == 2, res
    assert res["deleted_by"]["capacity"] == 1 and res["remaining_bytes"] == 9 * frame, res
    assert "warnings" not in res, res


class _ListProxy:
    """A loopback HTTP proxy in front of a real S3 server; ListObjectsV2 answers are rewritten, everything else
    passes unchanged:

    * ``sizes[key] = "..."``: the ``<Size>`` the listing states for that key;
    * ``inject[prefix_a] = prefix_b``: a listing of ``prefix_a`` also names the objects a listing of ``prefix_b``
      named through this proxy before (a server that ignores ``Prefix``);
    * ``loop = True``: every answer is marked truncated with the continuation token ``kvbm-loop``, and a request
      for that token is answered with the previous page again (never reaching the server);
    * ``no_token = True``: every answer is marked truncated and hands out no token;
    * ``fresh = "repeat"`` / ``"empty"``: every answer is marked truncated with a token ``kvbm-fresh-N`` never handed
      out before, and a request for such a token is answered (never reaching the server) with the previous page
      again (``"repeat"``) or with that page less its objects (``"empty"``), with a fresh token again; after
      ``fresh_limit`` such answers the page is marked not truncated (so a lister without a bound ends, late)."""

    def __init__(self, host: str, port: int):
        target, proxy = (host, port), self
        self.sizes: dict[str, str] = {}
        self.inject: dict[str, str] = {}
        self.loop = self.no_token = False
        self.fresh, self.fresh_limit = "", 300
        self.looped = 0
        self._seen: dict[str, list[str]] = {}  # prefix -> <Contents> elements a listing of it named
        self._last = b""

        class Handler(QuietHandler):
            def _forward(self):
                query = list_query(self, target)
                if query is None:
                    return
                if proxy.loop and query.get("continuation-token") == ["kvbm-loop"]:
                    proxy.looped += 1
                    reply(self, 200, [("Content-Type", "application/xml")], proxy._last, str(len(proxy._last)))
                    return
                if proxy.fresh and (query.get("continuation-token") or [""])[0].startswith("kvbm-fresh-"):
                    proxy.looped += 1
                    body = proxy._again().encode()
                    reply(self, 200, [("Content-Type", "application/xml")], body, str(len(body)))
                    return
                status, hdrs, data, length = upstream(self, target, None)
                if status == 200:
                    data = proxy._rewrite((query.get("prefix") or [""])[0], data.decode()).encode()
                reply(self, status, hdrs, data, str(len(data)))

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _forward

        self._srv, port = serve(Handler)
        self.endpoint = f"http://127.0.0.1:{port}"

    def _rewrite(self, prefix: str, xml: str) -> str:
        contents = re.findall(r"<Contents>.*?</Contents>", xml, re.S)
        self._seen.setdefault(prefix, []).extend(contents)
        for c in contents:
            key = re.search(r"<Key>(.*?)</Key>", c, re.S).group(1)
            if key in self.sizes:
                xml = xml.replace(c, re.sub(r"<Size>.*?</Size>", f"<Size>{self.sizes[key]}</Size>", c))
        if prefix in self.inject:
            extra = "".join(self._seen.get(self.inject[prefix], []))
            xml = re.sub(r"(</ListBucketResult>)", lambda m: extra + m.group(1), xml)
        if self.loop or self.no_token or self.fresh:
            token = "kvbm-loop" if self.loop else "kvbm-fresh-0" if self.fresh else None
            xml = self._page(xml, token)
        self._last = xml.encode()
        return xml

    @staticmethod
    def _page(xml: str, token: str | None) -> str:
        """``xml`` marked truncated with continuation ``token`` (None: marked truncated, no token; "": the last
        page, not truncated)."""
        xml = re.sub(r"<IsTruncated>.*?</IsTruncated>", f"<IsTruncated>{'false' if token == '' else 'true'}"
                     "</IsTruncated>", xml)
        xml = re.sub(r"<NextContinuationToken>.*?</NextContinuationToken>", "", xml)
        if token:
            xml = xml.replace("</IsTruncated>", f"</IsTruncated><NextContinuationToken>{token}</NextContinuationToken>")
        return xml

    def _again(self) -> str:
        """The answer to a request for a ``kvbm-fresh-N`` token (class doc)."""
        xml = self._last.decode()
        if self.fresh == "empty":
            xml = re.sub(r"<Contents>.*?</Contents>", "", xml, flags=re.S)
            xml = re.sub(r"<KeyCount>.*?</KeyCount>", "<KeyCount>0</KeyCount>", xml)
        return self._page(xml, "" if self.looped >= self.fresh_limit else f"kvbm-fresh-{self.looped}")

    def close(self) -> None:
        stop(self._srv)


def _s3(seaweed, prefix: str):
    host, port = seaweed.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = _ListProxy(host, int(port))
    return proxy, S3Store(seaweed.bucket, prefix, endpoint_url=proxy.endpoint, timeout_s=30.0)


def _gc_guarded(st, **kw):
    """run_gc in a thread, joined at most :data:`HANG_GUARD_S` (a hang guard): the result, or None when hung."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(run_gc(st, **kw)), daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    return out[0] if out else None


def _lie_about_sizes(st, proxy, ns, s3_prefix: str) -> None:
    """``ns``'s namespace.json and 10 good blocks (0..9) in ``st``, one 5,000 B junk object at a block name of ``ns``
    (not a frame of it), and ``proxy``'s listing stating block 9 at 1 TiB and block 5 at -1,000 B."""
    frame = HEADER_BYTES + ns.layout.bytes_per_block
    assert st.put_if_absent(namespace_name(ns.fingerprint), namespace_doc(ns, 256))
    for i in range(10):
        assert st.put_if_absent(_name(i, ns.fingerprint), b"x" * frame)
    assert st.put_if_absent(_name(50, ns.fingerprint), b"j" * 5000)  # junk: not a frame of this namespace
    proxy.sizes[f"{s3_prefix}/{_name(9, ns.fingerprint)}"] = str(TIB)
    proxy.sizes[f"{s3_prefix}/{_name(5, ns.fingerprint)}"] = "-1000"


def test_an_s3_listing_stating_wrong_sizes_deletes_only_down_to_the_target(seaweed, s3_prefix):
    """SeaweedFS behind a proxy whose listing states the newest good block at 1 TiB and another at -1,000 B, plus a
    real object of the wrong size in a namespace whose namespace.json is there. The lied-about blocks are HEADed
    (their true size counts), the wrong-size object is deleted as junk, and exactly the oldest block goes to reach a
    target of 9 blocks. Before: every block was deleted."""
    ns = tiny_ns("test/bad-sizes")
    frame = HEADER_BYTES + ns.layout.bytes_per_block
    proxy, st = _s3(seaweed, s3_prefix)
    try:
        _lie_about_sizes(st, proxy, ns, s3_prefix)
        sizes = {o.name: o.size for o in st.list("")}
        assert (sizes[_name(9, ns.fingerprint)], sizes[_name(5, ns.fingerprint)]) == (TIB, -1000)  # the lie
        res = run_gc(st, target_bytes=9 * frame)
        assert _left(st) == sorted(_name(i, ns.fingerprint) for i in range(1, 10)), res
        assert res["deleted_by"]["capacity"] == 1 and res["deleted_by"]["invalid_size"] == 1, res
        assert (res["invalid_size"], res["scanned_objects"], res["remaining_bytes"]) == (1, 10, 9 * frame), res
        assert res["errors"] == 0, res
    finally:
        st.close()
        proxy.close()


def test_an_s3_server_ignoring_prefix_never_turns_another_prefixs_objects_into_blocks(seaweed, s3_prefix):
    """Two stores on prefixes of one length (``...a``, ``...b``), 10 blocks each (b's newer); the proxy's listing of
    a names b's objects too (a server ignoring Prefix). Before: b's keys, cut at a's prefix length, were a's block
    names, the total was twice the target and gc deleted all 10 of a's good blocks. Now: skipped, counted."""
    proxy, a = _s3(seaweed, s3_prefix + "a")
    b = S3Store(seaweed.bucket, s3_prefix + "b", endpoint_url=proxy.endpoint, timeout_s=30.0)
    try:
        for st, first in ((a, 0), (b, 100)):
            for i in range(first, first + 10):
                assert st.put_if_absent(_name(i), b"x" * SIZE)
        assert len(list(b.list(""))) == 10  # the proxy has seen b's listing
        proxy.inject[f"{s3_prefix}a/"] = f"{s3_prefix}b/"
        res = run_gc(a, target_bytes=10 * SIZE)
        assert _left(a) == sorted(_name(i) for i in range(10)), res
        assert _left(b) == sorted(_name(i) for i in range(100, 110)), res
        assert res["outside_prefix"] == 10 and res["deleted_objects"] == 0, res
        assert (res["scanned_objects"], res["scanned_bytes"]) == (10, 10 * SIZE), res
    finally:
        a.close()
        b.close()
        proxy.close()


def test_an_s3_server_repeating_a_continuation_token_ends_the_listing_as_incomplete(seaweed, s3_prefix):
    """Every page marked truncated with the token ``kvbm-loop``, which the proxy answers with the page again. Before:
    gc listed the page for ever (hung). Now: one ``unlisted`` line and an error; what was listed is acted on."""
    proxy, st = _s3(seaweed, s3_prefix)
    try:
        for i in range(10):
            assert st.put_if_absent(_name(i), b"x" * SIZE)
        proxy.loop = True
        res = _gc_guarded(st, target_bytes=8 * SIZE)
        assert res is not None, f"gc hung: the proxy answered the repeated token {proxy.looped} times"
        assert res["errors"] == 1 and len(res["unlisted"]) == 1 and "again" in res["unlisted"][0], res
        assert proxy.looped == 1, proxy.looped  # asked for once, handed out again: not asked for again
        proxy.loop = False
        assert _left(st) == sorted(_name(i) for i in range(2, 10)), res  # every block was listed: the target holds
    finally:
        st.close()
        proxy.close()


def test_an_s3_page_marked_truncated_without_a_token_is_an_incomplete_listing(seaweed, s3_prefix):
    """A page marked truncated that hands out no continuation token: before, the listing ended silently (gc reported
    success over a partial listing). Now: an ``unlisted`` line and an error."""
    proxy, st = _s3(seaweed, s3_prefix)
    try:
        assert st.put_if_absent(_name(0), b"x" * SIZE)
        proxy.no_token = True
        res = _gc_guarded(st, max_age_s=10 ** 6)
        assert res is not None and res["errors"] == 1 and "no continuation token" in res["unlisted"][0], res
        assert res["deleted_objects"] == 0 and res["scanned_objects"] == 1, res
    finally:
        st.close()
        proxy.close()


def _fresh_token_loop(seaweed, s3_prefix, mode: str):
    """10 blocks, every page handed out with a fresh token and answered ``mode`` (``_ListProxy.fresh``); a capacity
    pass with a target of 8 blocks: ``(result, proxy.looped, blocks left)``."""
    proxy, st = _s3(seaweed, s3_prefix)
    try:
        for i in range(10):
            assert st.put_if_absent(_name(i), b"x" * SIZE)
        proxy.fresh = mode
        res = _gc_guarded(st, target_bytes=8 * SIZE)
        proxy.fresh = ""
        return res, proxy.looped, _left(st)
    finally:
        st.close()
        proxy.close()


def test_an_s3_server_repeating_a_page_with_fresh_tokens_ends_the_listing_as_incomplete(seaweed, s3_prefix):
    """A server answering every page's fresh continuation token with that page again and another fresh token.
    Before: no token was seen twice, so the listing went on for ever (here until the proxy's ``fresh_limit``, 300
    repeats, errors 0). Now: the pages repeated beyond ``STALLED_PAGES_MAX`` in a row end it: one ``unlisted`` line,
    one error; every block was listed once, so the target holds (the repeats count ``listed_duplicates``)."""
    res, looped, left = _fresh_token_loop(seaweed, s3_prefix, "repeat")
    assert res is not None, f"gc hung: the proxy repeated the page {looped} times"
    assert res["errors"] == 1 and len(res["unlisted"]) == 1 and "does not advance" in res["unlisted"][0], res
    assert looped == s3_list.STALLED_PAGES_MAX + 1, looped
    assert res["listed_duplicates"] == 10 * s3_list.STALLED_PAGES_MAX, res
    assert left == sorted(_name(i) for i in range(2, 10)), res


def test_an_s3_server_handing_out_empty_pages_with_fresh_tokens_ends_the_listing_as_incomplete(seaweed, s3_prefix):
    """A server answering every fresh token with an empty page marked truncated and a fresh token: before, listed for
    ever (here until the proxy's ``fresh_limit``); now ``STALLED_PAGES_MAX`` such pages in a row are borne (S3 may
    answer an empty truncated page), the next ends the listing: one ``unlisted`` line, one error."""
    res, looped, left = _fresh_token_loop(seaweed, s3_prefix, "empty")
    assert res is not None, f"gc hung: the proxy answered {looped} empty pages"
    assert res["errors"] == 1 and len(res["unlisted"]) == 1 and "does not advance" in res["unlisted"][0], res
    assert looped == s3_list.STALLED_PAGES_MAX + 1, looped
    assert left == sorted(_name(i) for i in range(2, 10)), res


class TwiceListingFsStore(FsStore):
    """A real file store whose listing names every object twice (as a server repeating its only page)."""

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        objs = list(super().list(prefix))
        yield from objs
        yield from objs


class StatFailsFsStore(FsStore):
    """A real file store whose ``stat`` of ``self.fail`` raises StoreUnavailable (a HEAD that got no answer)."""

    fail: str = ""

    def stat(self, name: str) -> ObjectInfo | None:
        if name == self.fail:
            raise StoreUnavailable(f"stat {name}: no answer (test)")
        return super().stat(name)


def test_a_kept_impossible_object_listed_twice_counts_once(tmp_path):
    """A block-named 1 TiB sparse file (no namespace.json: kept) in a listing naming every object twice. Before:
    ``invalid_size`` 2 and a warning of "2 object(s)" for one object."""
    root = tmp_path / "store"
    _fill(root, 3)
    st = TwiceListingFsStore(root, fsync=False)
    with open(root / _name(99), "wb") as f:
        os.truncate(f.fileno(), TIB)
    res = run_gc(st, target_bytes=10_000, now=T0 + 100)
    assert res["listed_duplicates"] == 3, res  # the good blocks' repeats are recognised ...
    assert res["invalid_size"] == 1, res  # ... the junk's too (before: 2)
    assert not any("2 object(s)" in w for w in res.get("warnings", [])), res["warnings"]


def test_junk_listed_twice_in_a_dry_run_counts_and_deletes_once(tmp_path):
    """Junk (a namespace with namespace.json, an object of another size) in a listing naming every object twice, a
    dry run (nothing deleted, so the second entry is judged junk again). Before: ``invalid_size`` 2,
    ``deleted_by["invalid_size"]`` 2 and its bytes twice in ``deleted_bytes``."""
    ns = tiny_ns()
    frame = HEADER_BYTES + ns.layout.bytes_per_block
    root = tmp_path / "store"
    _fill(root, 3, frame, ns.fingerprint)
    st = TwiceListingFsStore(root, fsync=False)
    assert st.put_if_absent(namespace_name(ns.fingerprint), namespace_doc(ns, 256))
    assert st.put_if_absent(_name(50, ns.fingerprint), b"j" * 5000)
    res = run_gc(st, target_bytes=10 * frame, dry_run=True, now=T0 + 100)
    assert (res["invalid_size"], res["deleted_by"].get("invalid_size")) == (1, 1), res
    assert (res["deleted_objects"], res["deleted_bytes"]) == (1, 5000), res
    assert (res["scanned_objects"], res["listed_duplicates"]) == (3, 3), res


def _store_with_unstatable_junk(tmp_path) -> tuple[StatFailsFsStore, int]:
    ns = tiny_ns()
    frame = HEADER_BYTES + ns.layout.bytes_per_block
    root = tmp_path / "store"
    st = StatFailsFsStore(root, fsync=False)
    assert st.put_if_absent(namespace_name(ns.fingerprint), namespace_doc(ns, 256))
    for i in range(3):
        assert st.put_if_absent(_name(i, ns.fingerprint), b"x" * frame)
    st.fail = _name(50, ns.fingerprint)
    assert st.put_if_absent(st.fail, b"j" * 5000)  # not this namespace's frame size: junk, once looked at
    return st, frame


def test_a_failed_stat_is_not_reported_as_a_missing_namespace_json(tmp_path):
    """The namespace.json is there and parses, 5000 B is neither negative nor over 1 GiB: the warning names the
    failed check. Before: "... kept: their namespace's namespace.json is missing or unreadable"."""
    st, _frame = _store_with_unstatable_junk(tmp_path)
    res = run_gc(st, target_bytes=10 * _frame, now=T0 + 100)
    assert res["invalid_size"] == 1, res
    assert not any("namespace.json is missing" in w for w in res.get("warnings", [])), res["warnings"]
    assert any("could not be checked" in w and "no answer (test)" in w for w in res["warnings"]), res["warnings"]


def test_a_failed_stat_counts_as_an_error(tmp_path):
    """gc could not tell what the object is, nor delete it: as a failed header read or delete, an error (exit 1);
    it is left alone and out of the capacity total. Before: errors 0 (exit 0, nothing said a check failed)."""
    st, frame = _store_with_unstatable_junk(tmp_path)
    res = run_gc(st, target_bytes=3 * frame, now=T0 + 100)
    assert res["errors"] == 1, res
    assert (res["deleted_objects"], res["scanned_objects"], res["remaining_bytes"]) == (0, 3, 3 * frame), res
    assert st.stat(_name(1, tiny_ns().fingerprint)) is not None
    st.fail = ""
    assert st.stat(_name(50, tiny_ns().fingerprint)) is not None  # left alone


class NsGetFailsFsStore(FsStore):
    """A real file store whose ``get`` of ``self.fail`` (a namespace.json) raises ``self.error`` (StoreUnavailable:
    the store gave no answer; StoreThrottled: it said "slow down", every time), counting those gets in ``calls``.
    Everything else, that file's ``stat`` and the listing included, is the file store's own."""

    fail: str = ""
    error: type[OSError] = StoreUnavailable
    calls = 0

    def get(self, name: str, offset: int = 0, length: int | None = None):
        if name == self.fail:
            self.calls += 1
            raise self.error(f"get {name}: no answer (test)")
        return super().get(name, offset, length)


def _store_with_giant_junk(root, cls=FsStore) -> tuple[FsStore, str, int]:
    """A real namespace (namespace.json written) with 3 good blocks (mtimes T0..T0+2) and two block-named sparse
    files of 1 TiB and 2 TiB (impossible for any layout: junk once namespace.json is read). ``(store, ns, frame)``."""
    ns = tiny_ns()
    frame = HEADER_BYTES + ns.layout.bytes_per_block
    st = cls(root, fsync=False)
    assert st.put_if_absent(namespace_name(ns.fingerprint), namespace_doc(ns, 256))
    for i in range(3):
        assert st.put_if_absent(_name(i, ns.fingerprint), b"x" * frame)
        os.utime(root / _name(i, ns.fingerprint), (T0 + i, T0 + i))
    for i, size in ((98, TIB), (99, 2 * TIB)):
        with open(root / _name(i, ns.fingerprint), "wb") as f:
            os.truncate(f.fileno(), size)
    return st, ns.fingerprint, frame


def _assert_left_alone_with_an_error(st, res, fp: str, frame: int, error_text: str) -> None:
    """Both giant files left alone, counted invalid_size and in errors (one each), out of the capacity total; the
    good blocks untouched; a warning naming the failed read of namespace.json, none blaming a missing file."""
    assert _left(st) == sorted(_name(i, fp) for i in (0, 1, 2, 98, 99)), res
    assert (res["invalid_size"], res["errors"], res["deleted_objects"]) == (2, 2, 0), res
    assert (res["scanned_objects"], res["remaining_bytes"]) == (3, 3 * frame), res
    warnings = res.get("warnings", [])
    assert not any("namespace.json is missing" in w for w in warnings), warnings
    assert any("2 object(s)" in w and "read of their namespace's namespace.json failed" in w and error_text in w
               for w in warnings), warnings


def test_a_directory_at_namespace_json_is_a_failed_read_not_a_missing_file(tmp_path):
    """A real failure of the read: ``{ns}/namespace.json`` is a directory (the file store's get refuses what is
    not a regular file: OSError). gc cannot know the layout, so the two 1 TiB+ files, which a readable file would
    have made junk to delete, are left alone and are errors (exit 1), the warning naming the failed read. Before:
    ``kept`` as if the file were missing, errors 0, a warning "namespace.json is missing or unreadable". Once the
    file is back, the next pass deletes them; the good blocks are never touched."""
    root = tmp_path / "store"
    st, fp, frame = _store_with_giant_junk(root)
    ns_json = root / namespace_name(fp)
    saved = ns_json.read_bytes()
    ns_json.unlink()
    ns_json.mkdir()
    res = run_gc(st, target_bytes=10 * frame, now=T0 + 100)
    _assert_left_alone_with_an_error(st, res, fp, frame, "not a regular file")
    ns_json.rmdir()
    ns_json.write_bytes(saved)
    res = run_gc(st, target_bytes=10 * frame, now=T0 + 100)
    assert _left(st) == sorted(_name(i, fp) for i in range(3)), res
    assert (res["deleted_by"]["invalid_size"], res["deleted_objects"], res["errors"]) == (2, 2, 0), res


@pytest.mark.parametrize("error", [StoreUnavailable, StoreThrottled])
def test_a_failed_get_of_namespace_json_leaves_giant_objects_alone_as_errors(tmp_path, error):
    """The store's get of namespace.json fails (unavailable; throttled on each of the THROTTLE_ATTEMPTS tries):
    the objects of a size impossible for any layout are left alone, one error each, the warning naming that read
    (its message). Read once per pass (tries included), not once per object. Before: ``kept``, errors 0, the
    warning blaming a missing file. When the store answers again, the next pass deletes them as junk."""
    root = tmp_path / "store"
    st, fp, frame = _store_with_giant_junk(root, NsGetFailsFsStore)
    st.fail, st.error = namespace_name(fp), error
    res = run_gc(st, target_bytes=10 * frame, now=T0 + 100)
    _assert_left_alone_with_an_error(st, res, fp, frame, "no answer (test)")
    assert st.calls == (THROTTLE_ATTEMPTS if error is StoreThrottled else 1), st.calls
    st.fail = ""
    res = run_gc(st, target_bytes=10 * frame, now=T0 + 100)
    assert _left(st) == sorted(_name(i, fp) for i in range(3)), res
    assert (res["deleted_by"]["invalid_size"], res["deleted_objects"], res["errors"]) == (2, 2, 0), res


def test_a_namespace_json_that_does_not_parse_still_means_no_layout_known(tmp_path):
    """A namespace.json that was read but is no JSON is genuinely no layout: the giant objects are kept (not
    errors), the warning says the file is missing or not the namespace's (unchanged by the failed-read fix)."""
    root = tmp_path / "store"
    st, fp, frame = _store_with_giant_junk(root)
    (root / namespace_name(fp)).write_bytes(b"{not json")
    res = run_gc(st, target_bytes=10 * frame, now=T0 + 100)
    assert _left(st) == sorted(_name(i, fp) for i in (0, 1, 2, 98, 99)), res
    assert (res["invalid_size"], res["errors"], res["deleted_objects"], res["remaining_bytes"]) == (2, 0, 0, 3 * frame)
    assert any("2 object(s)" in w and "kept" in w and "namespace.json is missing" in w for w in res["warnings"]), res
