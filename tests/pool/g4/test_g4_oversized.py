"""An object far larger than a frame under a block name (planted by anyone with write access to the bucket, or
served by a misbehaving gateway): a G4 load on S3 fetches at most one frame and a byte more (a ranged GET, either
client), counts the object ``corrupt_length``, and deletes it only once a HEAD says the store holds an object
longer than a frame (then ``If-Match`` its ETag). Before 2026-12-01 the load downloaded the whole object (and
MD5'd it to confirm): a 160 MiB object cost each load 160 MiB of memory, times ``g4.max_inflight``, and one too
large to download within ``timeout_s`` was never deleted. Real SeaweedFS, a real loopback proxy counting the
bytes sent to the client (tests/helpers/counting_proxy.py), a plain boto3 client planting the object."""
from __future__ import annotations

import os

import boto3
import numpy as np
import pytest

from tests.helpers.counting_proxy import CountingProxy
from tests.helpers.g4_writer import namespace, payload
from tests.helpers.lying_proxy import LyingProxy
from kvbm_backend.config import G4Config
from kvbm_backend.model.frame import HEADER_BYTES
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.pool.g4.s3_store import S3Store
from kvbm_backend.pool.g4.store import StoreUnavailable

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
NS = namespace()
BPB = NS.layout.bytes_per_block
FRAME = HEADER_BYTES + BPB  # the length of every valid block object
BIG = 8 << 20  # the planted object: 8 MiB, over 200 frames
HEADERS = 16 << 10  # room for the HTTP headers of the load's answers (GETs, the HEAD, the DELETE): < 1 KiB each


def _pool(tmp_path, url, endpoint, client) -> G4Pool:
    return G4Pool(G4Config(url=url, endpoint_url=endpoint, s3_client=client, timeout_s=60.0, retries=0,
                           keyring={"path": str(tmp_path / "keys" / "keyring.json")}, dir_fanout=16), NS)


