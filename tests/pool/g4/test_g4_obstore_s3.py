"""``g4.s3_client``: the S3 block traffic on obstore (the default) or boto3 (issue 25 item 1), and the
obstore store's contract against a real SeaweedFS: create-exclusive PUT, GET, ranged GET, HEAD, absent
objects and buckets, throttled answers (unretried, unslept), a dead endpoint, per-request timeouts, a
slow PUT whose retry meets its own first copy, and PUTs whose every attempt got no answer (settled by a
HEAD: a landed block counts written, a lost one dropped, with either client), and PUTs whose settling HEAD
got no answer either (PutUnsettled: the pool settles them later, or drops them at close; other bytes found
then are checked as a direct PUT's found object: skipped_exists, or skipped_unservable and not stored)."""
from __future__ import annotations

import time
from urllib.parse import urlparse

import pytest
from pydantic import ValidationError

from tests.helpers.slow_proxy import SlowAnswerProxy, SlowPutProxy
from tests.helpers.throttle_proxy import ThrottleProxy
from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.factory import open_store
from kvbm_backend.pool.g4.s3_obstore import ObstoreS3Store, status_and_code
from kvbm_backend.pool.g4.s3_store import S3Store
from kvbm_backend.pool.g4.store import BucketMissing, StoreThrottled, StoreUnavailable

HANG_S = 600.0  # a hang guard, not a bound: waits for results and states that must come; returns as soon as they do


def test_s3_client_picks_the_store_class(seaweed, s3_prefix):
    url = seaweed.url(s3_prefix)
    default = open_store(url, G4Config(url=url, endpoint_url=seaweed.endpoint))
    boto = open_store(url, G4Config(url=url, endpoint_url=seaweed.endpoint, s3_client="boto3"))
    try:
        assert type(default) is ObstoreS3Store and default.client_name == "obstore"  # the default (config's doc: why)
        kw_default = open_store(url, endpoint_url=seaweed.endpoint)  # keyword form: the same default
        assert type(kw_default) is ObstoreS3Store
        kw_default.close()
        assert type(boto) is S3Store and boto.client_name == "boto3"
        obs_ = open_store(url, G4Config(url=url, endpoint_url=seaweed.endpoint, s3_client="obstore"))
        assert type(obs_) is ObstoreS3Store and obs_.client_name == "obstore"
        default.close()
        default = obs_
        # both read what the other wrote: one object format, two clients
        assert default.put_if_absent("x", b"a" * 5000) is True and boto.put_if_absent("x", b"b" * 5000) is False
        assert bytes(boto.get("x")) == bytes(default.get("x")) == b"a" * 5000
    finally:
        default.close()
        boto.close()
    with pytest.raises(ValidationError, match="s3_client"):
        G4Config(url=url, s3_client="nixl")


@pytest.fixture
def obs(seaweed, s3_prefix):
    st = ObstoreS3Store(seaweed.bucket, s3_prefix, endpoint_url=seaweed.endpoint, timeout_s=2.0, retries=1)
    yield st
    st.close()


def test_obstore_store_puts_create_exclusive_and_reads_ranges(obs):
    data = bytes(range(256)) * 64  # 16 KiB
    assert obs.put_if_absent("blk", memoryview(bytearray(data))) is True  # a writable buffer, not bytes
    assert obs.put_if_absent("blk", b"other") is False  # losing the race is success; the first copy stays
    assert bytes(obs.get("blk")) == data and obs.head("blk") == len(data)
    assert bytes(obs.get("blk", 4096, 100)) == data[4096:4196]
    assert bytes(obs.get("blk", 16000)) == data[16000:]
    assert bytes(obs.get("blk", 20000, 10)) == b""  # past the end
    assert obs.get("absent") is None and obs.head("absent") is None
    obs.put("meta", b"v1")
    obs.put("meta", b"v2")  # plain put replaces
    assert bytes(obs.get("meta")) == b"v2"
    assert obs.stored_matches("blk", memoryview(data), len(data)) is True  # ETag = MD5 of the bytes
    assert obs.stored_matches("blk", memoryview(data[:-1] + b"\0"), len(data)) is False


