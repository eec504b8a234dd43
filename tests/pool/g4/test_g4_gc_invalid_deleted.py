"""What gc reports for objects of an impossible size that a pass deletes anyway: the age pass (``max_age_s``) and
the revoked-tenant pass decide without looking at sizes, and before (review of 2026-12-03, H2) they counted such an
object in ``deleted_bytes`` (and ``scanned_bytes``) at the size its listing stated: one block-named file truncated
to 1 TiB (4 KiB on disk), or an S3 listing stating a block at 1 TiB, made the report (and any metric fed from it)
say 1 TiB was freed, a negative listed size made it less than nothing, and ``invalid_size`` said 0. Now an
impossible listed size is looked at (HEAD / ``stat``) whatever the pass decides: a block whose listing misstated
its size counts at its true size; anything else is no block, counted ``invalid_size`` (once, however often listed)
and out of ``scanned_*``, its deleted bytes those of a size some block could have (else 0), and junk of a namespace
whose block size is known is deleted as ``deleted_by["invalid_size"]``, as the capacity pass deletes it.

Review of that change (2026-12-03): an object those passes delete whose look fails (the store gave no answer) is
deleted at 0 bytes for the pass's reason, not counted ``invalid_size`` (its size was never checked) nor named by the
warning of objects left alone (before: both); one the look finds gone since the listing counts
``changed_since_listed``, as the conditional delete would have (before: counted nowhere).

Real file stores (a sparse 1 TiB file), real keyring files, real SeaweedFS behind the loopback proxy of
test_g4_gc_bad_listings.py that rewrites the ``<Size>`` of listed keys; real ``run_gc``."""
from __future__ import annotations

import os
import time
from typing import Iterator

from kvbm_backend.crypto.keyring import Keyring, provider_for
from kvbm_backend.model.frame import HEADER_BYTES
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.gc import run_gc
from kvbm_backend.pool.g4.naming import namespace_doc, namespace_name
from kvbm_backend.pool.g4.store import ObjectInfo, StoreUnavailable
from tests.helpers.pools import tiny_ns
from tests.pool.g4.test_g4_gc_bad_listings import (FAKE_NS, SIZE, T0, TIB, StatFailsFsStore, TwiceListingFsStore,
                                                   _fill, _left, _lie_about_sizes, _name, _s3)

OLD_S = 3600.0  # --max-age-s: every object here is stamped T0 (2023) or minutes before the pass, on the store clock


def _sparse(root, name: str, size: int = TIB, mtime: float = T0) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        os.truncate(f.fileno(), size)
    os.utime(path, (mtime, mtime))


def test_an_age_pass_counts_a_sparse_1_tib_file_at_no_bytes(tmp_path):
    """3 old good blocks and an old block-named file truncated to 1 TiB (no namespace.json: no layout known). The age
    pass deletes all four (old, under block names), but the 1 TiB file is no block: ``invalid_size`` 1, out of
    ``scanned_*``, 0 bytes freed. Before: ``deleted_bytes`` 3,000 + 1 TiB, ``scanned_bytes`` too, invalid_size 0."""
    root = tmp_path / "store"
    st = _fill(root, 3)
    _sparse(root, _name(99))
    res = run_gc(st, max_age_s=OLD_S)
    assert _left(st) == [], res
    assert (res["deleted_objects"], res["deleted_by"]["age"]) == (4, 4), res
    assert res["deleted_bytes"] == 3 * SIZE, res
    assert (res["invalid_size"], res["scanned_objects"], res["scanned_bytes"]) == (1, 3, 3 * SIZE), res
    assert (res["remaining_bytes"], res["errors"]) == (0, 0), res


def _known_ns_store(root):
    """A real namespace (namespace.json written, frames of 4096 + 8192 B): 3 old good blocks, an old 1 TiB sparse
    file and an old 5,000 B object at block names (both junk: not the namespace's frame size)."""
    ns = tiny_ns()
    frame = HEADER_BYTES + ns.layout.bytes_per_block
    st = _fill(root, 3, frame, ns.fingerprint)
    assert st.put_if_absent(namespace_name(ns.fingerprint), namespace_doc(ns, 256))
    _sparse(root, _name(98, ns.fingerprint))
    assert st.put_if_absent(_name(97, ns.fingerprint), b"j" * 5000)
    os.utime(root / _name(97, ns.fingerprint), (T0, T0))
    return st, ns.fingerprint, frame


