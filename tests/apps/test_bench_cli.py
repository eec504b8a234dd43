"""``kvbm-backend bench --tier g3`` and ``--tier vllm-tiers`` JSON: the keys acceptance checks read
(issue texts), with values that are real measurements of this run (the G4 bench is in
``test_g4_gc_bench.py``)."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from kvbm_backend.apps.cli import app

G3_KEYS = {"block_bytes", "blocks", "io_size_bytes", "engine", "write_gbps", "read_gbps", "baseline_write_gbps",
           "baseline_read_gbps", "cpu_s_per_gb"}
TIER_KEYS = {"ours_write_gbps", "ours_read_gbps", "vllm_fs_write_gbps", "vllm_fs_read_gbps"}


def test_bench_g3_json(tmp_path):
    (tmp_path / "g3").mkdir()
    r = CliRunner().invoke(app, ["bench", "--tier", "g3", "--path", str(tmp_path / "g3"), "--layout", "tiny",
                                 "--blocks", "64", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert G3_KEYS <= set(d) and d["blocks"] == 64 and d["block_bytes"] == 32768
    assert d["io_size_bytes"] == 1 << 20 and d["engine"] in ("nixl", "posix")
    for k in ("write_gbps", "read_gbps", "baseline_write_gbps", "baseline_read_gbps", "cpu_s_per_gb"):
        assert d[k] > 0, k
    assert d["page_cache"]  # says how reads defeated the page cache
    assert not any((tmp_path / "g3").iterdir())  # bench directories removed
    bad = CliRunner().invoke(app, ["bench", "--tier", "g3", "--layout", "tiny"])
    assert bad.exit_code == 2 and "--path" in bad.output


def test_bench_vllm_tiers_json(tmp_path):
    # In the same process as the g3 bench above: NIXL's log handler was left pointing at that run's
    # (now closed) captured stream, and opening a NIXL engine used to fail flushing it.
    (tmp_path / "vt").mkdir()
    r = CliRunner().invoke(app, ["bench", "--tier", "vllm-tiers", "--path", str(tmp_path / "vt"), "--layout", "tiny",
                                 "--blocks", "32", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output[r.output.index("{"):])
    assert TIER_KEYS <= set(d)
    # what the plot's panel title and the JSON's readers need (tier, the engine our tier ran, I/Os in flight)
    assert d["tier"] == "vllm-tiers" and d["engine"] in ("nixl", "posix") and d["inflight"] == 8
    assert all(d[k] > 0 for k in TIER_KEYS)
    # the same-durability ratio compares like with like: no flush on either side, same O_DIRECT choice
    assert d["same_durability"] and d["vllm_fs_o_direct"] == d["ours_nofsync_o_direct"] == d["ours_o_direct"]
    assert d["write_ratio_same_durability"] > 0
    # every chunk read back and compared, ours included: its loads' deadline is not the 5 s serving default, which a
    # busy machine turned into failed loads (ours_read_verified false)
    assert d["vllm_fs_read_verified"] and d["ours_read_verified"] and d["ours_nofsync_read_verified"], d
    assert "no fsync" in d["durability"]["vllm_fs"] and "fdatasync" in d["durability"]["ours"]
