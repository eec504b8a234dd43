"""``kvbm-backend g4 migrate`` deletes a format 1 object only once the bytes it published under the keyed name
verified (review 2026-11-30): before, it checked the frame header alone, so a read that came back damaged (an S3
endpoint or proxy answering 200 with a short body, the header intact) was published under the keyed name and the
good source deleted: the block was gone from the store. Real SeaweedFS behind a real loopback proxy; real file
stores."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from kvbm_backend.apps.cli import app
from kvbm_backend.config import G4Config
from kvbm_backend.model.frame import HEADER_BYTES
from kvbm_backend.pool.g4.naming import parse_block_name
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from tests.helpers.pools import G4_TIMEOUT_S
from tests.helpers.lying_proxy import LyingProxy

FANOUT = 16


def _cli(*args):
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.output


def _to_legacy(p, ns, seqs, tenant) -> dict[str, bytes]:
    """Move ``seqs``' objects to their format 1 names; ``{legacy name: bytes}``."""
    out = {}
    for s in seqs:
        k = ns.key(s, tenant=tenant)
        data = bytes(p.store.get(p.object_name(k)))
        p.store.put(p.legacy_object_name(k), data)
        p.store.delete(p.object_name(k))
        out[p.legacy_object_name(k)] = data
    return out


def _legacy(p) -> int:
    return sum(1 for o in p.store.list("") if (parse_block_name(o.name) or {}).get("legacy"))


def test_migrate_through_a_proxy_cutting_bodies_short_keeps_the_source(seaweed, s3_prefix, tmp_path):
    """A proxy answering whole-object GETs with the first third of the body (Content-Length to match; ranged
    GETs, which pass 1 reads headers with, honest). Old code: 3 of 3 reported ``migrated``, the sources deleted,
    the keyed names holding 12 KiB of a 36 KiB frame: every block lost. Now: nothing renamed or deleted, each
    counted an error (exit 1); a run through an honest endpoint then renames all three."""
    ns, seqs = namespace(), [9100, 9101, 9102]
    kr = str(tmp_path / "kr.json")
    cfg = G4Config(url=seaweed.url(s3_prefix), endpoint_url=seaweed.endpoint, keyring={"path": kr},
                   dir_fanout=FANOUT, timeout_s=10.0)
    host, port = seaweed.endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    proxy = LyingProxy(host, int(port))
    try:
        with G4Pool(cfg, ns) as p:
            assert put_blocks(p, seqs, "alice").written == 3
            sources = _to_legacy(p, ns, seqs, "alice")
        proxy.mode = "short"
        base = ["g4", "migrate", "--url", cfg.url, "--keyring", kr, "--dir-fanout", str(FANOUT), "--json"]
        code, out = _cli(*base, "--endpoint-url", proxy.endpoint)
        res = json.loads(out)
        assert proxy.lied >= 3
        assert (code, res["migrated"], res["errors"]) == (1, 0, 3), out
        with G4Pool(cfg, ns) as p:
            for name, data in sources.items():  # every source still there, byte for byte
                assert bytes(p.store.get(name)) == data
            assert _legacy(p) == 3
            for s in seqs:  # and nothing damaged under the keyed names
                assert p.store.head(p.object_name(ns.key(s, tenant="alice"))) is None
        proxy.mode = "pass"
        code, out = _cli(*base, "--endpoint-url", proxy.endpoint)
        assert code == 0 and json.loads(out)["migrated"] == 3, out
        with G4Pool(cfg, ns) as p:
            assert read_checked(p, seqs, "alice") == [True] * 3 and _legacy(p) == 0
    finally:
        proxy.close()