def _host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    return host, int(port)


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_an_oversized_object_costs_a_load_one_frame_and_is_deleted(seaweed, s3_prefix, tmp_path, client):
    proxy = CountingProxy(*_host_port(seaweed.endpoint))
    plain = boto3.client("s3", endpoint_url=seaweed.endpoint, region_name="us-east-1")
    keys = NS.keys([1, 2], tenant="t")
    try:
        with _pool(tmp_path, seaweed.url(s3_prefix), proxy.endpoint, client) as p:
            assert p.put(keys, [payload(k.seq_hash, "t", BPB) for k in keys]).result(HANG_S).written == 2
            key = f"{s3_prefix}/{p.object_name(keys[0])}"
            frame = plain.get_object(Bucket=seaweed.bucket, Key=key)["Body"].read()
            assert len(frame) == FRAME
            # a valid frame followed by 8 MiB: the header checks pass, the length does not
            plain.put_object(Bucket=seaweed.bucket, Key=key, Body=frame + os.urandom(BIG))
            proxy.take()
            out = [np.full(BPB, 0xEE, np.uint8) for _ in keys]
            assert p.get(keys, out).result(HANG_S).ok == [False, True]
            fetched = proxy.take()
            assert (out[0] == 0xEE).all() and np.array_equal(out[1], payload(keys[1].seq_hash, "t", BPB))
            st = p.stats()
            assert (st["corrupt_length"], st["deleted_corrupt"], st["miss_corrupt"]) == (1, 1, 1), st
            # the good block's frame, one frame and a byte of the big one, headers: never the 8 MiB
            assert fetched <= 2 * FRAME + 1 + HEADERS, f"{fetched} bytes sent to the client for a load of 2 frames"
            with pytest.raises(plain.exceptions.ClientError):  # deleted from the store itself
                plain.head_object(Bucket=seaweed.bucket, Key=key)
            # the name is free again: the next offload publishes a good copy, served
            assert p.put(keys[:1], [payload(keys[0].seq_hash, "t", BPB)]).result(HANG_S).written == 1
            out = [np.zeros(BPB, np.uint8)]
            assert p.get(keys[:1], out).result(HANG_S).ok == [True]
            assert np.array_equal(out[0], payload(keys[0].seq_hash, "t", BPB))
    finally:
        proxy.close()


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_a_gateway_answering_an_oversized_body_never_gets_the_good_object_deleted(seaweed, s3_prefix, tmp_path,
                                                                                   client):
    """The object in the store is a good frame; a proxy answers its GET with a body far larger (another object's
    bytes). A miss, never served, and the good object stays: a HEAD says the store's object is a frame long."""
    proxy = LyingProxy(*_host_port(seaweed.endpoint))
    keys = NS.keys([3], tenant="t")
    try:
        with _pool(tmp_path, seaweed.url(s3_prefix), seaweed.endpoint, client) as good:
            assert good.put(keys, [payload(3, "t", BPB)]).result(HANG_S).written == 1
            name = good.object_name(keys[0])
            stored = bytes(good.store.get(name))
            proxy.mode, proxy.other_body = "other", stored + os.urandom(BIG)
            with _pool(tmp_path, seaweed.url(s3_prefix), proxy.endpoint, client) as liar:
                out = [np.full(BPB, 0xEE, np.uint8)]
                assert liar.get(keys, out).result(HANG_S).ok == [False]
                assert (out[0] == 0xEE).all() and proxy.lied >= 1
                st = liar.stats()
                assert st.get("deleted_corrupt", 0) == 0 and st.get("corrupt", 0) == 0, st
            assert bytes(good.store.get(name)) == stored  # kept, byte for byte, and served by a good path
            out = [np.zeros(BPB, np.uint8)]
            assert good.get(keys, out).result(HANG_S).ok == [True]
    finally:
        proxy.close()


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_a_gateway_lying_about_lengths_only_never_gets_the_good_object_deleted(seaweed, s3_prefix, tmp_path,
                                                                               client):
    """The object in the store is a good frame; a gateway adds one byte to every object GET's body and to every
    HEAD's ``Content-Length`` and leaves the ETag alone. The load's ranged GET gets a frame and a byte (too long:
    ``corrupt_length``) and the HEAD says the object is longer than a frame, but the ETag is the MD5 of the frame's
    worth of bytes read: the store holds exactly one frame. A miss, and the object stays, served by an honest path.
    Before 2026-12-02 the HEAD's size alone was the proof and the delete (``If-Match`` the true ETag) went through
    at the real server: every good block a worker behind such a gateway loaded was deleted (reviewer 2026-12-02)."""
    proxy = LyingProxy(*_host_port(seaweed.endpoint))
    keys = NS.keys([4], tenant="t")
    try:
        with _pool(tmp_path, seaweed.url(s3_prefix), seaweed.endpoint, client) as good:
            assert good.put(keys, [payload(4, "t", BPB)]).result(HANG_S).written == 1
            name = good.object_name(keys[0])
            stored = bytes(good.store.get(name))
            proxy.pad_lengths = True
            with _pool(tmp_path, seaweed.url(s3_prefix), proxy.endpoint, client) as liar:
                out = [np.full(BPB, 0xEE, np.uint8)]
                assert liar.get(keys, out).result(HANG_S).ok == [False]
                assert (out[0] == 0xEE).all() and proxy.padded >= 2  # the GET and the HEAD
                st = liar.stats()
                assert st.get("deleted_corrupt", 0) == 0, st
                assert st.get("unconfirmed_length") == 1 and st.get("miss_unconfirmed_corrupt") == 1, st
            assert bytes(good.store.get(name)) == stored  # kept, byte for byte, and served by a good path
            out = [np.zeros(BPB, np.uint8)]
            assert good.get(keys, out).result(HANG_S).ok == [True]
            assert np.array_equal(out[0], payload(4, "t", BPB))
    finally:
        proxy.close()


@pytest.mark.parametrize("where", ["fs", "s3"])
def test_stat_names_the_object_as_a_listing_does(where, tmp_path, request):
    """``ObjectStore.stat`` (what proves an object too long before it is deleted): size and the version
    ``delete_if_listed`` deletes only while the name still holds it, as the store's listing gives them."""
    if where == "fs":
        st = FsStore(tmp_path / "store")
    else:
        sw = request.getfixturevalue("seaweed")
        st = S3Store(sw.bucket, request.getfixturevalue("s3_prefix"), endpoint_url=sw.endpoint)
    try:
        st.put("a/b", b"x" * 5000)
        info, = list(st.list("a/"))
        got = st.stat("a/b")
        assert got is not None and (got.name, got.size, got.version) == ("a/b", 5000, info.version)
        assert info.version is not None and st.stat("a/none") is None and st.head("a/b") == 5000
        st.put("a/b", b"y" * 5000)  # replaced (same size): the stat taken before no longer names what it holds
        assert st.delete_if_listed(got) is False and st.head("a/b") == 5000
        now = st.stat("a/b")
        assert now is not None and st.delete_if_listed(now) is True and st.head("a/b") is None
    finally:
        st.close()


