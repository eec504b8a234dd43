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
from tests.helpers.paths import REPO

HANG_S = 600.0  # a hang guard, not a bound: waits for what must come (results, a process, a thread's open); returns as soon as it does

BB = LAYOUT.bytes_per_block
ODD_TENANTS = ["\udcff", "a\ud800b", "\udfff\ud800", "nul\x00in\x00it", "\x00", "é-ü-中", "x" * 1_000_000]


def _put(pool, keys):
    return pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)


def _get(pool, keys, fill: int = 0):
    """``(ok, out)``; every served block is checked against ``payload``."""
    out = [np.full(BB, fill, np.uint8) for _ in keys]
    r = pool.get(keys, out).result(timeout=HANG_S)
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


# ---- item 1: duplicate keys in one get -----------------------------------------------------------
def test_duplicate_keys_in_a_get_are_served_and_nothing_is_dropped(tmp_path):
    with open_pool(tmp_path) as pool:
        keys = NS.keys(range(1, 24), tenant="t")
        assert _put(pool, keys).written == 23
        absent = NS.key(999, tenant="t")
        batch = keys + [keys[3], keys[0], keys[0], absent, absent]
        ok, out = _get(pool, batch)
        assert ok == [True] * 26 + [False, False]
        assert np.array_equal(out[23], payload(keys[3].seq_hash))
        assert all(_get(pool, keys)[0])  # still there
        st = pool.stats()
        assert st["corrupt"] == 0 and st["deleted"] == 0 and st["blocks"] == 23
        assert pool.slot_accounting()["leaked"] == 0


# ---- item 2: keys() after a warm restart read; a wrongly named key drops nothing ------------------
def test_keys_after_restart_are_readable_and_bad_keys_drop_nothing(tmp_path):
    from kvbm_backend.model.namespace import BlockKey
    seqs = list(range(1, 31)) + [(1 << 64) - 1, (1 << 64) - 2]
    with open_pool(tmp_path) as pool:
        for t in ("alice", "bob"):
            assert _put(pool, NS.keys(seqs, tenant=t)).written == len(seqs)
    with open_pool(tmp_path) as pool:
        listed = pool.keys()
        assert len(listed) == 2 * len(seqs)
        assert all(_get(pool, listed)[0])  # what the pool hands out, it reads
        assert pool.lookup_prefix(listed[:10]).result() == 10
        fp = NS.fingerprint
        wrong = [BlockKey(fp, "alice", 0, -1), BlockKey(fp, "alice", 0, -2), BlockKey(fp, "alice", 0, 1 << 64),
                 BlockKey(fp, "alice", -1, 5), BlockKey(fp, "alice", 1 << 32, 5), BlockKey(fp, b"alice", 0, 5),
                 BlockKey(fp, "alice", 0, 5.0), BlockKey(fp, listed[0].tenant, 0, listed[0].seq_hash)]
        ok, _ = _get(pool, wrong)
        assert not any(ok)
        for t in ("alice", "bob"):
            assert all(_get(pool, NS.keys(seqs, tenant=t))[0])
        st = pool.stats()
        assert st["corrupt"] == 0 and st["blocks"] == 2 * len(seqs), st["misses_by_reason"]


# ---- item 3: a read error is a miss that keeps the slot ------------------------------------------
def test_read_error_keeps_the_slots(tmp_path):
    import os
    with open_pool(tmp_path) as pool:
        keys = NS.keys(range(1, 41), tenant="t")
        assert _put(pool, keys).written == 40
        fds = [f.fd for f in pool.slabs.files]
        saved = [os.dup(fd) for fd in fds]
        bad = os.open(os.devnull, os.O_WRONLY)  # pread on it fails with EBADF: a real read error
        try:
            for fd in fds:
                os.dup2(bad, fd)
            ok, out = _get(pool, keys, fill=0x5A)
            assert not any(ok)
            assert all((o == 0x5A).all() for o in out)  # a miss leaves the buffer untouched
        finally:
            for fd, s in zip(fds, saved):
                os.dup2(s, fd)
                os.close(s)
            os.close(bad)
        st = pool.stats()
        assert st["corrupt"] == 0 and st["misses_by_reason"].get("io_error") == 40
        assert all(_get(pool, keys)[0])  # every slot kept and readable again