def test_an_age_pass_deletes_junk_as_invalid_size_at_its_possible_bytes(tmp_path):
    """Junk of a namespace whose block size is known is deleted as the capacity pass deletes it
    (``deleted_by["invalid_size"]``, counted ``invalid_size``), whatever the age pass decided: the 5,000 B object
    at its 5,000 B, the 1 TiB file (a size no block of any layout has) at 0. Before: both ``deleted_by["age"]``,
    ``deleted_bytes`` 3 frames + 1 TiB + 5,000, ``invalid_size`` 0."""
    root = tmp_path / "store"
    st, fp, frame = _known_ns_store(root)
    res = run_gc(st, max_age_s=OLD_S)
    assert _left(st) == [], res
    assert (res["deleted_by"]["age"], res["deleted_by"].get("invalid_size")) == (3, 2), res
    assert (res["deleted_objects"], res["deleted_bytes"]) == (5, 3 * frame + 5000), res
    assert (res["invalid_size"], res["scanned_objects"], res["scanned_bytes"]) == (2, 3, 3 * frame), res
    assert (res["remaining_bytes"], res["errors"]) == (0, 0), res


def test_a_capacity_pass_counts_deleted_1_tib_junk_at_no_bytes(tmp_path):
    """The capacity pass's junk, the same way: a 1 TiB sparse file (4 KiB on disk) deleted as junk frees no 1 TiB.
    Before: ``deleted_bytes`` 1 TiB + 5,000."""
    root = tmp_path / "store"
    st, fp, frame = _known_ns_store(root)
    res = run_gc(st, target_bytes=10 * frame)
    assert _left(st) == sorted(_name(i, fp) for i in range(3)), res
    assert (res["deleted_by"]["invalid_size"], res["invalid_size"]) == (2, 2), res
    assert (res["deleted_objects"], res["deleted_bytes"]) == (2, 5000), res
    assert res["remaining_bytes"] == 3 * frame, res


def test_a_revoked_tenants_1_tib_file_counts_at_no_bytes(tmp_path):
    """Tenant alice revoked (the record names her key id); under her pseudonym a 1,000 B object and a 1 TiB sparse
    file, both unparsable frames written long before ``revoked_at``: both reclaimed (``deleted_by["revoked"]``), the
    1 TiB one no block: ``invalid_size`` 1, 0 bytes. Before: ``deleted_bytes`` 1,000 + 1 TiB, invalid_size 0."""
    (tmp_path / "keys").mkdir(mode=0o700)
    kr_path = str(tmp_path / "keys" / "kr.json")
    kr = Keyring(kr_path, provider_for(kr_path))
    kr.create("alice")
    ps = kr.revoke("alice")["pseudonym"]
    root = tmp_path / "store"
    st = FsStore(root, fsync=False)
    good, big = f"{FAKE_NS}/{ps}/0/00/{1:032x}", f"{FAKE_NS}/{ps}/0/00/{99:032x}"
    assert st.put_if_absent(good, b"x" * SIZE)
    os.utime(root / good, (T0, T0))
    _sparse(root, big)
    assert st.put_if_absent(_name(5), b"x" * SIZE)  # bob's (TEN): not revoked, young: kept
    res = run_gc(st, keyring=kr)
    assert _left(st) == [_name(5)], res
    assert (res["deleted_by"]["revoked"], res["deleted_objects"], res["deleted_bytes"]) == (2, 2, SIZE), res
    assert (res["invalid_size"], res["scanned_objects"], res["scanned_bytes"]) == (1, 2, 2 * SIZE), res
    assert (res["remaining_bytes"], res["errors"]) == (SIZE, 0), res


def test_an_age_dry_run_over_a_listing_naming_1_tib_twice_counts_it_once_at_no_bytes(tmp_path):
    """A listing naming every object twice, a dry run (nothing deleted, so the second entry is seen again): the 1 TiB
    file counts once, ``invalid_size`` 1, 0 bytes. Before: two deletions of 1 TiB each (``deleted_bytes`` 2 TiB)."""
    root = tmp_path / "store"
    st = TwiceListingFsStore(root, fsync=False)
    _sparse(root, _name(99))
    res = run_gc(st, max_age_s=OLD_S, dry_run=True)
    assert (res["deleted_objects"], res["deleted_bytes"], res["invalid_size"]) == (1, 0, 1), res
    assert _left(FsStore(root, fsync=False)) == [_name(99)], res  # a dry run deletes nothing


def test_an_age_pass_whose_size_check_fails_deletes_the_object_at_no_bytes(tmp_path):
    """The stat of the old 1 TiB file fails (the store gave no answer): the age pass deletes it all the same (its
    age, not its size, decides), counting no bytes for a size it could not check, and not as ``invalid_size`` (its
    size was never checked: before the review, 1 by its listing). Before: 1 TiB freed."""
    root = tmp_path / "store"
    _fill(root, 2)
    st = StatFailsFsStore(root, fsync=False)
    st.fail = _name(99)
    _sparse(root, st.fail)
    res = run_gc(st, max_age_s=OLD_S)
    assert _left(st) == [], res
    assert (res["deleted_objects"], res["deleted_bytes"], res["invalid_size"]) == (3, 2 * SIZE, 0), res
    assert (res["deleted_by"]["age"], res["deleted_by"].get("invalid_size")) == (3, None), res
    assert (res["scanned_objects"], res["remaining_bytes"], res["errors"]) == (2, 0, 0), res
    assert "warnings" not in res, res["warnings"]


