"""Prometheus metrics: KVBM's names where KVBM has them, ours for the rest; per-pool registries."""
from __future__ import annotations

import socket
import urllib.request

import numpy as np

from crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend import metrics
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model import frame
from kvbm_backend.pool.g3 import G3Pool


def _val(reg, name, **labels):
    return metrics.sample_value(reg, name, labels) or 0.0


def test_pool_metrics_names_and_values(tmp_path):
    reg = metrics.new_registry()
    pool = G3Pool(open_pool.__globals__["config"](tmp_path, write_queue_blocks=4), NS, registry=reg)
    try:
        keys = NS.keys(range(1, 7))
        r = pool.put(keys, [payload(k.seq_hash) for k in keys]).result()
        assert r.written == 4 and r.dropped == 2
        assert _val(reg, "kvbm_offload_blocks_h2d_total") == 4
        assert _val(reg, "kvbm_backend_g3_offloads_dropped_total", reason="queue_full") == 2
        assert pool.lookup_prefix(keys).result() == 4
        assert _val(reg, "kvbm_matched_tokens_total") == 4 * LAYOUT.page_size
        assert _val(reg, "kvbm_disk_cache_hit_rate") == 4 / 6
        f, s = pool.index.get(keys[0])
        with open(pool.slabs.by_index[f].path, "r+b") as fh:
            fh.seek(s * pool.slot_bytes + frame.HEADER_BYTES + 5)
            fh.write(b"\x00\x01\x02")
        out = [aligned_empty(LAYOUT.bytes_per_block) for _ in keys[:4]]
        assert pool.get(keys[:4], out).result().ok == [False, True, True, True]
        assert _val(reg, "kvbm_onboard_blocks_d2d_total") == 3
        assert _val(reg, "kvbm_backend_g3_corrupt_blocks_total", reason="integrity") == 1
        assert _val(reg, "kvbm_backend_g3_load_misses_total", reason="corrupt") == 1
        assert _val(reg, "kvbm_backend_g3_blocks") == 3
        assert _val(reg, "kvbm_backend_g3_capacity_bytes") == pool.stats()["capacity_bytes"] > 0
        assert _val(reg, "kvbm_backend_g3_bytes_written_total") == 4 * pool.slot_bytes
    finally:
        pool.close()
    # a second pool on its own registry starts from zero; on the same registry it shares the series
    reg2 = metrics.new_registry()
    with G3Pool(open_pool.__globals__["config"](tmp_path / "b"), NS, registry=reg2):
        assert _val(reg2, "kvbm_offload_blocks_h2d_total") == 0
    with G3Pool(open_pool.__globals__["config"](tmp_path / "c"), NS, registry=reg) as p3:
        p3.put(keys[:1], [payload(keys[0].seq_hash)]).result()
        assert _val(reg, "kvbm_offload_blocks_h2d_total") == 5


def test_tier_metrics_for_g4_and_serving():
    reg = metrics.new_registry()
    m = metrics.TierMetrics("g4", reg)
    m.offload_blocks.inc(3)
    m.hit_rate.record(10, 5)
    assert _val(reg, "kvbm_offload_blocks_d2o_total") == 3
    assert _val(reg, "kvbm_object_cache_hit_rate") == 0.5
    c = metrics.counter("kvbm_backend_g4_custom", "a helper-made counter", ("reason",), reg)
    assert metrics.counter("kvbm_backend_g4_custom", "same", ("reason",), reg) is c  # idempotent
    c.labels("x").inc()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, _ = metrics.serve(port, reg)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
    assert "kvbm_offload_blocks_d2o_total 3.0" in body and 'kvbm_backend_g4_custom_total{reason="x"} 1.0' in body


def test_hit_rate_window_slides():
    reg = metrics.new_registry()
    hr = metrics.HitRate(metrics.gauge("kvbm_test_rate", "t", registry=reg), window=100)
    hr.record(100, 100)
    hr.record(100, 0)
    assert hr.value == 0.0  # the first lookup slid out of the 100-block window
    assert np.isclose(_val(reg, "kvbm_test_rate"), 0.0)
