"""Keys a warm-restarted G3 pool gives out (``G3Pool.keys()``: restored ``TagKey`` s, their tenant known only by its
tag) read like any other on every read path: host gets, layer-wise loads and device gets (torch destinations; the
CPU device runs the device loader's own code here). Review finding 2026-12-02: the device loader checked frames
against the tag of a TagKey's tenant placeholder, so every restored key missed a device get, was counted
``corrupt_identity`` and had its slot re-read (kept, with a warning per slot)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbm_backend.pool.g3 import G3Pool  # noqa: E402
from kvbm_backend.pool.g3.index import TagKey  # noqa: E402
from tests.helpers.pools import g3_config, tiny_ns  # noqa: E402

NS = tiny_ns("test/restored-keys")
BPB = NS.layout.bytes_per_block
HANG_S = 600.0  # a hang guard, not a bound


def test_restored_keys_load_on_every_read_path(tmp_path):
    keys = NS.keys(range(1, 5), tenant="alice")
    blocks = [np.random.default_rng(k.seq_hash).integers(0, 256, BPB, dtype=np.uint8) for k in keys]
    with G3Pool(g3_config(tmp_path / "g3", engine="posix"), NS) as pool:
        assert pool.put(keys, blocks).result(timeout=HANG_S).written == 4
    with G3Pool(g3_config(tmp_path / "g3", engine="posix"), NS) as pool:  # warm restart (load bound 120 s)
        restored = sorted(pool.keys(), key=lambda k: k.seq_hash)
        assert [type(k) for k in restored] == [TagKey] * 4
        outs = [np.zeros(BPB, np.uint8) for _ in restored]
        assert pool.get(restored, outs).result(timeout=HANG_S).ok == [True] * 4  # host path
        assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))
        assert pool.layerwise_load(restored, "cpu").finish() == [None] * 4
        dst = torch.zeros((4, BPB), dtype=torch.uint8)
        assert pool.get(restored, dst).result(timeout=HANG_S).ok == [True] * 4  # device loader
        assert all(np.array_equal(dst[i].numpy(), b) for i, b in enumerate(blocks))
        st = pool.reader.device_readers["cpu"].stats()
        assert not st.get("corrupt_identity") and st.get("missed", 0) == 0, st
