"""``g3.o_direct: off`` (or KVBM's ``DYN_KVBM_DISK_DISABLE_O_DIRECT=true``) reaches every G3 read path.

docs/configuration.md: ``g3.o_direct`` "probe each path; ``on``/``off`` to force". Before 2026-12-03 only the slab
files' own fds (writes, host gets) followed it: the device loads (``get`` into torch tensors: the bounce and host
paths) and the layer-wise loads opened the slab files again with O_DIRECT wherever the filesystem took it, so an
operator who turned O_DIRECT off (a filesystem whose O_DIRECT misbehaves) still had every load into the engine
read with it. Real files on the test's filesystem; the flags checked are the kernel's (``/proc/self/fdinfo``)."""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbm_backend.config import load_config
from kvbm_backend.model.layout import KvLayout
from kvbm_backend.model.namespace import Namespace
from kvbm_backend.pool.g3 import G3Pool

HANG_S = 600.0  # a hang guard only
LAYOUT = KvLayout(num_layers=4, outer_dim=2, page_size=16, inner_dim=128, dtype="bfloat16")  # 8 KiB layers
NS = Namespace(model="test/o-direct-reads", revision="r1", layout=LAYOUT, tp_world_size=1)


def _kernel_o_direct(fds: list[int]) -> list[bool]:
    """Whether each open fd has O_DIRECT, as the kernel reports it."""
    out = []
    for fd in fds:
        flags = next(ln for ln in open(f"/proc/self/fdinfo/{fd}") if ln.startswith("flags:"))
        out.append(bool(int(flags.split()[1], 8) & os.O_DIRECT))
    return out


def _open(path, environ: dict[str, str]) -> G3Pool:
    """A G3 pool from a config file plus ``environ``, as a worker builds it."""
    cfg_file = path / "kvbm-backend.yaml"
    cfg_file.write_text(f"g3:\n  paths: [{str(path / 'g3')!r}]\n  capacity_gb: 0.05\n  files_per_path: 1\n"
                        "  load_timeout_s: 120\n  admission: {policy: all}\n")
    return G3Pool(load_config(cfg_file, environ=environ).g3, NS)


def _read_fds(pool: G3Pool, keys) -> tuple[list[int], list[int]]:
    """Load ``keys`` through the device path (CPU tensors) and layer-wise; the read fds each path opened."""
    bpb = LAYOUT.bytes_per_block
    out = [torch.zeros(bpb, dtype=torch.uint8) for _ in keys]
    assert pool.get(keys, out).result(timeout=HANG_S).ok == [True] * len(keys)
    ld = pool.layerwise_load(keys, "cpu", min_read=8192)
    assert ld.finish() == [None] * len(keys)
    device_fds = pool.reader.device_readers["cpu"].reads.files.open_fds()
    layerwise_fds = pool.reader._layerwise.files.open_fds()
    assert device_fds and layerwise_fds
    return device_fds, layerwise_fds


@pytest.mark.parametrize("environ", [{"DYN_KVBM_DISK_DISABLE_O_DIRECT": "true"}, {"KVBM_BACKEND__G3__O_DIRECT": "off"}],
                         ids=["kvbm-env", "field-env"])
def test_o_direct_off_makes_device_and_layerwise_loads_read_buffered(tmp_path, environ):
    rng = np.random.default_rng(3)
    keys = NS.keys(list(range(10, 14)), "t", 0)
    blocks = [rng.integers(0, 256, LAYOUT.bytes_per_block, dtype=np.uint8) for _ in keys]
    auto = tmp_path / "auto"
    auto.mkdir()
    with _open(auto, {}) as pool:  # the control: this filesystem takes O_DIRECT, and auto's loads use it
        if not pool.stats()["o_direct"][str(auto / "g3")]:
            pytest.skip("the test's filesystem refuses O_DIRECT: nothing to switch off")
        assert pool.put(keys, blocks).result(timeout=HANG_S).written == len(keys) and pool.flush(HANG_S)
        dev, lw = _read_fds(pool, keys)
        assert all(_kernel_o_direct(dev)) and all(_kernel_o_direct(lw))
    off = tmp_path / "off"
    off.mkdir()
    with _open(off, environ) as pool:
        assert pool.cfg.o_direct == "off" and pool.stats()["o_direct"] == {str(off / "g3"): False}
        assert pool.put(keys, blocks).result(timeout=HANG_S).written == len(keys) and pool.flush(HANG_S)
        dev, lw = _read_fds(pool, keys)
        assert _kernel_o_direct(dev) == [False] * len(dev), "device loads opened the slab files with O_DIRECT"
        assert _kernel_o_direct(lw) == [False] * len(lw), "layer-wise loads opened the slab files with O_DIRECT"
        st = pool.reader.device_readers["cpu"].stats()
        assert st.get("files_o_direct", 0) == 0 and st["files_buffered"] >= 1
