"""``kvbm-backend bench`` baselines are the storage's limit, measured in the same run on the same bytes: the
best of a threads x I/O size sweep over every directory at once, whatever the pool's knobs (g3, the engines
comparison), the G4 file store's own whole-object I/O (g4 file://); the plot labels the baseline from the
JSON."""
from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from kvbm_backend.apps.cli import app


def _bench(*args: str) -> dict:
    r = CliRunner().invoke(app, ["bench", "--layout", "tiny", "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _knobs(sweep: dict) -> list[tuple]:
    return [(p["threads"], p["io_size"], p["total_bytes"]) for p in sweep["points"]]


def _check_best(d: dict) -> None:
    """The baseline is the best measured point of each direction, and the ratios are against it."""
    sw = d["baseline_sweep"]
    for what in ("write", "read"):
        best = max(g for p in sw["points"] for g in p[f"{what}_gbps_runs"])
        assert d[f"baseline_{what}_gbps"] == best == sw[f"best_{what}"]["gbps"]
        assert d[f"{what}_ratio"] == pytest.approx(d[f"{what}_gbps"] / best)


def test_g3_baseline_is_a_sweep_over_every_path_whatever_the_pool_knobs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    default = _bench("--tier", "g3", "--path", f"{a},{b}", "--blocks", "16")
    knobs = _bench("--tier", "g3", "--path", f"{b},{a}", "--blocks", "16", "--threads", "1", "--io-size", "4096")
    assert knobs["inflight"] == 1 and knobs["io_size_bytes"] == 4096  # the pool's knobs did change
    for d in (default, knobs):
        sw = d["baseline_sweep"]
        assert sorted(sw["directories"]) == sorted([str(a), str(b)])  # every --path at once
        threads = {p["threads"] for p in sw["points"]}
        sizes = {p["io_size"] for p in sw["points"]}
        assert {1, 4} <= threads and d["slot_bytes"] in sizes and len(sizes) >= 2
        assert all(p["write_gbps_runs"] and p["read_gbps_runs"] for p in sw["points"])  # every point measured
        _check_best(d)
        assert d["baseline"] and "every --path" in d["baseline"]
    assert _knobs(default["baseline_sweep"]) == _knobs(knobs["baseline_sweep"])  # not the pool's knobs
    assert not any(a.iterdir()) and not any(b.iterdir())


def test_odirect_baseline_writes_the_same_share_in_every_directory(tmp_path, monkeypatch):
    from kvbm_backend.apps.bench import baseline
    dirs = [str(tmp_path / "x"), str(tmp_path / "y")]
    for d in dirs:
        os.mkdir(d)
    sizes: dict[str, int] = {}
    real_unlink = os.unlink

    def unlink(p):  # the size of each baseline file just before it is removed
        sizes[os.path.dirname(p)] = os.path.getsize(p)
        real_unlink(p)
    monkeypatch.setattr(baseline.os, "unlink", unlink)
    r = baseline.odirect_baseline(dirs, 8 * 65536, 65536, 4)
    assert r["directories"] == dirs and sizes == {d: 4 * 65536 for d in dirs}


def test_g4_file_baseline_is_the_store_io(tmp_path):
    store = tmp_path / "g4"
    store.mkdir()
    d = _bench("--tier", "g4", "--url", f"file://{store}", "--blocks", "8")
    assert d["io_size_bytes"] == d["object_bytes"]  # every object is written and read whole
    sw = d["baseline_sweep"]
    assert {p["object_bytes"] for p in sw["points"]} == {d["object_bytes"]}
    assert {p["threads"] for p in sw["points"]} == {1, 4, 8}  # 1/4/8/16 capped at the 8 objects
    _check_best(d)
    assert "file per object" in d["baseline"]
    assert not any(store.iterdir())


def test_engines_baseline_is_a_sweep_not_the_variants_settings(tmp_path):
    from kvbm_backend.apps.bench.engines import compare_engines
    out = compare_engines(str(tmp_path), 4 << 20, 64 << 10, 8, repeats=2, variants=("posix",))
    sw = out["baseline"]["sweep"]
    assert {p["threads"] for p in sw["points"]} >= {1, 4, 8, 16, 64}  # past the batched variant's depth
    assert {p["io_size"] for p in sw["points"]} == {64 << 10, 1 << 20, 4 << 20}
    best_w = max(g for p in sw["points"] for g in p["write_gbps_runs"])
    assert out["baseline"]["write_gbps_best"] == best_w
    assert out["posix"]["write_ratio_best"] == pytest.approx(out["posix"]["write_gbps_best"] / best_w)
    assert os.listdir(tmp_path) == []


def _legend(tmp_path, monkeypatch, result: dict) -> str:
    import matplotlib.figure

    from kvbm_backend.apps.report import plot_results
    seen: list[str] = []

    def savefig(fig, *_a, **_k):
        seen.extend(t.get_text() for t in fig.axes[0].get_legend().get_texts())
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    f = tmp_path / "r.json"
    f.write_text(json.dumps(result))
    plot_results([str(f)], str(tmp_path / "r.png"))
    return " ".join(" ".join(seen).split())


def test_plot_labels_the_baseline_from_the_json(tmp_path, monkeypatch):
    gbps = {"write_gbps": 1.0, "read_gbps": 2.0, "baseline_write_gbps": 1.5, "baseline_read_gbps": 2.5}
    s3 = _legend(tmp_path, monkeypatch, {"tier": "g4", **gbps, "baseline": "best of plain PUT/GET, same client"})
    assert "PUT/GET" in s3 and "O_DIRECT" not in s3
    buffered = _legend(tmp_path, monkeypatch, {"tier": "g3", **gbps, "baseline_o_direct": False})
    assert "buffered" in buffered and "O_DIRECT" not in buffered
    old = _legend(tmp_path, monkeypatch, {"tier": "g3", **gbps, "baseline_o_direct": True})
    assert "O_DIRECT baseline" in old