class _SortedStatFails(FsStore):
    """A real file store listed in name order, whose ``stat`` of any name in ``self.fail`` raises StoreUnavailable
    (a HEAD that got no answer)."""

    fail: frozenset[str] = frozenset()

    def list_patient(self, prefix: str = "", attempts: int = 10) -> Iterator[ObjectInfo]:
        return iter(sorted(super().list_patient(prefix, attempts), key=lambda o: o.name))

    def stat(self, name: str) -> ObjectInfo | None:
        if name in self.fail:
            raise StoreUnavailable(f"stat {name}: no answer (test)")
        return super().stat(name)


def test_a_failed_size_check_of_an_object_the_age_pass_deletes_is_not_named_left_alone(tmp_path):
    """Two 1 TiB files whose stat fails: an old one (listed first) the age pass deletes anyway, and a young one it
    leaves alone (its size unchecked: ``invalid_size``, an error, the warning). The warning names the young one, the
    only one left alone, and ``invalid_size`` counts it alone. Before: ``invalid_size`` 2 and the warning's "first:"
    named the old file, deleted by that pass."""
    root = tmp_path / "store"
    _fill(root, 2)
    st = _SortedStatFails(root, fsync=False)
    old, young = _name(98), _name(99)
    st.fail = frozenset((old, young))
    _sparse(root, old)
    _sparse(root, young, mtime=time.time())  # written now: young
    res = run_gc(st, max_age_s=OLD_S)
    assert _left(st) == [young], res
    assert (res["deleted_by"]["age"], res["deleted_bytes"]) == (3, 2 * SIZE), res
    [warning] = [w for w in res["warnings"] if "could not be checked" in w]
    assert old not in warning, f"the warning of objects left alone names one the pass deleted: {warning}"
    assert warning.startswith("1 object(s)") and f"first: {young}:" in warning, warning
    assert (res["invalid_size"], res["errors"], res["scanned_objects"]) == (1, 1, 2), res


class _GoneAtStat(FsStore):
    """A real file store where another gc (or a reader's drop) removes ``self.racer`` right after the listing
    named it, before this gc acts on it."""

    racer = ""

    def list_patient(self, prefix: str = "", attempts: int = 10) -> Iterator[ObjectInfo]:
        for o in super().list_patient(prefix, attempts):
            if o.name == self.racer:
                os.unlink(os.path.join(self.root, o.name))
            yield o


def test_an_old_object_gone_before_its_size_check_counts_changed_since_listed(tmp_path):
    """An old 1 TiB file removed by another process between the listing and the age pass's stat of its impossible
    size: counted ``changed_since_listed`` (as the conditional delete counts a listed object gone by then; docs/cli.md,
    docs/operations.md), not ``invalid_size`` nor ``scanned_*``. Before the review: in no counter at all."""
    root = tmp_path / "store"
    _fill(root, 2)
    st = _GoneAtStat(root, fsync=False)
    st.racer = _name(99)
    _sparse(root, st.racer)
    res = run_gc(st, max_age_s=OLD_S)
    assert res["deleted_by"]["age"] == 2, res
    assert res["changed_since_listed"] == 1, f"the listed object gone by the delete is in no counter: {res}"
    assert (res["invalid_size"], res["scanned_objects"], res["errors"]) == (0, 2, 0), res


def test_an_s3_age_pass_counts_blocks_a_listing_misstates_at_their_true_size(seaweed, s3_prefix):
    """SeaweedFS behind a proxy whose listing states one good block at 1 TiB and another at -1,000 B, plus a real
    5,000 B object (junk) in a namespace whose namespace.json is there. An age pass deleting everything: the two
    lied-about blocks are HEADed and count at their true size, the junk is ``invalid_size``. Before: ``deleted_bytes``
    8 frames + 1 TiB - 1,000 + 5,000, the junk ``deleted_by["age"]``."""
    ns = tiny_ns("test/bad-sizes-age")
    frame = HEADER_BYTES + ns.layout.bytes_per_block
    proxy, st = _s3(seaweed, s3_prefix)
    try:
        _lie_about_sizes(st, proxy, ns, s3_prefix)
        res = run_gc(st, max_age_s=0)
        assert _left(st) == [], res
        assert (res["deleted_by"]["age"], res["deleted_by"].get("invalid_size")) == (10, 1), res
        assert (res["deleted_objects"], res["deleted_bytes"]) == (11, 10 * frame + 5000), res
        assert (res["invalid_size"], res["scanned_objects"], res["scanned_bytes"]) == (1, 10, 10 * frame), res
        assert (res["remaining_bytes"], res["errors"]) == (0, 0), res
    finally:
        st.close()
        proxy.close()