# ---- item 14: a miss leaves the caller's buffer untouched, whatever the block size ------------------
def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_corrupt_block_leaves_the_output_buffer_untouched(tmp_path):
    import pytest  # noqa: F401
    from kvbm_backend.model.layout import KvLayout
    from kvbm_backend.model.namespace import Namespace
    from kvbm_backend.model import frame
    from kvbm_backend.memory import aligned_empty
    big = Namespace(model="test/g3-big", layout=KvLayout(num_layers=4, outer_dim=2, page_size=16, inner_dim=1024,
                                                          dtype="bfloat16"))  # 256 KiB blocks
    for ns, sub in ((big, "big"), (NS, "small")):
        bb = ns.layout.bytes_per_block
        sb = frame.slot_bytes(bb)
        rng = np.random.default_rng(1)
        with open_pool(tmp_path / sub, ns=ns, capacity_gb=0.1) as pool:
            for r, aligned in enumerate((True, False)):  # aligned: the zero-copy O_DIRECT shape of old
                keys = ns.keys(range(100 * r + 1, 100 * r + 9))
                blocks = [rng.integers(0, 256, bb, dtype=np.uint8) for _ in keys]
                assert pool.put(keys, blocks).result(timeout=HANG_S).written == 8
                for j in (2, 5):  # a payload byte, and a header byte
                    fi, si = pool.index.get(keys[j])
                    _flip(pool.slabs.by_index[fi].path, si * sb + (frame.HEADER_BYTES + 1000 if j == 2 else 40))
                out = []
                for _ in keys:
                    b = aligned_empty(bb + 1)[1:] if not aligned else aligned_empty(bb)
                    b[:] = 0xA5
                    out.append(b)
                ok = pool.get(keys, out).result(timeout=HANG_S).ok
                assert ok == [True, True, False, True, True, False, True, True], (sub, ok)
                for j in range(8):
                    if ok[j]:
                        assert np.array_equal(out[j], blocks[j])
                    else:
                        assert (out[j] == 0xA5).all(), (sub, j, aligned)  # byte-identical sentinel
                assert pool.stats()["corrupt"] == 2 * (r + 1)  # proven bad on disk: dropped


# ---- item 4: deleting the lock file does not let a second process in ------------------------------
def test_lock_file_deleted_second_process_is_refused(tmp_path):
    import os
    import subprocess
    import sys

    from kvbm_backend.pool.g3.slabs import LOCK_NAME
    code = ("import sys\n"
            "from tests.helpers.crash_writer import open_pool\n"
            "from kvbm_backend.pool.g3 import G3LockedError\n"
            "try:\n    p = open_pool(%r)\nexcept G3LockedError as e:\n    print('REFUSED', e); sys.exit(3)\n"
            "keys = p.keys()\np.delete(keys).result()\np.close()\nprint('OPENED', len(keys))\n") % (str(tmp_path),)
    root = str(REPO)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    with open_pool(tmp_path) as pool:
        keys = NS.keys(range(1, 201), tenant="t")
        assert _put(pool, keys).written == 200
        os.unlink(tmp_path / LOCK_NAME)
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S, env=env)
        assert p.returncode == 3, p.stdout + p.stderr
        line = p.stdout.strip()
        assert "\n" not in line and str(tmp_path) in line and "in use by another pool" in line
        assert all(_get(pool, keys)[0])  # every acknowledged block still there
    with open_pool(tmp_path) as pool:
        assert all(_get(pool, keys)[0])


# ---- item 13: a FIFO or other special file under a slab name -------------------------------------
def test_special_file_in_place_of_a_slab_is_a_one_line_error(tmp_path):
    import os
    import socket
    import threading


    from kvbm_backend.pool.g3.slabs import G3PathError
    with open_pool(tmp_path) as pool:
        assert _put(pool, NS.keys(range(1, 5))).written == 4
    name = tmp_path / f"g3-{NS.fingerprint}-1.slab"
    makers = {"a FIFO": lambda: os.mkfifo(name, 0o600),
              "a socket": lambda: socket.socket(socket.AF_UNIX).bind(str(name))}
    for what, make in makers.items():
        os.unlink(name)
        make()
        for od in ("on", "off", "auto"):
            res: list = []
            t = threading.Thread(target=lambda res=res, od=od: res.append(_try_open(tmp_path, od)), daemon=True)
            t.start()
            t.join(HANG_S)
            assert res, f"opening a pool with {what} under a slab name blocked"  # never blocks on a FIFO
            e = res[0]
            assert isinstance(e, G3PathError), repr(e)
            msg = str(e)
            assert "\n" not in msg and str(name) in msg and what in msg and "not a regular file" in msg


def _try_open(path, od):
    try:
        open_pool(path, o_direct=od).close()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return e
    return None


# ---- item 5: index memory per distinct tenant is bounded by the live ones -------------------------
def test_index_owners_stay_bounded_over_a_million_tenants():
    from kvbm_backend.model.namespace import BlockKey
    from kvbm_backend.pool.g3.compact_index import OWNER_SLACK, CompactLruIndex
    ix = CompactLruIndex()
    live_cap = 1626
    put, ev = ix.put, ix.evict
    peak = 0
    for i in range(1_000_000):  # a put per distinct tenant; LRU eviction keeps ~live_cap blocks
        put(BlockKey("ns", str(i), 0, i), (0, i))
        if not i & 1023:
            ev(len(ix) - live_cap)
            peak = max(peak, *ix._owners.sizes().values())  # ids handed out, interned pairs, tenant strings
    bound = 2 * (live_cap + 1024) + 2 * OWNER_SLACK
    assert peak < bound, (peak, bound)  # the old index kept one owner per tenant ever seen: 10**6
    for i in range(1_000_000 - len(ix), 1_000_000):  # live keys still found after owner ids were reused
        assert BlockKey("ns", str(i), 0, i) in ix
    assert BlockKey("ns", "5", 0, 5) not in ix and ix.get(BlockKey("ns", "999999", 0, 999999)) == (0, 999999)