@pytest.mark.parametrize("client", ["obstore", "boto3"])
def test_a_gateway_that_ignores_range_never_hands_over_more_than_asked(seaweed, s3_prefix, client):
    """A gateway that ignores the ``Range`` header answers a ranged GET ``200`` with the whole object (the proxy
    passes the signed request on unchanged and swaps the server's ``206`` for the whole object: ``ranges_ignored``
    counts it): boto3 reads only the bytes asked for and drops the connection (before 2026-12-01 it read the whole
    body), obstore refuses the answer (an OSError naming the cause: a miss; before 2026-12-02 a StoreUnavailable,
    retried and counted towards the breaker). Never more than asked for, either way."""
    from kvbm_backend.pool.g4.factory import open_store
    proxy = LyingProxy(*_host_port(seaweed.endpoint))
    url = seaweed.url(s3_prefix)
    st = open_store(url, G4Config(url=url, endpoint_url=proxy.endpoint, s3_client=client, timeout_s=60.0))
    data = os.urandom(1 << 20)
    try:
        st.put("big", data)
        proxy.ignore_range = True
        if client == "boto3":
            assert bytes(st.get("big", 0, FRAME + 1)) == data[:FRAME + 1]
        else:
            with pytest.raises(OSError) as ei:
                st.get("big", 0, FRAME + 1)
            assert not isinstance(ei.value, StoreUnavailable) and "ignored Range" in str(ei.value), repr(ei.value)
        assert proxy.ranges_ignored >= 1  # the server took the request (signature intact) and the gateway lied
        proxy.ignore_range = False
        assert bytes(st.get("big", 0, FRAME + 1)) == data[:FRAME + 1] and bytes(st.get("big")) == data
    finally:
        st.close()
        proxy.close()


def test_an_obstore_pool_behind_a_gateway_that_ignores_range_keeps_storing_and_names_the_cause(seaweed, s3_prefix,
                                                                                               tmp_path, caplog):
    """An obstore G4 pool whose endpoint is a gateway ignoring ``Range`` (every load is a ranged GET): each load is
    a miss (``miss_error``) and the log names the cause; the breaker stays closed, so stores keep being written and
    are served once the gateway honours Range again. Before 2026-12-02 the refused answer was taken for an outage:
    each load retried and counted a breaker failure, the breaker opened (``breaker_failures`` 2 here) and the worker
    refused every G4 load and store (``dropped_breaker``) for ``breaker_reset_s``."""
    import logging

    proxy = LyingProxy(*_host_port(seaweed.endpoint))
    url = seaweed.url(s3_prefix)
    pool = G4Pool(G4Config(url=url, endpoint_url=proxy.endpoint, s3_client="obstore", timeout_s=60.0, retries=1,
                           breaker_failures=2, breaker_reset_s=3600.0,
                           keyring={"path": str(tmp_path / "keys" / "keyring.json")}, dir_fanout=16), NS)
    try:
        keys = NS.keys([1, 2, 3, 4], tenant="t")
        blocks = [payload(s, "t", BPB) for s in (1, 2, 3, 4)]
        assert pool.put(keys[:2], blocks[:2]).result(timeout=HANG_S).written == 2
        proxy.ignore_range = True
        out = [np.zeros(BPB, np.uint8) for _ in range(2)]
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                assert pool.get(keys[:2], out).result(timeout=HANG_S).ok == [False, False]
        st = pool.stats()
        assert st.get("miss_error", 0) == 6 and st.get("miss_unavailable", 0) == 0, st
        assert pool.breaker.state == "closed", st
        assert "ignored Range" in caplog.text
        assert pool.put(keys[2:], blocks[2:]).result(timeout=HANG_S).written == 2  # stores go on
        proxy.ignore_range = False
        out = [np.zeros(BPB, np.uint8) for _ in range(4)]
        assert pool.get(keys, out).result(timeout=HANG_S).ok == [True] * 4
        assert all(np.array_equal(o, b) for o, b in zip(out, blocks))
    finally:
        pool.close()
        proxy.close()
