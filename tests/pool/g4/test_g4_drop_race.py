"""A corrupt G4 object is deleted only while its name still holds the bytes proven bad (review finding 4,
2026-12-01). Before, the reader confirmed the bad bytes with the store and then deleted by name: worker A
confirms corrupt X; worker B deletes X; worker C's create-exclusive write publishes a good X'; A's delete
removed X'. The interleaving is made deterministic by a real store (file, SeaweedFS S3, memory) whose
``stored_matches`` runs B's delete and C's write right after it confirms (no sleeps). Now the delete is
conditional: file stores rename to a quarantine name and compare again (``pool/g4/fs_quarantine.py``), S3
sends ``If-Match`` (SeaweedFS honours it), the memory store compares under its lock. Each store's own
``delete_if_matches`` is tested below with a ``stored_matches`` that says yes to anything: the condition holds
at the delete itself."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from tests.helpers.g4_writer import namespace, payload
from tests.helpers.lying_proxy import LyingProxy
from tests.helpers.pools import G4_TIMEOUT_S
from kvbm_backend.config import G4Config
from kvbm_backend.model.frame import HEADER_BYTES
from kvbm_backend.pool.g4.fs_quarantine import quarantine_name
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.gc import run_gc
from kvbm_backend.pool.g4.memory_store import MemoryStore, clear
from kvbm_backend.pool.g4.migrate import run_migrate
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.pool.g4.s3_obstore import ObstoreS3Store

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
NS = namespace()
BPB = NS.layout.bytes_per_block


class _ReplacedAfterProof:
    """A store where, right after the reader's proof (``stored_matches`` confirms the bad bytes), worker B
    deletes the object and worker C publishes ``replacement`` under its name create-exclusive: once, when
    ``replacement`` is set. Real store operations on the real store, in the order of the race."""

    replacement: bytes | None = None
    swapped = 0

    def stored_matches(self, name, data, size):
        proven = super().stored_matches(name, data, size)  # type: ignore[misc]
        if proven and self.replacement is not None:
            good, self.replacement = self.replacement, None
            self.delete(name)  # type: ignore[attr-defined]  # worker B
            assert self.put_if_absent(name, good)  # type: ignore[attr-defined]  # worker C
            self.swapped += 1
        return proven


class _SwapFs(_ReplacedAfterProof, FsStore):
    pass


class _SwapS3(_ReplacedAfterProof, ObstoreS3Store):
    pass


class _SwapMem(_ReplacedAfterProof, MemoryStore):
    pass


@pytest.fixture
def swapping(request, tmp_path):
    """``(store, G4Config kwargs)`` of a :class:`_ReplacedAfterProof` store of kind ``request.param``."""
    kind = request.param
    kr = {"keyring": {"path": str(tmp_path / "keys" / "kr.json")}, "timeout_s": 30.0}
    if kind == "file":
        yield _SwapFs(tmp_path / "g4"), {"url": f"file://{tmp_path / 'g4'}", **kr}
    elif kind == "s3":
        sw, prefix = request.getfixturevalue("seaweed"), request.getfixturevalue("s3_prefix")
        st = _SwapS3(sw.bucket, prefix, endpoint_url=sw.endpoint, timeout_s=30.0)
        yield st, {"url": sw.url(prefix), "endpoint_url": sw.endpoint, **kr}
        st.close()
    else:
        name = f"drop-race-{os.getpid()}-{time.monotonic_ns()}"
        yield _SwapMem(name), {"url": f"mem://{name}", **kr}
        clear(name)


def _read(p: G4Pool, seqs, tenant="t"):
    out = [np.full(BPB, 0xEE, np.uint8) for _ in seqs]
    ok = p.get(NS.keys(seqs, tenant=tenant), out).result(timeout=HANG_S).ok
    for o, b, s in zip(ok, out, seqs):
        assert not o or np.array_equal(b, payload(s, tenant, BPB)), "a hit with wrong bytes"
    return ok


@pytest.mark.parametrize("swapping", ["file", "s3", "mem"], indirect=True)
def test_a_good_copy_published_between_the_proof_and_the_delete_is_kept(swapping):
    store, cfg = swapping
    with G4Pool(G4Config(**cfg), NS, store=store) as p:
        key = NS.key(7, tenant="t")
        name = p.object_name(key)
        assert p.put([key], [payload(7, "t", BPB)]).result(timeout=HANG_S).written == 1
        good = bytes(store.get(name))
        bad = bytearray(good)
        bad[HEADER_BYTES + BPB // 2] ^= 0x01  # one payload byte: the tag / checksum fails
        store.put(name, bytes(bad))
        store.replacement = good  # B and C act right after A's proof
        assert _read(p, [7]) == [False]  # A read the bad copy: a miss
        st = p.stats()
        assert store.swapped == 1 and st["corrupt_integrity"] == 1, st
        assert st.get("deleted_corrupt", 0) == 0, "A deleted the good copy C published after its proof"
        assert store.get(name) is not None and bytes(store.get(name)) == good
        assert _read(p, [7]) == [True]  # the good copy serves
        # without a race the proven bad object still goes
        store.put(name, bytes(bad))
        assert _read(p, [7]) == [False] and p.stats()["deleted_corrupt"] == 1
        assert store.get(name) is None
    if isinstance(store, FsStore):
        assert list(store.list_temps("")) == []  # no quarantine file left behind


def test_the_encrypted_copy_replacing_a_plaintext_one_after_the_proof_is_kept(tmp_path):
    """The other delete of the reader: a plaintext frame in an encrypted pool (``deleted_unencrypted``)."""
    kr = {"path": str(tmp_path / "keys" / "kr.json")}
    url = f"file://{tmp_path / 'g4'}"
    store = _SwapFs(tmp_path / "g4")
    key = NS.key(3, tenant="t")
    with G4Pool(G4Config(url=url, keyring=kr, encrypt=False, timeout_s=G4_TIMEOUT_S), NS, store=store) as plain:
        assert plain.put([key], [payload(3, "t", BPB)]).result(timeout=HANG_S).written == 1
        name = plain.object_name(key)
        plaintext = bytes(store.get(name))
    with G4Pool(G4Config(url=url, keyring=kr, timeout_s=G4_TIMEOUT_S), NS, store=store) as enc:
        store.delete(name)
        assert enc.put([key], [payload(3, "t", BPB)]).result(timeout=HANG_S).written == 1
        sealed = bytes(store.get(name))
        store.put(name, plaintext)
        store.replacement = sealed
        assert _read(enc, [3]) == [False]
        st = enc.stats()
        assert store.swapped == 1 and st["miss_unencrypted_object"] == 1 and not st.get("deleted_unencrypted"), st
        assert bytes(store.get(name)) == sealed and _read(enc, [3]) == [True]


# ---- each store's conditional delete --------------------------------------------------------------------
NAME = f"{'a' * 16}/{'b' * 32}/0/0f/{'c' * 32}"  # a block name (gc's own directories)


class _Trusting:
    """``stored_matches`` says yes to anything: the condition must hold at the delete itself (a compare made
    before it, as the old code's, is the race), so a delete of other bytes is still refused."""

    def stored_matches(self, name, data, size):
        return True


class _TrustingFs(_Trusting, FsStore):
    pass


class _TrustingS3(_Trusting, ObstoreS3Store):
    pass


def test_fs_delete_if_matches_deletes_only_the_bytes_given(tmp_path):
    st = _TrustingFs(tmp_path / "s")
    assert st.delete_if_matches(NAME, b"x" * 10, 10) is False  # absent
    st.put_if_absent(NAME, b"good-bytes" * 100)
    assert st.delete_if_matches(NAME, b"bad-bytes!" * 100, 1000) is False  # other bytes: put back
    assert st.delete_if_matches(NAME, b"good-bytes", 999) is False  # another size
    assert bytes(st.get(NAME)) == b"good-bytes" * 100
    assert st.delete_if_matches(NAME, b"good-bytes" * 100, 1000) is True
    assert st.get(NAME) is None
    assert list(st.list_temps("")) == [] and list(st.list("")) == []


class _PublishedDuringQuarantine(FsStore):
    """Worker D publishes ``newer`` under the object's name while the object sits under its quarantine name
    (when the quarantined file is opened to be compared)."""

    newer: bytes | None = None

    def _open_file(self, name, direct, blocking=True):
        if ".quarantine." in name and self.newer is not None:
            newer, self.newer = self.newer, None
            assert self.put_if_absent(NAME, newer)
        return super()._open_file(name, direct, blocking)


def test_a_copy_published_while_quarantined_keeps_the_name(tmp_path):
    st = _PublishedDuringQuarantine(tmp_path / "s")
    st.put_if_absent(NAME, b"replacement" * 10)  # not the bytes proven bad: goes back, unless the name is taken
    st.newer = b"newest-copy" * 10
    assert st.delete_if_matches(NAME, b"bad-bytes!!" * 10, 110) is False
    assert bytes(st.get(NAME)) == b"newest-copy" * 10  # never overwritten by the put-back
    assert list(st.list_temps("")) == []


def test_a_quarantine_file_left_by_a_crash_is_unlisted_and_collected_by_gc(tmp_path):
    st = FsStore(tmp_path / "s")
    st.put_if_absent(NAME, b"bad" * 100)
    d, base = NAME.rsplit("/", 1)
    q = tmp_path / "s" / d / quarantine_name(base)
    os.rename(tmp_path / "s" / NAME, q)  # a crash between the rename and the unlink
    young = tmp_path / "s" / d / quarantine_name(base)
    young.write_bytes(b"just-written")  # a good copy quarantined by a race, crashed too: young
    old = time.time() - 7200
    os.utime(q, (old, old))
    assert list(st.list("")) == []  # never a block to the pool, gc's block passes or migrate
    assert run_migrate(st, unkeyed=True)["legacy_objects"] == 0
    res = run_gc(st, max_age_s=0, temp_grace_s=3600)
    assert res["deleted_by"]["temp"] == 1 and res["scanned_objects"] == 0, res
    assert not q.exists() and young.exists()  # collected once temp_grace_s old, as a writer's temp file


def test_s3_delete_carries_if_match_and_seaweedfs_honours_it(seaweed, s3_prefix):
    st = _TrustingS3(seaweed.bucket, s3_prefix, endpoint_url=seaweed.endpoint, timeout_s=30.0)
    try:
        assert st.delete_if_matches(NAME, b"x" * 10, 10) is False  # absent
        assert st.put_if_absent(NAME, b"good-bytes" * 100)
        assert st.delete_if_matches(NAME, b"bad-bytes!" * 100, 1000) is False  # 412: kept
        assert st.supports_conditional_delete and bytes(st.get(NAME)) == b"good-bytes" * 100
        assert st.delete_if_matches(NAME, b"good-bytes" * 50, 1000) is False  # not the whole object: no ETag
        assert st.delete_if_matches(NAME, b"good-bytes" * 100, 1000) is True
        assert st.get(NAME) is None
    finally:
        st.close()


def test_an_s3_server_without_conditional_deletes_falls_back_to_compare_then_delete(seaweed, s3_prefix):
    """A server that answers 501 to ``If-Match`` on DELETE (a real proxy in front of SeaweedFS answers so): the
    store compares (HEAD) and deletes by name for ``COND_DELETE_RECHECK_S`` (600 s), as before 2026-12-01 (racy:
    docs/operations.md), then tries If-Match again."""
    host, port = seaweed.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = LyingProxy(host, int(port))
    proxy.no_conditional_delete = True
    st = ObstoreS3Store(seaweed.bucket, s3_prefix, endpoint_url=proxy.endpoint, timeout_s=30.0)
    try:
        assert st.put_if_absent(NAME, b"good-bytes" * 100)
        assert st.delete_if_matches(NAME, b"bad-bytes!" * 100, 1000) is False  # the HEAD compare: kept
        assert proxy.refused_deletes == 1 and not st.supports_conditional_delete
        assert bytes(st.get(NAME)) == b"good-bytes" * 100
        assert st.delete_if_matches(NAME, b"good-bytes" * 100, 1000) is True and st.get(NAME) is None
        assert proxy.refused_deletes == 1  # no If-Match sent again
        # a gateway that refused once (flaky, or fixed since): after COND_DELETE_RECHECK_S the store tries If-Match
        # again and keeps it. Before 2026-12-02 one 501 turned conditional deletes off for the store's life.
        proxy.no_conditional_delete = False
        st._cond_delete_retry_at = 0.0  # the recheck period has passed (the store's own clock, not waited for)
        assert st.put_if_absent(NAME, b"good-bytes" * 100)
        assert st.delete_if_matches(NAME, b"bad-bytes!" * 100, 1000) is False and st.supports_conditional_delete
        assert st.delete_if_matches(NAME, b"good-bytes" * 100, 1000) is True and st.get(NAME) is None
        assert proxy.refused_deletes == 1
    finally:
        st.close()
        proxy.close()