def test_obstore_store_errors_are_the_store_contract(seaweed, s3_prefix):
    nob = ObstoreS3Store("no-such-bucket-kvbm", s3_prefix, endpoint_url=seaweed.endpoint, timeout_s=2.0)
    with pytest.raises(BucketMissing):
        nob.get("x")
    dead = ObstoreS3Store(seaweed.bucket, s3_prefix, endpoint_url="http://127.0.0.1:9", timeout_s=1.0, retries=1)
    for call in (lambda: dead.get("x"), lambda: dead.head("x"), lambda: dead.put_if_absent("x", b"1")):
        with pytest.raises(StoreUnavailable):
            call()
    assert status_and_code(Exception("... non-2xx status code: 503 Service Unavailable: <Code>SlowDown</Code>")) == \
        (503, "SlowDown")


def test_obstore_store_throttled_answers_raise_at_once_unretried(seaweed, s3_prefix):
    u = urlparse(seaweed.endpoint)
    up = ObstoreS3Store(seaweed.bucket, s3_prefix, endpoint_url=seaweed.endpoint)
    up.put_if_absent("t", b"z" * 100)
    proxy = ThrottleProxy(u.hostname, u.port, share=1.0)
    try:
        st = ObstoreS3Store(seaweed.bucket, s3_prefix, endpoint_url=proxy.endpoint, timeout_s=2.0, retries=3)
        for i, call in enumerate((lambda: st.get("t"), lambda: st.head("t"), lambda: st.put_if_absent("u", b"1"))):
            with pytest.raises(StoreThrottled):
                call()
            assert proxy.throttled == i + 1  # one request each: the pool's backoff owns the retries
        proxy.share = 0.0
        assert bytes(st.get("t")) == b"z" * 100
    finally:
        proxy.close()


def test_obstore_store_bounds_each_request_and_a_late_put_counts_as_its_own(seaweed, s3_prefix):
    u = urlparse(seaweed.endpoint)
    timeout = 0.5
    proxy = SlowAnswerProxy(u.hostname, u.port, slow_connections=1, delay_s=4 * timeout)
    try:
        st = ObstoreS3Store(seaweed.bucket, s3_prefix, endpoint_url=proxy.endpoint, timeout_s=timeout, retries=1,
                            put_timeout=timeout)  # g4.put_timeout_s at timeout_s: a late answer times the PUT out
        # the first PUT's answer comes after its timeout; the retry (new connection) meets 412 for the
        # copy the server stored from the first attempt: the ETag matches, so this call created it
        assert st.put_if_absent("a", b"x" * 1000) is True
        assert proxy.wait_answer(0).startswith(b"HTTP/1.1 200"), proxy.first_answers
        assert st.put_if_absent("a", b"y" * 1000) is False
    finally:
        proxy.close()
    proxy = SlowAnswerProxy(u.hostname, u.port, slow_connections=10, delay_s=8.0)
    try:
        st = ObstoreS3Store(seaweed.bucket, s3_prefix, endpoint_url=proxy.endpoint, timeout_s=timeout, retries=1)
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            st.get("a")
        assert time.monotonic() - t0 < 7.0  # two attempts of 0.5 s, not the 8 s answer
    finally:
        proxy.close()


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_g4_pool_round_trips_encrypted_blocks_with_either_client(seaweed, s3_prefix, tmp_path, client):
    import numpy as np

    from tests.helpers.g4_writer import namespace, payload
    from kvbm_backend.pool.g4.pool import G4Pool
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    keys = ns.keys(range(1, 9), tenant="t")
    blocks = [payload(s, "t", bpb) for s in range(1, 9)]
    cfg = G4Config(url=seaweed.url(s3_prefix), endpoint_url=seaweed.endpoint, s3_client=client, max_inflight=3,
                   keyring={"path": str(tmp_path / "kr.json")})
    with G4Pool(cfg, ns) as p:
        assert p.store.client_name == client
        assert p.put(keys, blocks).result(timeout=HANG_S).written == 8  # 8 blocks through 3 reused frame buffers
        out = [np.zeros(bpb, np.uint8) for _ in keys]
        assert p.get(keys, out).result(timeout=HANG_S).ok == [True] * 8
        assert all(np.array_equal(o, b) for o, b in zip(out, blocks))
        assert p.put(keys[:2], blocks[:2]).result(timeout=HANG_S).skipped == 2