def test_migrate_leaves_a_stored_object_whose_payload_fails_verification(tmp_path):
    """A format 1 object whose header matches its name but whose stored payload is damaged (an encrypted one:
    GCM tag; a plaintext one: xxh3). Old code renamed both (``migrated`` 2): a damaged object under the keyed
    name, reported as a renamed block. Now both stay where they are (``skipped_invalid``: the store confirms
    it holds those bytes, so it is no bad read; gc reclaims them) and a good one beside them is renamed."""
    ns = namespace()
    kr = str(tmp_path / "kr.json")
    enc = G4Config(url=f"file://{tmp_path / 'store'}", keyring={"path": kr}, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    plain = G4Config(url=enc.url, encrypt=False, keyring={"path": kr}, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    damaged = []
    for cfg, seqs in ((enc, [9200, 9201]), (plain, [9202])):
        with G4Pool(cfg, ns) as p:
            assert put_blocks(p, seqs, "alice").written == len(seqs)
            sources = _to_legacy(p, ns, seqs, "alice")
            name, data = next(iter(sources.items()))  # the first of each: a payload byte flipped in the store
            bad = bytearray(data)
            bad[HEADER_BYTES + 100] ^= 0x01
            p.store.delete(name)
            p.store.put(name, bytes(bad))
            damaged.append((name, bytes(bad)))
    code, out = _cli("g4", "migrate", "--url", enc.url, "--keyring", kr, "--plaintext", "--dir-fanout",
                     str(FANOUT), "--json")
    res = json.loads(out)
    assert (code, res["migrated"], res["skipped_invalid"], res["errors"]) == (0, 1, 2, 0), out
    with G4Pool(enc, ns) as p:
        for name, data in damaged:
            assert bytes(p.store.get(name)) == data  # left in place, for gc
        assert read_checked(p, [9201], "alice") == [True]
        assert p.store.head(p.object_name(ns.key(9200, tenant="alice"))) is None


def test_migrate_keeps_the_source_when_the_new_name_holds_a_damaged_object(tmp_path):
    """The keyed name already holds an object, but a damaged one (a payload byte flipped in the store), while the
    format 1 source is good. Old code: ``already_present`` 1 and the source deleted; the worker's load then found
    the damaged copy, deleted it (confirmed corrupt): the block gone from the store. Now the source stays
    (``kept_name_taken``), and once the damaged copy is gone a second run renames it: served again."""
    ns = namespace()
    kr = str(tmp_path / "kr.json")
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", keyring={"path": kr}, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    with G4Pool(cfg, ns) as p:
        assert put_blocks(p, [9300], "alice").written == 1
        k = ns.key(9300, tenant="alice")
        good = bytes(p.store.get(p.object_name(k)))
        p.store.put(p.legacy_object_name(k), good)  # the good block under its format 1 name
        bad = bytearray(good)
        bad[HEADER_BYTES + 7] ^= 0x40
        p.store.delete(p.object_name(k))
        p.store.put(p.object_name(k), bytes(bad))  # and a damaged copy under its keyed name
    base = ["g4", "migrate", "--url", cfg.url, "--keyring", kr, "--dir-fanout", str(FANOUT), "--json"]
    code, out = _cli(*base)
    res = json.loads(out)
    assert (code, res["already_present"], res["migrated"], res["kept_name_taken"]) == (0, 0, 0, 1), out
    with G4Pool(cfg, ns) as p:
        assert bytes(p.store.get(p.legacy_object_name(k))) == good  # the source kept
        assert read_checked(p, [9300], "alice") == [False]  # the worker drops the damaged copy on load
        assert p.stats()["deleted_corrupt"] == 1
    code, out = _cli(*base)
    assert code == 0 and json.loads(out)["migrated"] == 1, out
    with G4Pool(cfg, ns) as p:
        assert read_checked(p, [9300], "alice") == [True] and _legacy(p) == 0


def _files(root) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def test_a_dry_run_reports_what_the_run_does_on_a_mixed_store(tmp_path):
    """A store holding format 1 objects whose keyed name holds a good copy, a damaged copy, a foreign object
    (another block's frame), nothing, and one damaged source. Old code: the dry run counted ``already_present``
    for every existing keyed name and ``migrated`` for the damaged source ((migrated, already_present,
    kept_name_taken, skipped_invalid) = (2, 3, 0, 0)) while the run did (1, 1, 2, 1). Now the dry run reads and
    verifies as the run does: every count equal, and the store untouched by it, byte for byte."""
    ns = namespace()
    kr = str(tmp_path / "kr.json")
    root = tmp_path / "store"
    cfg = G4Config(url=f"file://{root}", keyring={"path": kr}, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    good, damaged, foreign, absent, bad_src = 9400, 9401, 9402, 9403, 9404
    with G4Pool(cfg, ns) as p:
        assert put_blocks(p, [good, damaged, foreign, absent, bad_src, 9499], "alice").written == 6
        for s in (good, damaged, foreign):  # the block under both names
            k = ns.key(s, tenant="alice")
            p.store.put(p.legacy_object_name(k), bytes(p.store.get(p.object_name(k))))
        kd = ns.key(damaged, tenant="alice")  # a payload byte flipped in the keyed copy
        bad = bytearray(p.store.get(p.object_name(kd)))
        bad[HEADER_BYTES + 7] ^= 0x40
        p.store.delete(p.object_name(kd))
        p.store.put(p.object_name(kd), bytes(bad))
        kf = ns.key(foreign, tenant="alice")  # another block's frame under the keyed name
        other = bytes(p.store.get(p.object_name(ns.key(9499, tenant="alice"))))
        p.store.delete(p.object_name(kf))
        p.store.put(p.object_name(kf), other)
        _to_legacy(p, ns, [absent], "alice")
        name, data = next(iter(_to_legacy(p, ns, [bad_src], "alice").items()))  # a damaged source
        src = bytearray(data)
        src[HEADER_BYTES + 100] ^= 0x01
        p.store.delete(name)
        p.store.put(name, bytes(src))
    base = ["g4", "migrate", "--url", cfg.url, "--keyring", kr, "--dir-fanout", str(FANOUT), "--json"]
    before = _files(root)
    code_dry, out = _cli(*base, "--dry-run")
    dry = json.loads(out)
    assert _files(root) == before  # nothing written, nothing deleted
    code, out = _cli(*base)
    real = json.loads(out)
    keys = ("migrated", "already_present", "kept_name_taken", "skipped_invalid", "errors")
    assert [real[k] for k in keys] == [1, 1, 2, 1, 0], out
    assert (code_dry, [dry[k] for k in keys]) == (code, [real[k] for k in keys])
    assert {k: v for k, v in dry.items() if k != "dry_run"} == {k: v for k, v in real.items() if k != "dry_run"}


class _CountingStore:
    """The real file store of ``inner``, counting the bytes each ``get`` returned (the largest one read)."""

    def __init__(self, inner):
        self._inner, self.largest = inner, 0

    def get(self, name, offset=0, length=None):
        data = self._inner.get(name, offset, length)
        self.largest = max(self.largest, 0 if data is None else len(data))
        return data

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


def test_migrate_reads_no_more_than_a_frame_of_an_object_grown_past_it(tmp_path):
    """A format 1 object whose header names its block, followed by 16 MiB appended (a tampered or runaway object
    at a block's name), beside a good one. Before 2026-12-02 migrate read each object whole (16 MiB into memory for
    a 36 KiB block; gigabytes for a planted one); now it reads the frame its header names and one byte more: the
    grown one is ``skipped_invalid`` and left for gc, the good one renamed, and no read returned more than a frame
    and a byte."""
    from kvbm_backend.pool.g4.factory import open_store
    from kvbm_backend.pool.g4.migrate import run_migrate

    ns = namespace()
    kr = str(tmp_path / "kr.json")
    cfg = G4Config(url=f"file://{tmp_path / 'store'}", keyring={"path": kr}, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    with G4Pool(cfg, ns) as p:
        assert put_blocks(p, [9300, 9301], "alice").written == 2
        sources = _to_legacy(p, ns, [9300, 9301], "alice")
        name, data = next(iter(sources.items()))
        p.store.delete(name)
        p.store.put(name, data + bytes(16 << 20))
        frame = len(data)
        keyring = p.keyring
        store = _CountingStore(open_store(cfg.url))
        res = run_migrate(store, keyring=keyring, dir_fanout=FANOUT)
        assert (res["migrated"], res["skipped_invalid"], res["errors"]) == (1, 1, 0), res
        assert store.largest <= frame + 1, f"migrate read {store.largest} bytes of an object whose frame is {frame}"
        assert p.store.head(name) == frame + (16 << 20)  # left in place, for gc
        assert read_checked(p, [9301], "alice") == [True]
