"""``kvbm-backend gc`` (age, capacity target, per tenant, temp-file grace, dry run) and
``kvbm-backend bench --tier g4`` JSON on both stores."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from tests.helpers.g4_writer import namespace, payload
from kvbm_backend.apps.cli import app
from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.pool import G4Pool

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do

pytestmark = [pytest.mark.slow]

BENCH_KEYS = {"block_bytes", "blocks", "io_size_bytes", "engine", "write_gbps", "read_gbps", "baseline_write_gbps",
              "baseline_read_gbps", "cpu_s_per_gb", "encrypt", "aes_gcm_gbps_per_core", "encrypted_read_gbps",
              "unencrypted_read_gbps", "put_cpu_s_per_gb", "get_cpu_s_per_gb", "encrypted_put_cpu_s_per_gb",
              "encrypted_get_cpu_s_per_gb", "unencrypted_put_cpu_s_per_gb", "unencrypted_get_cpu_s_per_gb"}


def _fill(url, kr, endpoint=None):
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    with G4Pool(G4Config(url=url, endpoint_url=endpoint, keyring={"path": kr}), ns) as p:
        for t, seqs in (("alice", range(1, 5)), ("bob", range(10, 14))):
            for s in seqs:  # one at a time so mtimes are ordered
                assert p.put(ns.keys([s], tenant=t), [payload(s, t, bpb)]).result(timeout=HANG_S).written == 1
                time.sleep(0.02)
        return p.object_name(ns.key(1, tenant="alice")), bpb


def _gc(*args):
    r = CliRunner().invoke(app, ["gc", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_gc_cli_file_store(tmp_path):
    url, kr = f"file://{tmp_path / 'store'}", str(tmp_path / "kr.json")
    first, bpb = _fill(url, kr)
    root = tmp_path / "store"
    # a crashed writer's temp file: young ones are never touched, old ones are reclaimed
    d = (root / first).parent
    young, old = d / ".x.host.1.aaaa.tmp", d / ".y.host.2.bbbb.tmp"
    young.write_bytes(b"partial")
    old.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    obj = 4096 + bpb
    dry = _gc("--url", url, "--target-gb", str(5 * obj / 1e9), "--dry-run")
    assert dry["deleted_by"]["capacity"] == 3 and (root / first).exists()  # dry run deletes nothing
    res = _gc("--url", url, "--tenant", "alice", "--keyring", kr, "--target-gb", str(2 * obj / 1e9))
    assert res["scanned_objects"] == 4 and res["deleted_by"]["capacity"] == 2 and res["deleted_by"]["temp"] == 1
    assert not (root / first).exists() and young.exists() and not old.exists()  # oldest first
    res = _gc("--url", url, "--max-age-s", "0")
    assert res["deleted_by"]["age"] == 6 and res["remaining_bytes"] == 0
    bad = CliRunner().invoke(app, ["gc", "--url", url, "--tenant", "alice", "--max-age-s", "1"])
    assert bad.exit_code == 2 and "--keyring" in " ".join(bad.output.split())


def test_gc_cli_s3_revoked_tenant(seaweed, s3_prefix, tmp_path):
    url, kr = seaweed.url(s3_prefix), str(tmp_path / "kr.json")
    _fill(url, kr, seaweed.endpoint)
    r = CliRunner().invoke(app, ["keys", "revoke", "--keyring", kr, "--tenant", "bob"])
    assert r.exit_code == 0, r.output
    res = _gc("--url", url, "--endpoint-url", seaweed.endpoint, "--keyring", kr)
    assert res["deleted_by"]["revoked"] == 4 and res["scanned_objects"] == 8
    res = _gc("--url", url, "--endpoint-url", seaweed.endpoint, "--max-age-s", "3600")
    assert res["scanned_objects"] == 4 and res["deleted_objects"] == 0


@pytest.mark.parametrize("store", ["fs", "s3"])
def test_bench_g4_json(store, tmp_path, s3_prefix, request):
    if store == "fs":
        (tmp_path / "bench").mkdir()
        args = ["--url", f"file://{tmp_path / 'bench'}"]
    else:
        sw = request.getfixturevalue("seaweed")
        args = ["--url", sw.url(s3_prefix), "--endpoint-url", sw.endpoint]
    r = CliRunner().invoke(app, ["bench", "--tier", "g4", *args, "--layout", "tiny", "--blocks", "8", "--json",
                                 "--no-encrypt"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert BENCH_KEYS <= set(d) and d["encrypt"] is False and d["blocks"] == 8 and d["block_bytes"] == 32768
    assert d["read_gbps"] > 0 and d["baseline_read_gbps"] > 0 and d["aes_gcm_gbps_per_core"] > 0
    assert d["read_gbps"] == d["unencrypted_read_gbps"]
    # issue 25 item 1: client CPU per GB, by direction, for the selected mode (here: unencrypted)
    assert d["put_cpu_s_per_gb"] > 0 and d["get_cpu_s_per_gb"] > 0
    assert d["put_cpu_s_per_gb"] == d["unencrypted_put_cpu_s_per_gb"]
    assert d["get_cpu_s_per_gb"] == d["unencrypted_get_cpu_s_per_gb"]
    assert d["client"] == ("obstore" if store == "s3" else "posix")  # g4.s3_client's default
    if store == "s3":  # --s3-client picks the client whose CPU is measured
        r = CliRunner().invoke(app, ["bench", "--tier", "g4", *args, "--layout", "tiny", "--blocks", "8", "--json",
                                     "--no-encrypt", "--s3-client", "boto3"])
        assert r.exit_code == 0, r.output
        d = json.loads(r.output)
        assert d["client"] == "boto3" and d["put_cpu_s_per_gb"] > 0 and d["get_cpu_s_per_gb"] > 0
    bad = CliRunner().invoke(app, ["bench", "--tier", "g4", "--layout", "tiny", "--blocks", "8"])
    assert bad.exit_code == 2 and "--url" in bad.output
    bad = CliRunner().invoke(app, ["bench", "--tier", "g4", *args, "--layout", "tiny", "--s3-client", "nixl"])
    assert bad.exit_code == 2 and "--s3-client" in bad.output


def _revoked_at(kr: str, pseudonym: str, t: float) -> None:
    """Set the keyring's revocation time of ``pseudonym``, as ``keys revoke`` run on a host whose clock
    said ``t`` would have written it (same file discipline: 0600, atomic rename)."""
    doc = json.loads(open(kr).read())
    doc["revoked"][pseudonym]["revoked_at"] = t
    tmp = f"{kr}.edit"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, kr)


def test_gc_file_store_whose_clock_runs_ahead_of_ours(tmp_path):
    """Issue 26 item 12: a shared mount whose server clock runs an hour ahead of this host's (``now`` an hour
    behind the filesystem's clock here). The probe object's mtime gives the store's clock, so the blocks are
    seconds old: ``max_age_s=600`` deletes nothing, 0 every block, and a revoked tenant's blocks are
    reclaimed whatever their mtime."""
    from kvbm_backend.crypto.keyring import Keyring, provider_for
    from kvbm_backend.pool.g4.factory import open_store
    from kvbm_backend.pool.g4.gc import CLOCK_PROBE_PREFIX, run_gc
    url, kr = f"file://{tmp_path / 'store'}", str(tmp_path / "kr.json")
    _fill(url, kr)
    store = open_store(url)
    behind = time.time() - 3600
    k = Keyring(kr, provider_for(kr))
    k.revoke("bob")
    res = run_gc(store, keyring=Keyring(kr, provider_for(kr)), now=behind)
    assert res["deleted_by"]["revoked"] == 4 and res["time_base"] == "server" and res["clock_skew_s"] > 3000
    assert run_gc(store, max_age_s=600, now=behind)["deleted_objects"] == 0
    res = run_gc(store, max_age_s=0, now=behind)
    assert res["deleted_by"]["age"] == 4 and res["remaining_bytes"] == 0
    assert not list(store.list(CLOCK_PROBE_PREFIX))  # the probes are gone


def test_gc_one_object_stamped_ahead_does_not_age_the_others(tmp_path):
    """Review finding (2026-11-29): the time base was never earlier than the newest mtime of the listing, so
    one object stamped a day ahead (a writer whose clock runs ahead, a restored file) made ``--max-age-s
    3600`` delete blocks written seconds before, and every writer's temp file in flight. The store's clock
    (a probe object) is the base now; the outlier counts as new (``future_objects``)."""
    url, kr = f"file://{tmp_path / 'store'}", str(tmp_path / "kr.json")
    _fill(url, kr)
    files = sorted(f for f in (tmp_path / "store").rglob("*") if f.is_file() and f.name != "namespace.json"
                   and not f.name.endswith(".json"))
    ahead = time.time() + 86400
    os.utime(files[0], (ahead, ahead))
    temp = files[1].parent / f".{files[1].name}.otherhost.1.{'0' * 32}.tmp"  # a writer's temp file in flight
    temp.write_bytes(b"x" * 100)
    res = _gc("--url", url, "--max-age-s", "3600")
    assert res["deleted_objects"] == 0 and res["future_objects"] == 1 and res["time_base"] == "server", res
    assert res["deleted_by"]["temp"] == 0 and temp.exists()
    assert all(f.exists() for f in files)


def test_gc_s3_measures_ages_on_the_servers_clock(seaweed, s3_prefix, tmp_path):
    """A real SeaweedFS, and our clock (``now``) an hour behind the server's: ages come from the server's
    Date header, so ``max_age_s=0`` deletes every block and 600 none; a tenant revoked on a host whose
    clock was behind too (``revoked_at`` before every mtime) loses every block to gc."""
    from kvbm_backend.crypto.keyring import Keyring, provider_for
    from kvbm_backend.pool.g4.factory import open_store
    from kvbm_backend.pool.g4.gc import run_gc
    url, kr = seaweed.url(s3_prefix), str(tmp_path / "kr.json")
    _fill(url, kr, seaweed.endpoint)
    store = open_store(url, endpoint_url=seaweed.endpoint)
    assert abs(store.server_time() - time.time()) < 300  # the server states its clock (loopback: ours)
    behind = time.time() - 3600
    k = Keyring(kr, provider_for(kr))
    ps = k.revoke("bob")["pseudonym"]
    _revoked_at(kr, ps, behind)
    k = Keyring(kr, provider_for(kr))
    res = run_gc(store, keyring=k, now=behind)
    assert res["deleted_by"]["revoked"] == 4 and res["time_base"] == "server"
    assert res["clock_skew_s"] > 3000
    assert run_gc(store, max_age_s=600, now=behind)["deleted_objects"] == 0
    res = run_gc(store, max_age_s=0, now=behind)
    assert res["deleted_by"]["age"] == 4 and res["remaining_bytes"] == 0


def test_gc_keeps_a_recreated_tenants_new_blocks(tmp_path):
    """``keys create`` after ``revoke``: the same pseudonym, a new key. gc reclaims the blocks written
    before the revocation and keeps the new tenant's."""
    url, kr = f"file://{tmp_path / 'store'}", str(tmp_path / "kr.json")
    _fill(url, kr)
    assert CliRunner().invoke(app, ["keys", "revoke", "--keyring", kr, "--tenant", "bob"]).exit_code == 0
    time.sleep(1.2)  # past the 1 s slack after revoked_at
    assert CliRunner().invoke(app, ["keys", "create", "--keyring", kr, "--tenant", "bob"]).exit_code == 0
    ns = namespace()
    bpb = ns.layout.bytes_per_block
    with G4Pool(G4Config(url=url, keyring={"path": kr}), ns) as p:
        assert p.put(ns.keys([50], tenant="bob"), [payload(50, "bob", bpb)]).result(timeout=HANG_S).written == 1
    res = _gc("--url", url, "--keyring", kr)
    assert res["deleted_by"]["revoked"] == 4 and res["scanned_objects"] == 9
    with G4Pool(G4Config(url=url, keyring={"path": kr}), ns) as p:
        out = [np.zeros(bpb, np.uint8)]
        assert p.get(ns.keys([50], tenant="bob"), out).result(timeout=HANG_S).ok == [True]