def _store(client: str, seaweed, prefix: str, endpoint: str, timeout_s: float):
    if client == "obstore":  # g4.put_timeout_s at timeout_s: a PUT answered late times out, as boto3's does
        return ObstoreS3Store(seaweed.bucket, prefix, endpoint_url=endpoint, timeout_s=timeout_s, retries=1,
                              put_timeout=timeout_s)
    return S3Store(seaweed.bucket, prefix, endpoint_url=endpoint, timeout_s=timeout_s, retries=1)


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_a_put_answered_too_late_counts_landed_and_a_lost_one_unavailable(seaweed, s3_prefix, client):
    """Publish after durable, both ways (the CI handoff under load: PUTs landed, their answers came after
    the timeout): a PUT whose every attempt timed out is settled by a HEAD. Its bytes there (ETag = MD5)
    count as written by this call, another writer's bytes as already there, and nothing there (the body
    never reached the server) stays StoreUnavailable: never landed-as-lost, never lost-as-landed."""
    u = urlparse(seaweed.endpoint)
    timeout = 1.0  # the proxy's own latency stays well under it on a loaded 2-core VM
    direct = _store(client, seaweed, s3_prefix, seaweed.endpoint, 5.0)
    late = SlowPutProxy(u.hostname, u.port, mode="late", delay_s=4 * timeout)
    lost = SlowPutProxy(u.hostname, u.port, mode="lost", delay_s=4 * timeout)
    try:
        st = _store(client, seaweed, s3_prefix, late.endpoint, timeout)
        assert st.put_if_absent("landed", b"x" * 1000) is True  # both attempts unanswered; the HEAD finds it
        assert late.held == 2 and bytes(direct.get("landed")) == b"x" * 1000
        direct.put_if_absent("theirs", b"t" * 1000)
        assert st.put_if_absent("theirs", b"y" * 1000) is False  # another writer's copy: not written here
        st.put("meta", b"m" * 10)  # a plain PUT settles the same way
        assert bytes(direct.get("meta")) == b"m" * 10
        st = _store(client, seaweed, s3_prefix, lost.endpoint, timeout)
        with pytest.raises(StoreUnavailable):
            st.put_if_absent("lost", b"z" * 1000)
        with pytest.raises(StoreUnavailable):
            st.put("lost-meta", b"z" * 10)
        assert lost.held == 4 and direct.head("lost") is None and direct.head("lost-meta") is None
    finally:
        late.close()
        lost.close()
        direct.close()


