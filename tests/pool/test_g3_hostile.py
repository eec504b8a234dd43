"""G3 under hostile input (issue 26): odd tenant ids, duplicate and foreign-shaped keys, read errors,
a deleted lock file, special files under slab names, corrupt blocks and the caller's buffers, and
memory per distinct tenant. Real files and processes throughout; no mocks of the OS."""
from __future__ import annotations

import numpy as np
import xxhash

from kvbm_backend.integrations.vllm.g3_mirror import G3Mirror
from kvbm_backend.integrations.vllm.metadata import KvbmWorkerMeta, mirror_id
from kvbm_backend.model.namespace import tenant_bytes, tenant_tag
from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload

BB = LAYOUT.bytes_per_block
ODD_TENANTS = ["\udcff", "a\ud800b", "\udfff\ud800", "nul\x00in\x00it", "\x00", "é-ü-中", "x" * 1_000_000]


def _put(pool, keys):
    return pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=60)


def _get(pool, keys, fill: int = 0):
    """``(ok, out)``; every served block is checked against ``payload``."""
    out = [np.full(BB, fill, np.uint8) for _ in keys]
    r = pool.get(keys, out).result(timeout=60)
    for k, o, ok in zip(keys, out, r.ok):
        if ok:
            assert np.array_equal(o, payload(k.seq_hash)), k
    return r.ok, out


# ---- item 10: any str is a tenant ----------------------------------------------------------------
def test_tenant_bytes_are_utf8_for_valid_strings():
    for t in ["", "alice", "é-ü-中", "nul\x00", "😀"]:
        assert tenant_bytes(t) == t.encode()
        assert tenant_tag(t) == xxhash.xxh3_128_digest(t.encode())  # stored tags unchanged
    assert tenant_bytes("\udcff") == b"\xed\xb3\xbf"  # surrogatepass: the 3-byte form
    assert tenant_tag("\udcff") != tenant_tag("\udcfe")


def test_odd_tenants_put_lookup_get_and_restart(tmp_path):
    with open_pool(tmp_path) as pool:
        for i, t in enumerate(ODD_TENANTS):
            keys = NS.keys(range(i * 10 + 1, i * 10 + 5), tenant=t)
            assert _put(pool, keys).written == 4
            assert pool.lookup_prefix(keys).result() == 4
            assert pool.lookup_prefix(NS.run([k.seq_hash for k in keys], tenant=t)).result() == 4
            assert all(_get(pool, keys)[0])
    with open_pool(tmp_path) as pool:
        for i, t in enumerate(ODD_TENANTS):
            keys = NS.keys(range(i * 10 + 1, i * 10 + 5), tenant=t)
            assert pool.lookup_prefix(NS.run([k.seq_hash for k in keys], tenant=t)).result() == 4
            assert all(_get(pool, keys)[0]), t[:20]


def test_mirror_lookup_with_odd_tenants_never_raises():
    class _Ns:
        fingerprint = NS.fingerprint

    m = G3Mirror(_Ns())
    for i, t in enumerate(ODD_TENANTS):
        keys = NS.keys(range(i * 10 + 1, i * 10 + 5), tenant=t)
        assert m.lookup_prefix(NS.run([k.seq_hash for k in keys], tenant=t)).result() == 0
        m.apply(KvbmWorkerMeta(added=[mirror_id(k) for k in keys]))
        assert m.lookup_prefix(NS.run([k.seq_hash for k in keys], tenant=t)).result() == 4
        assert m.lookup_prefix(keys).result() == 4
