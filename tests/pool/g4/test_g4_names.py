"""Issue 26 item 11: G4 object names are keyed (docs/format.md "G4 names"): a listing of the store
reveals no sequence hash, two tenants or namespaces holding the same prompt share no name, a restarted
worker or another worker with the same keyring finds the blocks, gc and revocation keep working, and
``kvbm-backend g4 migrate`` renames blocks stored under format 1 names (sequence hash in clear).
Item 5 (G4 part): the per-tenant pseudonym/naming cache is bounded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from collections import Counter

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.helpers.g4_writer import namespace, payload
from kvbm_backend.apps.cli import app
from kvbm_backend.config import G4Config
from kvbm_backend.crypto.keyring import Keyring, provider_for
from kvbm_backend.crypto.names import UNKEYED_PSEUDONYM_KEY, derive_name_key
from kvbm_backend.model.hashing import sequence_hashes
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.g4.naming import TenantNamer, legacy_block_name, parse_block_name
from kvbm_backend.pool.g4.pool import TENANT_CACHE_ENTRIES, G4Pool
from kvbm_backend.pool.g4.tenant_names import CACHE_TENANT_CHARS
from tests.helpers.paths import HELPERS
from tests.helpers.g4_target import g4_target
from tests.helpers.pools import G4_TIMEOUT_S

HANG_S = 600.0  # a hang guard, not a bound: waits for results and processes that must come; returns as soon as they do

WRITER = str(HELPERS / "g4_writer.py")
FANOUT = 16


@pytest.fixture(params=["fs", "s3"])
def target(request, tmp_path, s3_prefix):
    return g4_target(request, tmp_path, s3_prefix, timeout_s=G4_TIMEOUT_S, dir_fanout=FANOUT)  # was 5: no bound here


def _put(pool, ns, seqs, tenant):
    bpb = ns.layout.bytes_per_block
    return pool.put(ns.keys(seqs, tenant=tenant), [payload(s, tenant, bpb) for s in seqs]).result(timeout=HANG_S)


def _read(pool, ns, seqs, tenant):
    bpb = ns.layout.bytes_per_block
    out = [np.zeros(bpb, np.uint8) for _ in seqs]
    ok = pool.get(ns.keys(seqs, tenant=tenant), out).result(timeout=HANG_S).ok
    return [bool(o and np.array_equal(b, payload(s, tenant, bpb))) for o, b, s in zip(ok, out, seqs)]


def _cli(*args, code=0):
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == code, r.output
    return r.output


def test_names_reveal_no_sequence_hash_and_tenants_share_none(target, tmp_path):
    ns = namespace()
    other_ns = Namespace("kvbm-test/other-model", ns.layout)
    prompt = np.arange(8 * ns.layout.page_size, dtype=np.uint32) * 7919 % 50_000  # a "guessed" prompt
    seqs = [int(h) for h in sequence_hashes(prompt, ns.layout.page_size)]
    with G4Pool(G4Config(**target), ns) as p, G4Pool(G4Config(**target), other_ns) as q:
        assert _put(p, ns, seqs, "alice").written == 8 and _put(p, ns, seqs, "bob").written == 8
        assert _put(q, other_ns, seqs, "alice").written == 8
        names = [o.name for o in p.store.list("")]
        blocks = [parse_block_name(n) for n in names]
        blocks = [m for m in blocks if m is not None]
        assert len(blocks) == 24 and not any(m["legacy"] for m in blocks)
        # the clear KVBM hash of every stored block appears in no listed name
        for s in seqs:
            assert not any(f"{s:016x}" in n for n in names), s
        # format 1 put seq_hash % fanout in the directory: now it follows the keyed id
        assert any(m["fan"] != f"{s % FANOUT:x}" for m, s in zip(blocks, seqs))
        ids = {}
        for m in blocks:
            ids.setdefault((m["ns"], m["tenant"]), set()).add(m["block_id"])
        a, b = ids[(ns.fingerprint, p.pseudonym("alice").hex())], ids[(ns.fingerprint, p.pseudonym("bob").hex())]
        a2 = ids[(other_ns.fingerprint, p.pseudonym("alice").hex())]
        assert len(a) == len(b) == len(a2) == 8 and not a & b and not a & a2  # same prompt, no shared name
        # someone without the keyring cannot compute a name: neither with a keyring of their own nor with
        # the public unkeyed derivation
        mine = Keyring(tmp_path / "attacker.json", provider_for(tmp_path / "attacker.json"))
        for key in (mine.name_key(p.pseudonym("alice")), derive_name_key(UNKEYED_PSEUDONYM_KEY, p.pseudonym("alice"))):
            guess = TenantNamer(ns.fingerprint, p.pseudonym("alice"), key, FANOUT)
            assert not {guess.block_id(0, s).hex() for s in seqs} & a
        assert p.stats()["names_keyed"] is True
    # a restart in another process (another worker sharing the keyring) finds every block by name
    for tenant in ("alice", "bob"):
        spec = {"mode": "read", "cfg": target, "tenant": tenant, "seqs": seqs}
        out = subprocess.run([sys.executable, WRITER, json.dumps(spec)], capture_output=True, text=True, timeout=HANG_S)
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        assert r["lookup"] == 8 and r["correct"] == [True] * 8
    # revocation (crypto-shred) and gc work on keyed names: every one of bob's blocks goes, alice's stay
    kr = target["keyring"]["path"]
    _cli("keys", "revoke", "--keyring", kr, "--tenant", "bob")
    s3 = ["--endpoint-url", target["endpoint_url"]] if "endpoint_url" in target else []
    res = json.loads(_cli("gc", "--url", target["url"], *s3, "--keyring", kr, "--json"))
    assert res["deleted_by"]["revoked"] == 8 and res["deleted_objects"] == 8
    with G4Pool(G4Config(**target), ns) as p:
        assert _read(p, ns, seqs, "alice") == [True] * 8 and _read(p, ns, seqs, "bob") == [False] * 8
        assert not any(p.pseudonym("bob").hex() in o.name for o in p.store.list(""))
    res = json.loads(_cli("gc", "--url", target["url"], *s3, "--keyring", kr, "--tenant", "alice", "--max-age-s", "0",
                          "--json"))
    assert res["deleted_by"]["age"] == 16  # both namespaces of alice


def test_migrate_renames_format1_names(target):
    """Blocks written under format 1 names (``legacy_object_name``, the old naming function) are misses
    until ``kvbm-backend g4 migrate`` renames them; then every one is read, byte-exact."""
    ns = namespace()
    kr = target["keyring"]["path"]
    seqs = [1000 + i for i in range(9, 15)]  # seq % 16 != seq % 8: a wrong --dir-fanout is detected
    with G4Pool(G4Config(**target), ns) as p:
        assert _put(p, ns, seqs, "alice").written == 6 and _put(p, ns, [2000, 2001], "bob").written == 2
        st = p.store
        for t, ss in (("alice", seqs), ("bob", [2000, 2001])):  # rewrite as the previous format named them
            for s in ss:
                k = ns.key(s, tenant=t)
                st.put(p.legacy_object_name(k), bytes(st.get(p.object_name(k))))
                st.delete(p.object_name(k))
        # an old-named object whose header names another block: never renamed (left for gc)
        first = bytes(st.get(p.legacy_object_name(ns.key(seqs[0], tenant="alice"))))
        st.put(p.legacy_object_name(ns.key(3000, tenant="alice")), first)
        assert sum(1 for o in st.list("") if (parse_block_name(o.name) or {}).get("legacy")) == 9
    _cli("keys", "revoke", "--keyring", kr, "--tenant", "bob")
    with G4Pool(G4Config(**target), ns) as p:
        assert p.lookup_prefix(ns.keys(seqs, tenant="alice")).result(timeout=HANG_S) == 0  # not migrated yet: misses
        assert _read(p, ns, seqs, "alice") == [False] * 6
    s3 = ["--endpoint-url", target["endpoint_url"]] if "endpoint_url" in target else []
    base = ["g4", "migrate", "--url", target["url"], *s3, "--json"]
    out = _cli(*base, "--keyring", kr, "--dir-fanout", "8", code=2)
    assert "--dir-fanout 8" in " ".join(out.split())
    assert "--keyring" in " ".join(_cli(*base, "--dir-fanout", str(FANOUT), code=2).split())  # encrypted frames
    dry = json.loads(_cli(*base, "--keyring", kr, "--dir-fanout", str(FANOUT), "--dry-run"))
    assert dry["migrated"] == 6 and dry["legacy_objects"] == 9
    res = json.loads(_cli(*base, "--keyring", kr, "--dir-fanout", str(FANOUT)))
    assert (res["migrated"], res["skipped_invalid"], res["skipped_revoked"], res["errors"]) == (6, 1, 2, 0)
    with G4Pool(G4Config(**target), ns) as p:
        assert p.lookup_prefix(ns.keys(seqs, tenant="alice")).result(timeout=HANG_S) == 6
        assert _read(p, ns, seqs, "alice") == [True] * 6
        assert p.stats().get("corrupt", 0) == 0
    again = json.loads(_cli(*base, "--keyring", kr, "--dir-fanout", str(FANOUT)))
    assert again["legacy_objects"] == 3 and again["migrated"] == 0  # repeatable: only what it must not rename
    # gc still reclaims the revoked tenant's old-named blocks
    res = json.loads(_cli("gc", "--url", target["url"], *s3, "--keyring", kr, "--json"))
    assert res["deleted_by"]["revoked"] == 2


def test_migrate_leaves_a_re_created_tenants_shredded_generation_for_gc(tmp_path):
    """A tenant revoked, then re-created by ``keys create`` (same pseudonym, new key id), while format 1 blocks
    of its old generation exist: migrate must not rename them (``skipped_revoked``). Renamed, they took the very
    names the new generation writes, with a fresh mtime that hid them from gc's revoked rule: its offloads lost
    every create-exclusive PUT and its loads missed. Now gc reclaims them and the new generation is served."""
    ns = namespace()
    kp = str(tmp_path / "keys" / "keyring.json")
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", keyring={"path": kp}, timeout_s=60.0, dir_fanout=FANOUT)
    seqs = [5000 + i for i in range(6)]
    with G4Pool(cfg, ns) as p:
        assert _put(p, ns, seqs, "alice").written == 6
        for s in seqs:  # as the previous format named them
            k = ns.key(s, tenant="alice")
            p.store.put(p.legacy_object_name(k), bytes(p.store.get(p.object_name(k))))
            p.store.delete(p.object_name(k))
    _cli("keys", "revoke", "--keyring", kp, "--tenant", "alice")
    revoked = json.loads(open(kp).read())["revoked"]
    for root, _dirs, files in os.walk(tmp_path / "store"):  # the old generation predates the revocation on any clock
        for f in files:
            os.utime(os.path.join(root, f), (1_000_000, 1_000_000))
    _cli("keys", "create", "--keyring", kp, "--tenant", "alice")
    base = ["g4", "migrate", "--url", cfg.url, "--keyring", kp, "--dir-fanout", str(FANOUT), "--json"]
    res = json.loads(_cli(*base))
    assert (res["migrated"], res["skipped_revoked"], res["errors"]) == (0, 6, 0), (res, revoked)
    gc = json.loads(_cli("gc", "--url", cfg.url, "--keyring", kp, "--json"))
    assert gc["deleted_by"]["revoked"] == 6, gc
    with G4Pool(cfg, ns) as p:
        assert _put(p, ns, seqs, "alice").written == 6
        assert _read(p, ns, seqs, "alice") == [True] * 6


def test_unkeyed_pool_names_hide_nothing_from_who_knows_the_tenant(tmp_path):
    """No keyring (unencrypted pool): names are still not the clear hash, but their key is derived from a
    public constant: anyone knowing the tenant id computes them (docs/format.md says so). Migrating such a
    pool needs no keyring, only ``--unkeyed`` to say so."""
    ns = namespace()
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", encrypt=False, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    with G4Pool(cfg, ns) as p:
        assert p.stats()["names_keyed"] is False
        assert _put(p, ns, [5, 6], "t").written == 2
        ps = p.pseudonym("t")
        public = TenantNamer(ns.fingerprint, ps, derive_name_key(UNKEYED_PSEUDONYM_KEY, ps), FANOUT)
        assert p.object_name(ns.key(5, tenant="t")) == public.name(0, 5)
        k = ns.key(6, tenant="t")
        p.store.put(p.legacy_object_name(k), bytes(p.store.get(p.object_name(k))))
        p.store.delete(p.object_name(k))
    out = _cli("g4", "migrate", "--url", cfg.url, "--dir-fanout", str(FANOUT), "--json", code=2)
    assert "--unkeyed" in out  # the operator says the pool has no keyring: it cannot be told from the names
    res = json.loads(_cli("g4", "migrate", "--url", cfg.url, "--unkeyed", "--dir-fanout", str(FANOUT), "--json"))
    assert res["migrated"] == 1
    with G4Pool(cfg, ns) as p:
        assert _read(p, ns, [5, 6], "t") == [True, True]


def test_tenant_cache_stays_at_its_bound_with_a_million_tenants(tmp_path):
    """Item 5: 10^6 distinct tenants (cache_salt values) through the naming path and lookups on an empty
    pool: the pool keeps at most TENANT_CACHE_ENTRIES of them (the old dict kept every one: 200k tenants
    held +75 MB), and a tenant evicted and named again gets the same name."""
    ns = namespace()
    with G4Pool(G4Config(url=f"mem://names-{tmp_path.name}", keyring={"path": str(tmp_path / "kr.json")}), ns) as p:
        first = p.object_name(ns.key(42, tenant="t0"))
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(100_000):
            p.names.tag(f"t{i}")
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert grown < 8 * 2 ** 20, f"{grown} bytes kept for 100k tenants"
        for i in range(100_000, 1_000_000):
            p.names.tag(f"t{i}")
        assert p.tenant_cache_size() == TENANT_CACHE_ENTRIES == p.stats()["tenant_cache_entries"]
        looked = [p.lookup_prefix(ns.keys([7], tenant=f"flood{i}")) for i in range(2000)]
        assert all(f.result(timeout=HANG_S) == 0 for f in looked)
        assert p.tenant_cache_size() <= TENANT_CACHE_ENTRIES
        assert p.object_name(ns.key(42, tenant="t0")) == first



def test_tenant_cache_keeps_no_long_tenant_ids(tmp_path):
    """A tenant id is a client's cache_salt, of any length: the pool's tenant cache (names, pseudonyms) keeps
    none over CACHE_TENANT_CHARS characters, so salts of 100 KB looked up and offloaded through a real file://
    pool with a keyring hold no memory once done (before 2026-11-30 each stayed in the LRU: 4096 salts of 1 MB
    were 4 GB per worker). A long tenant is named the same every time, and its blocks still round-trip."""
    ns = namespace()
    cfg = G4Config(url=f"file://{tmp_path / 'g4'}", keyring={"path": str(tmp_path / "kr.json")}, timeout_s=G4_TIMEOUT_S)
    long_t = "L" * 100_000  # over the keyring's bound for implicit creation: created explicitly
    Keyring(tmp_path / "kr.json", provider_for(tmp_path / "kr.json")).create(long_t)
    with G4Pool(cfg, ns) as p:
        assert p.object_name(ns.key(1, tenant=long_t)) == p.object_name(ns.key(1, tenant=long_t))
        _put(p, ns, [1], long_t)
        assert _read(p, ns, [1], long_t) == [True]
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        looked = [p.lookup_prefix(ns.keys([7], tenant=f"{i}" + "x" * 100_000)) for i in range(40)]
        assert all(f.result(timeout=HANG_S) == 0 for f in looked)
        del looked
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert grown < 1_000_000, f"{grown} bytes kept after 40 lookups of 100 KB tenant ids"
        assert p.tenant_cache_size() == 0 and len(long_t) > CACHE_TENANT_CHARS
        _put(p, ns, [2], "short")
        assert p.tenant_cache_size() == 1


def test_one_tenants_blocks_spread_evenly_over_dir_fanout_prefixes():
    """docs/format.md "Key layout and S3 request rates": everything before the fan-out directory is fixed for
    one (namespace, tenant, rank), and the directory is the first component that varies, taking all
    ``dir_fanout`` values in even shares (S3 scales per prefix: ~5,500 GET/s each). Even for sequence hashes
    that share their low bits (all multiples of 256, which format 1's ``seq_hash % dir_fanout`` put in ONE
    directory): the directory follows the keyed HMAC id, not the hash."""
    ns_fp = "0123456789abcdef"
    namer = TenantNamer(ns_fp, os.urandom(16), os.urandom(32), 256)
    n = 256 * 100
    names = [namer.name(0, seq * 256) for seq in range(1, n + 1)]
    fixed = {nm.rsplit("/", 2)[0] for nm in names}
    assert fixed == {f"{ns_fp}/{namer.pseudonym_hex}/0"}  # one fixed prefix up to the rank
    dirs = Counter(nm.rsplit("/", 2)[1] for nm in names)
    assert len(dirs) == 256  # dir_fanout prefixes
    assert 50 <= min(dirs.values()) and max(dirs.values()) <= 150, dirs.most_common(3)  # 100 each, +-5 sigma
    assert len({legacy_block_name(ns_fp, namer.pseudonym_hex, 0, seq * 256, 256).rsplit("/", 2)[1]
                for seq in range(1, 1000)}) == 1  # what the keyed id avoids


def test_expected_identity_is_the_expected_headers_tag_and_aad(tmp_path):
    """A load binds ``names.expected_identity(key)`` (built without a FrameHeader, per block) as the tenant
    tag it accepts and the AEAD additional data it opens with: byte for byte the expected header's
    ``tenant_tag`` and ``identity_bytes()`` (what the writer sealed with), for each tenant, rank and hash."""
    ns = namespace()
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", encrypt=False, dir_fanout=FANOUT)
    with G4Pool(cfg, ns) as p:
        for k in (ns.key(5, tenant="t"), ns.key(2**64 - 1, tenant="u", rank=0), ns.key(7, tenant="t")):
            h = p.names.expected_header(k)
            assert p.names.expected_identity(k) == (h.tenant_tag, h.identity_bytes())
        assert p.names.expected_identity(ns.key(5, tenant="t")) != p.names.expected_identity(ns.key(5, tenant="u"))