@pytest.mark.parametrize("mode", ["late", "lost"])
def test_g4_pool_on_obstore_counts_late_answered_offloads_written(seaweed, s3_prefix, tmp_path, mode):
    """Through the pool (its writer's counters, what the Dynamo handoff test reads): every block PUT
    answered after ``timeout_s`` is counted written (it landed) and read back; lost ones are dropped."""
    import numpy as np

    from tests.helpers.g4_writer import namespace, payload
    from kvbm_backend.pool.g4.pool import G4Pool
    u = urlparse(seaweed.endpoint)
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    keys = ns.keys(range(1, 5), tenant="t")
    blocks = [payload(s, "t", bpb) for s in range(1, 5)]
    proxy = SlowPutProxy(u.hostname, u.port, mode=mode, delay_s=4.0)
    cfg = G4Config(url=seaweed.url(s3_prefix), endpoint_url=proxy.endpoint, s3_client="obstore", timeout_s=1.0,
                   put_timeout_s=1.0, retries=1, keyring={"path": str(tmp_path / "kr.json")})
    try:
        with G4Pool(cfg, ns) as p:
            res = p.put(keys, blocks).result(timeout=HANG_S)
            st = p.stats()
            out = [np.zeros(bpb, np.uint8) for _ in keys]
            ok = p.get(keys, out).result(timeout=HANG_S).ok
        if mode == "late":
            assert (res.written, res.dropped, st.get("dropped_unavailable", 0)) == (4, 0, 0), st
            assert ok == [True] * 4 and all(np.array_equal(o, b) for o, b in zip(out, blocks))
        else:
            assert (res.written, res.dropped) == (0, 4), st  # unavailable, or the breaker it opened
            assert ok == [False] * 4
    finally:
        proxy.close()


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_a_put_the_server_cannot_settle_raises_put_unsettled_and_settles_later(seaweed, s3_prefix, client):
    """Neither PUT nor HEAD answered (an overloaded server): the store says it cannot tell
    (PutUnsettled, with the MD5 of the bytes sent), never "lost" nor "another writer's copy", and
    :meth:`settle` tells later: these bytes (True), other bytes (False), nothing (None). The same for a
    retried PUT that met 412 (its first attempt landed) when the HEAD comparing ETags fails."""
    import hashlib

    from kvbm_backend.pool.g4.store import PutUnsettled
    u = urlparse(seaweed.endpoint)
    timeout = 1.0
    direct = _store(client, seaweed, s3_prefix, seaweed.endpoint, 5.0)
    late = SlowPutProxy(u.hostname, u.port, mode="late", delay_s=4 * timeout, slow_heads=2)
    lost = SlowPutProxy(u.hostname, u.port, mode="lost", delay_s=4 * timeout, slow_heads=2)
    try:
        st = _store(client, seaweed, s3_prefix, late.endpoint, timeout)
        with pytest.raises(PutUnsettled) as ei:  # both PUTs and both HEADs unanswered: it landed
            st.put_if_absent("landed", b"x" * 1000)
        assert ei.value.md5_hex == hashlib.md5(b"x" * 1000).hexdigest() and late.held_heads == 2
        assert st.settle("landed", ei.value.md5_hex) is True
        direct.put_if_absent("theirs", b"t" * 1000)
        late.held_heads = 0
        with pytest.raises(PutUnsettled) as ei:  # 412 answered late, HEADs unanswered
            st.put_if_absent("theirs", b"y" * 1000)
        assert st.settle("theirs", ei.value.md5_hex) is False
        late.held, late.slow_puts, late.held_heads = 0, 1, 0  # the first PUT lands late, its retry meets 412
        with pytest.raises(PutUnsettled) as ei:
            st.put_if_absent("own-412", b"o" * 1000)
        assert late.held == 1 and late.held_heads == 2
        assert st.settle("own-412", ei.value.md5_hex) is True
        st = _store(client, seaweed, s3_prefix, lost.endpoint, timeout)
        with pytest.raises(PutUnsettled) as ei:
            st.put_if_absent("lost", b"z" * 1000)
        assert st.settle("lost", ei.value.md5_hex) is None and direct.head("lost") is None
    finally:
        late.close()
        lost.close()
        direct.close()


def _unsettled_pool(seaweed, s3_prefix, tmp_path, client, proxy, n: int, first: int = 1, registry=None, **cfg_kw):
    """A G4Pool through ``proxy`` (timeout 1 s, 1 retry: an unsettled PUT is re-checked from 0.5 s on, for
    8 s), its ``n`` keys and blocks (sequences ``first`` on); the proxy is armed (every PUT held, ``2 * n`` HEADs unanswered) once
    the pool wrote ``namespace.json``."""
    from tests.helpers.g4_writer import namespace, payload
    from kvbm_backend.pool.g4.pool import G4Pool
    ns = namespace()
    keys = ns.keys(range(first, first + n), tenant="t")
    blocks = [payload(s, "t", ns.layout.bytes_per_block) for s in range(first, first + n)]
    cfg = G4Config(url=seaweed.url(s3_prefix), endpoint_url=proxy.endpoint, s3_client=client, timeout_s=1.0,
                   put_timeout_s=1.0, retries=1, keyring={"path": str(tmp_path / "kr.json")}, **cfg_kw)
    p = G4Pool(cfg, ns, registry=registry)
    t0 = time.monotonic()
    while not p.writer.namespace_written and time.monotonic() - t0 < HANG_S:
        time.sleep(0.05)
    assert p.writer.namespace_written
    proxy.slow_puts, proxy.slow_heads = None, 2 * n
    return p, cfg, keys, blocks


