"""A CUDA engine's saves never wait for the GPU on vLLM's thread (:mod:`kvbm_backend.integrations.vllm.offloads`).

Skips without CUDA. The same staging and hand-off run on the CPU in
``tests/integrations/vllm/test_offloads.py`` (hand-off deferred as here).
"""
from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from kvbm_backend.model.namespace import Namespace
from tests.helpers.pools import open_g3

CUDA_OK = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA_OK, reason="no CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("layout", ["LBNHC", "kv_first"])
def test_gpu_save_returns_with_the_stream_busy_and_stores_what_the_stream_wrote(tmp_path, layout):
    """With ~1 s of kernel queued and the KV written behind it (as a forward writes it), ``WorkerSide.save``
    returns while the stream still runs (``query()`` False): the gather, device checksums and the copies to
    pinned memory are queued, not waited for. The blocks stored are the values written after the sleep (the
    save thread waited for the event), and a device load verifies their device checksums and scatters them.
    ``LBNHC``: vLLM 0.32's GPU cache (``[nb, H, N, 2D]`` packed K|V in NHD strides), moved by the Triton kernel
    where triton is installed; ``kv_first``: the older layout."""
    from kvbm_backend.gpu import layer_copy
    from kvbm_backend.integrations.vllm.kv_io import EngineKv
    from kvbm_backend.integrations.vllm.metadata import LoadJob, SaveJob
    from kvbm_backend.integrations.vllm.worker_side import WorkerSide
    if layout == "LBNHC":
        t = [torch.zeros(8, 16, 2, 128, dtype=torch.bfloat16, device="cuda").permute(0, 2, 1, 3) for _ in range(2)]
    else:
        t = [torch.zeros(2, 8, 16, 2, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    kv = EngineKv.from_tensors(t, 8, 16, 2, 64)
    assert kv.engine_layout == ("packed" if layout == "LBNHC" else "kv_first")
    if layer_copy.triton is not None:
        assert kv.move_mode == "triton kernel verified", kv.move_mode

    def blocks(x, a, b):  # engine blocks a..b-1 of one layer tensor
        return x[a:b] if layout == "LBNHC" else x[:, a:b]
    ns = Namespace(model="test/gpu-save", revision="r1", layout=kv.layout, tp_world_size=1)
    g3 = open_g3(tmp_path / "g3", ns, load_timeout_s=20)
    w = WorkerSide(ns, 0, g3, None, load_timeout_s=30)  # device_checksum auto: on for a CUDA engine
    try:
        w.register(kv)
        assert w.offloads.defer and w.dev_checks_on
        w.save([SaveJob("warm", [0], [10], "acme")])  # first use of the fused checksum checks it once (syncs)
        assert w.flush_saves(30)
        torch.cuda.synchronize()
        s = torch.cuda.current_stream()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time on the current stream
        for x in t:
            blocks(x, 1, 3).fill_(1.5)  # the "forward" writes blocks 1 and 2 behind the sleep
        w.save([SaveJob("r", [1, 2], [11, 12], "acme")])
        assert not s.query(), "save waited for the stream"
        assert w.flush_saves(30) and g3.flush(30)
        assert g3.stats()["blocks"] == 3
        for x in t:
            x.zero_()
        w.start_loads([LoadJob("l", [5, 6], [11, 12], ["G3"] * 2, "acme")])
        end = time.monotonic() + 30
        while "l" not in w.get_finished():
            assert time.monotonic() < end, "load never finished"
            time.sleep(0.01)
        assert w.load_errors() == set()
        for x in t:
            assert torch.all(blocks(x, 5, 7) == 1.5) and torch.all(blocks(x, 1, 3) == 0)
        assert g3.device_reader(kv.device).stats().get("host_verified", 0) == 0  # device checksums verified
    finally:
        w.shutdown()
        g3.close()
