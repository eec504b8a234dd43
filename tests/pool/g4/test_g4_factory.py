"""The G4 store factory (:mod:`kvbm_backend.pool.g4.factory`): a store chosen by URL scheme, and the
in-process ``mem://`` store unit tests run G4 on."""
from __future__ import annotations

import ast
import os

import numpy as np
import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.model.hashing import sequence_hashes
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.g4 import memory_store, store as store_abc
from kvbm_backend.pool.g4.factory import SCHEMES, StoreOptions, open_store
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.memory_store import MemoryStore
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.pools import TINY_LAYOUT

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do

LAYOUT = TINY_LAYOUT


def test_unknown_scheme_is_a_value_error_naming_the_field_and_the_scheme():
    with pytest.raises(ValueError, match=r"g4\.url .*scheme 'gopher' not supported") as e:
        open_store("gopher://host/x")
    assert "mem://" in str(e.value) and "s3://" in str(e.value)
    with pytest.raises(ValueError, match=r"g4\.url: empty"):
        open_store("")
    with pytest.raises(ValueError, match=r"g4\.url .*mem://NAME"):
        open_store("mem://")


def test_the_scheme_picks_the_store_and_the_config_its_options(tmp_path):
    assert set(SCHEMES) >= {"s3", "file", "mem"}
    fs = open_store(f"file://{tmp_path}", G4Config(url=f"file://{tmp_path}", fsync=False))
    assert isinstance(fs, FsStore) and fs.fsync is False and fs.url == f"file://{tmp_path}"
    assert isinstance(open_store("mem://fac/a"), MemoryStore)
    assert StoreOptions.from_config(G4Config(timeout_s=7.0, retries=3)).timeout_s == 7.0
    cfg = G4Config(url="s3://bkt/p", endpoint_url="http://127.0.0.1:9", region="eu-west-3", timeout_s=3.0, retries=2,
                   max_inflight=7)
    s3 = open_store(cfg.url, cfg)  # no request goes out until the pool's start-up check
    assert s3.client.meta.region_name == "eu-west-3" and s3.client.meta.endpoint_url == "http://127.0.0.1:9"
    assert s3.client.meta.config.read_timeout == 3.0 and s3.retries == 2
    # S3Store makes the retries itself (throttles are left to the pool's bounded backoff): botocore makes one attempt
    assert s3.client.meta.config.retries["total_max_attempts"] == 1
    assert s3.client.meta.config.max_pool_connections == 2 * 7  # reads and writes: max_inflight each
    assert store_abc.open_store("mem://fac/a").url == "mem://fac/a"  # the ABC module's name delegates here


@pytest.mark.parametrize("fsync", [True, False])
def test_g4_fsync_decides_whether_file_objects_and_their_directories_are_fsynced(tmp_path, monkeypatch, fsync):
    """``g4.fsync`` on a ``file://`` store: true (the default), each block's file is fsync'ed before it is
    linked into place and its directory after (invariant 2); false (benchmarks only), nothing under the
    store is. The real ``os.fsync`` runs; the wrapper records which file each call was for."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    root = tmp_path / "g4"
    ns = Namespace("fsync/model", LAYOUT)
    keys = ns.keys(sequence_hashes(list(range(64)), 16), tenant="t")
    blocks = [np.full(LAYOUT.bytes_per_block, i, np.uint8) for i in range(len(keys))]
    with G4Pool(G4Config(url=f"file://{root}", encrypt=False, fsync=fsync), ns) as p:
        assert p.put(keys, blocks).result(timeout=HANG_S).written == 4
        names = [str(root / p.object_name(k)) for k in keys]
    ours = [f for f in synced if f.startswith(str(root))]
    if fsync:
        for n in names:  # the temp file that became the object, then the object's directory
            assert any(f.startswith(os.path.join(os.path.dirname(n), "." + os.path.basename(n))) for f in ours), n
            assert os.path.dirname(n) in ours, n
    else:
        assert ours == []


def test_the_store_abc_module_imports_no_store_class():
    tree = ast.parse(open(store_abc.__file__).read())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not mods & {"s3_store", "fs_store", "memory_store", "boto3"}, mods


def test_memory_stores_of_one_name_share_objects_like_a_real_store():
    memory_store.clear("fac-share")
    a, b = open_store("mem://fac-share"), open_store("mem://fac-share")
    assert a.put_if_absent("x/1", b"hello") is True
    assert b.put_if_absent("x/1", b"other") is False  # create-exclusive across stores of one name
    assert bytes(b.get("x/1")) == b"hello" and b.get("x/1", 1, 3) == b"ell" and b.head("x/1") == 5
    assert [o.name for o in b.list("x/")] == ["x/1"]
    assert open_store("mem://fac-other").head("x/1") is None
    buf = bytearray(3)
    assert b.get_into("x/1", buf) == 5 and bytes(buf) == b"hel"
    b.delete("x/1")
    assert a.get("x/1") is None and a.head("x/1") is None


def test_two_pools_on_one_mem_url_see_each_others_blocks():
    memory_store.clear("fac-pools")
    ns = Namespace("factory/model", LAYOUT)
    keys = ns.keys(sequence_hashes(list(range(3 * LAYOUT.page_size)), LAYOUT.page_size))
    data = [np.full(LAYOUT.bytes_per_block, i, np.uint8) for i in range(3)]
    cfg = G4Config(enabled=True, url="mem://fac-pools", encrypt=False)
    with G4Pool(cfg, ns) as w, G4Pool(cfg, ns) as r:
        assert w.put(keys, data).result(10).written == 3
        out = [np.zeros(LAYOUT.bytes_per_block, np.uint8) for _ in range(3)]
        assert r.lookup_prefix(keys).result(10) == 3
        assert r.get(keys, out).result(10).ok == [True] * 3
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