@pytest.mark.parametrize("client,breaker", [("obstore", False), ("boto3", False), ("obstore", True)])
def test_g4_pool_counts_a_landed_put_written_once_the_server_answers_heads_again(seaweed, s3_prefix, tmp_path,
                                                                                client, breaker):
    """The CI handoff under load: the PUTs landed, their answers and the HEADs settling them came after
    the timeout. The blocks stay pending (not dropped), are settled by a later HEAD and count written.
    ``breaker``: the unsettled PUT opens the circuit breaker (``breaker_failures`` 1): the re-checks wait
    while it refuses and settle through its half-open probe."""
    import numpy as np
    u = urlparse(seaweed.endpoint)
    proxy = SlowPutProxy(u.hostname, u.port, mode="late", delay_s=4.0, slow_puts=0)
    kw = {"breaker_failures": 1, "breaker_reset_s": 1.0} if breaker else {}
    try:
        p, _, keys, blocks = _unsettled_pool(seaweed, s3_prefix, tmp_path, client, proxy, 2, **kw)
        with p:
            res = p.put(keys, blocks).result(timeout=HANG_S)
            st = p.stats()
            proxy.slow_puts = 0
            out = [np.zeros_like(b) for b in blocks]
            ok = p.get(keys, out).result(timeout=HANG_S).ok
        assert (res.written, res.skipped, res.dropped) == (2, 0, 0), st
        assert st["settled_late"] >= 1 and st["unsettled_puts"] >= 1 and st.get("dropped", 0) == 0, st
        assert st["pending_put_blocks"] == st["unsettled_put_blocks"] == 0, st
        assert st["breaker_opens"] >= int(breaker) and st["breaker_state"] == "closed", st
        assert ok == [True, True] and all(np.array_equal(o, b) for o, b in zip(out, blocks))
    finally:
        proxy.close()


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_g4_pool_settles_a_lost_put_dropped_and_another_writers_copy_skipped(seaweed, s3_prefix, tmp_path, client):
    """Unsettled PUTs, settled later the other two ways: a lost PUT (nothing there) ends
    ``dropped_unavailable``, never written; a PUT that met another writer's copy ends ``skipped_exists``,
    never dropped (the old code counted both dropped_unavailable at once)."""
    from kvbm_backend.pool.g4.pool import G4Pool
    u = urlparse(seaweed.endpoint)
    lost = SlowPutProxy(u.hostname, u.port, mode="lost", delay_s=4.0, slow_puts=0)
    late = SlowPutProxy(u.hostname, u.port, mode="late", delay_s=4.0, slow_puts=0)
    try:
        p, cfg, keys, blocks = _unsettled_pool(seaweed, s3_prefix, tmp_path, client, late, 1)
        with G4Pool(cfg.model_copy(update={"endpoint_url": seaweed.endpoint}), p.namespace) as other:
            assert other.put(keys, blocks).result(timeout=HANG_S).written == 1  # another writer's copy (its own nonce)
        with p:
            res = p.put(keys, blocks).result(timeout=HANG_S)
            st = p.stats()
        assert (res.written, res.skipped, res.dropped) == (0, 1, 0), st
        assert st["skipped_exists"] == 1 and st["unsettled_puts"] == 1, st
        p, cfg, keys, blocks = _unsettled_pool(seaweed, s3_prefix, tmp_path, client, lost, 1, first=2)
        with p:
            res = p.put(keys, blocks).result(timeout=HANG_S)
            st = p.stats()
        assert (res.written, res.skipped, res.dropped) == (0, 0, 1), st
        assert st["dropped_unavailable"] == 1 and st["unsettled_puts"] == 1 and st["written"] == 0, st
    finally:
        lost.close()
        late.close()


@pytest.mark.parametrize("theirs", ["plaintext", "another_block"])
def test_g4_pool_settles_a_put_that_met_an_object_it_will_not_serve_not_stored(seaweed, s3_prefix, tmp_path, theirs):
    """An unsettled PUT settled later whose name holds other bytes the pool will not serve: a plaintext frame
    (another worker with ``g4.encrypt: false``; this pool encrypts) or another block's frame (bob's, copied
    under t's name). As on the direct path (tests/pool/g4/test_g4_unservable_skip.py) the late settle reads the
    frame header: ``skipped_unservable``, and the put reports the block dropped (not stored). Before, the late
    path ended ``skipped_exists`` unchecked: PutResult(written=0, skipped=1, dropped=0), a block the caller
    counted stored and every load missed. (A servable copy still ends skipped_exists: the test above.)"""
    from kvbm_backend.pool.g4.pool import G4Pool
    u = urlparse(seaweed.endpoint)
    late = SlowPutProxy(u.hostname, u.port, mode="late", delay_s=4.0, slow_puts=0)
    try:
        p, cfg, keys, blocks = _unsettled_pool(seaweed, s3_prefix, tmp_path, "obstore", late, 1)
        direct = cfg.model_copy(update={"endpoint_url": seaweed.endpoint})
        if theirs == "plaintext":
            with G4Pool(direct.model_copy(update={"encrypt": False}), p.namespace) as other:
                assert other.object_name(keys[0]) == p.object_name(keys[0])
                assert other.put(keys, blocks).result(timeout=HANG_S).written == 1
        else:
            with G4Pool(direct, p.namespace) as other:
                bob = p.namespace.keys([1], tenant="bob")
                assert other.put(bob, blocks).result(timeout=HANG_S).written == 1
                frame = bytes(other.store.get(other.object_name(bob[0])))
                assert other.store.put_if_absent(p.object_name(keys[0]), frame)
        with p:
            res = p.put(keys, blocks).result(timeout=HANG_S)
            st = p.stats()
        assert st["unsettled_puts"] == 1 and st.get("settled_late", 0) == 0, st
        assert (res.written, res.skipped, res.dropped) == (0, 0, 1), (res, st)
        assert st["skipped_unservable"] == 1 and st["skipped_exists"] == 0, st
    finally:
        late.close()


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_g4_pool_close_ends_an_unsettled_put_dropped_at_once(seaweed, s3_prefix, tmp_path, client):
    """A block whose PUT cannot be settled (HEADs keep failing) is in flight until its bound; closing the
    pool ends it then and there (``dropped_unsettled``): close and flush never wait for the settle bound.
    Prometheus: a dropped offload of reason ``unsettled``, and a failed store write."""
    from prometheus_client import CollectorRegistry

    from kvbm_backend.metrics import sample_value
    u = urlparse(seaweed.endpoint)
    proxy = SlowPutProxy(u.hostname, u.port, mode="late", delay_s=4.0, slow_puts=0)
    reg = CollectorRegistry()
    try:
        p, _, keys, blocks = _unsettled_pool(seaweed, s3_prefix, tmp_path, client, proxy, 1, registry=reg)
        proxy.slow_heads = 1000  # never settled while open
        fut = p.put(keys, blocks)
        t0 = time.monotonic()
        while p.stats()["unsettled_put_blocks"] == 0 and time.monotonic() - t0 < HANG_S:
            time.sleep(0.05)
        assert not fut.done() and p.stats()["pending_put_blocks"] == 1
        p.close(timeout=0.1)
        assert fut.done(), "close left the unsettled block in flight"
        res, st = fut.result(), p.stats()
        assert (res.written, res.skipped, res.dropped) == (0, 0, 1), st
        assert st["dropped_unsettled"] == 1 and st["pending_put_blocks"] == 0, st
        assert sample_value(reg, "kvbm_backend_g4_offloads_dropped_total", {"reason": "unsettled"}) == 1
        assert sample_value(reg, "kvbm_object_write_failures_total") == 1
    finally:
        proxy.close()


@pytest.mark.parametrize("via", ["store", "pool"])
def test_a_slow_uplink_is_not_an_outage_obstore_puts_finish_past_timeout_s(seaweed, s3_prefix, tmp_path, via):
    """``g4.timeout_s`` is not an upload's bound: a 64 KiB PUT through a 32 KiB/s uplink takes ~2 s, four times
    ``timeout_s`` (0.5 s), and is written; a pool's offloads are written, none dropped, its breaker closed. obstore's
    whole-request bound for PUTs is ``g4.put_timeout_s`` (default ``max(30, 10 x timeout_s)``). Before, it was
    ``timeout_s``: every attempt timed out mid-upload, nothing landed, the offload was dropped
    (``dropped_unavailable``) and counted a breaker failure (reviewer 2026-12-01: 16 of 24 offloads dropped and the
    breaker open through a 96 KiB/s link where boto3 wrote 24 of 24)."""
    from tests.helpers.g4_writer import namespace, payload
    from tests.helpers.slow_proxy import SlowUploadProxy
    from kvbm_backend.pool.g4.pool import G4Pool
    u = urlparse(seaweed.endpoint)
    proxy = SlowUploadProxy(u.hostname, u.port, rate_bps=32 << 10)
    try:
        if via == "store":
            st = ObstoreS3Store(seaweed.bucket, s3_prefix, endpoint_url=proxy.endpoint, timeout_s=0.5, retries=1)
            assert st.put_timeout_s == 30.0
            assert st.put_if_absent("slow", b"s" * (64 << 10)) is True
            assert bytes(st.get("slow")) == b"s" * (64 << 10)
            st.close()
            return
        ns = namespace()
        bpb = ns.layout.bytes_per_block
        n = max(1, (96 << 10) // bpb)  # ~3 s of upload in all, in blocks of the test layout
        keys = ns.keys(range(1, n + 1), tenant="t")
        blocks = [payload(s, "t", bpb) for s in range(1, n + 1)]
        cfg = G4Config(url=seaweed.url(s3_prefix), endpoint_url=proxy.endpoint, s3_client="obstore", timeout_s=0.5,
                       retries=1, max_inflight=2, keyring={"path": str(tmp_path / "kr.json")})
        with G4Pool(cfg, ns) as p:
            res = p.put(keys, blocks).result(timeout=HANG_S)
            st = p.stats()
            assert (res.written, res.dropped) == (n, 0), st
            assert st["breaker_state"] == "closed" and st.get("dropped_unavailable", 0) == 0, st
    finally:
        proxy.close()


def test_a_slow_downlink_is_not_an_outage_obstore_loads_finish_within_the_load_bound(seaweed, s3_prefix, tmp_path):
    """Each block's GET through a slow downlink takes ~1.5 s (a frame at ``frame / 1.5`` bytes a second per
    connection), over ``timeout_s`` (1 s) and well within the load bound (``timeout_s x (1 + retries)``, 3 s): the
    load gets every block, byte-exact, and the breaker stays closed. obstore's whole-request bound of a GET is now
    ``timeout_s x (2 + retries)`` (past the load bound, which resolves a load first). Before 2026-12-02 it was
    ``timeout_s``: every GET was cut mid-answer, retried from byte 0, cut again, and counted a breaker failure: no
    block loaded, the breaker opened and the worker refused every G4 load and store (reviewer 2026-12-02: 0 of 32
    1 MiB blocks at 8 MB/s, breaker open; boto3, which bounds each socket wait, loaded 32 of 32 at 12 MB/s)."""
    from tests.helpers.g4_writer import namespace, payload
    from tests.helpers.slow_proxy import SlowDownloadProxy
    from kvbm_backend.model.frame import HEADER_BYTES
    from kvbm_backend.pool.g4.pool import G4Pool
    import numpy as np

    ns = namespace()
    bpb = ns.layout.bytes_per_block
    keys = ns.keys(range(1, 5), tenant="t")
    blocks = [payload(s, "t", bpb) for s in range(1, 5)]
    base = dict(url=seaweed.url(s3_prefix), s3_client="obstore", keyring={"path": str(tmp_path / "kr.json")})
    with G4Pool(G4Config(**base, endpoint_url=seaweed.endpoint), ns) as w:
        assert w.put(keys, blocks).result(timeout=HANG_S).written == 4
    u = urlparse(seaweed.endpoint)
    proxy = SlowDownloadProxy(u.hostname, u.port, rate_bps=int((HEADER_BYTES + bpb) / 1.5))
    try:
        cfg = G4Config(**base, endpoint_url=proxy.endpoint, timeout_s=1.0, retries=2, breaker_failures=2)
        with G4Pool(cfg, ns) as p:
            out = [np.zeros(bpb, np.uint8) for _ in keys]
            res = p.get(keys, out).result(timeout=HANG_S)
            st = p.stats()
            assert res.ok == [True] * 4, st
            assert all(np.array_equal(o, b) for o, b in zip(out, blocks))
            assert st["breaker_state"] == "closed" and st.get("miss_unavailable", 0) == 0, st
    finally:
        proxy.close()
