"""The ``reason`` labels of ``kvbm_backend_<tier>_offloads_dropped`` / ``_load_misses`` / ``_corrupt_blocks``:
each tier's list (``REASONS`` in kvbm_backend/pool/g3/catalog.py and kvbm_backend/pool/g4/events.py) is what
docs/operations.md documents, every listed series exists at 0 from a pool's start (an alert sees 0, not "no
data"), real pools move them, and a reason a list lacks is counted, logged once and fails the test run
(tests/conftest.py ``pytest_sessionfinish``)."""
from __future__ import annotations

import logging
import re
from types import SimpleNamespace

from prometheus_client import generate_latest

from kvbm_backend import metrics
from kvbm_backend.config import G4Config
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model import frame
from kvbm_backend.pool.g3 import G3Pool, catalog
from kvbm_backend.pool.g4 import events
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.crash_writer import LAYOUT, NS, config, payload
from tests.helpers.g4_writer import namespace as g4_namespace
from tests.helpers.paths import REPO

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
SERIES = {"offloads_dropped": "offloads_dropped_total", "misses": "load_misses_total", "corrupt": "corrupt_blocks_total"}
TIERS = {"g3": catalog.REASONS, "g4": events.REASONS}


def _code_reasons() -> set[tuple[str, str]]:
    """{(series, reason)} the code lists, e.g. ``("kvbm_backend_g3_offloads_dropped_total", "enospc")``."""
    return {(f"kvbm_backend_{tier}_{SERIES[attr]}", r) for tier, reasons in TIERS.items()
            for attr, listed in reasons.items() for r in listed}


def test_docs_list_exactly_each_tiers_reasons():
    rows = re.findall(r"^\| `(kvbm_backend_g[34]_\w+_total)` \| `(\w+)` \| (.+?) \|$",
                      (REPO / "docs" / "operations.md").read_text(), re.M)
    documented = {(s, r) for s, r, _ in rows}
    assert len(documented) == len(rows), "a reason documented twice"
    assert all(meaning.strip() for _, _, meaning in rows)
    assert documented == _code_reasons(), (sorted(documented - _code_reasons()), sorted(_code_reasons() - documented))
    for reasons in TIERS.values():  # one line each, every counter of the tier listed
        assert set(reasons) == set(SERIES) and all(m and "\n" not in m for d in reasons.values() for m in d.values())


def test_every_literal_reason_in_the_code_is_listed():
    """The reasons written out at the call sites (variables such as ``journal_reason``, ``prove_bad``'s result or
    ``FrameError.reason`` are checked by the whole suite instead: tests/conftest.py)."""
    pkg = REPO / "kvbm_backend" / "pool"
    g3 = "\n".join(p.read_text() for p in sorted((pkg / "g3").rglob("*.py")))
    for kind, r in re.findall(r"\.(drop|miss|_finish_job_dropped)\((?:job, )?\"(\w+)\"", g3):
        assert r in (catalog.MISS_REASONS if kind == "miss" else catalog.DROP_REASONS), (kind, r)
    # drop reasons the writer and the journal hold in variables: `reason, room = "closed", 0`, `... else "io_error"`
    held = [ln for ln in (pkg / "g3" / "writer.py").read_text().splitlines() if re.match(r"\s*reason(, room)? = ", ln)]
    held += [ln for ln in g3.splitlines() if "self.journal_reason = " in ln]
    found = set(re.findall(r"(?:= |else )\"(\w+)\"", "\n".join(held)))
    assert {"closed", "queue_full", "degraded", "enospc", "io_error", "journal_error"} <= found  # the pattern works
    assert found <= set(catalog.DROP_REASONS), found - set(catalog.DROP_REASONS)
    assert set(catalog._MISS_REASON.values()) | {"corrupt"} <= set(catalog.MISS_REASONS)
    g4 = "\n".join(p.read_text() for p in sorted((pkg / "g4").glob("*.py")))
    found = re.findall(r"\"(dropped|miss|corrupt)_(\w+)\"", g4)
    assert {"unsettled", "no_key", "keyring_unavailable"} <= {r for _, r in found}  # the pattern finds them
    for kind, r in found:
        assert r in {"dropped": events.DROP_REASONS, "miss": events.MISS_REASONS}.get(kind, events.CORRUPT_REASONS), \
            (kind, r)


def _page(reg) -> str:
    return generate_latest(reg).decode()


def test_fresh_pools_show_every_listed_reason_at_zero(tmp_path):
    reg = metrics.new_registry()
    g3 = G3Pool(config(tmp_path / "g3"), NS, registry=reg)
    g4 = G4Pool(G4Config(url=f"file://{tmp_path / 'g4'}", encrypt=False), g4_namespace(), registry=reg)
    try:
        page = _page(reg)
    finally:
        g4.close(timeout=HANG_S)
        g3.close()
    missing = [f'{s}{{reason="{r}"}}' for s, r in sorted(_code_reasons()) if f'{s}{{reason="{r}"}} 0.0' not in page]
    assert not missing, missing


def _v(reg, series: str, reason: str) -> float | None:
    return metrics.sample_value(reg, series, {"reason": reason})


def test_a_real_g3_pool_moves_its_drop_miss_and_corrupt_series(tmp_path):
    """Real slab files: a header byte and a payload byte flipped on disk, a key never stored, a put after close."""
    reg = metrics.new_registry()
    drop, miss, bad = (f"kvbm_backend_g3_{SERIES[a]}" for a in ("offloads_dropped", "misses", "corrupt"))
    pool = G3Pool(config(tmp_path), NS, registry=reg)
    try:
        keys = NS.keys(range(1, 5))
        assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S).written == 4
        for series, r in ((miss, "corrupt"), (miss, "absent"), (bad, "magic"), (bad, "integrity"), (drop, "closed")):
            assert _v(reg, series, r) == 0, (series, r)  # there before the first event
        slot = frame.slot_bytes(LAYOUT.bytes_per_block)
        for k, off in ((keys[0], 0), (keys[1], frame.HEADER_BYTES + 100)):  # magic; payload
            f, s = pool.index.get(k)
            with open(pool.slabs.by_index[f].path, "r+b") as fh:
                fh.seek(s * slot + off)
                b = fh.read(1)
                fh.seek(s * slot + off)
                fh.write(bytes([b[0] ^ 0x40]))
        asked = keys + NS.keys([99])
        got = pool.get(asked, [aligned_empty(LAYOUT.bytes_per_block) for _ in asked]).result(timeout=HANG_S)
        assert got.ok == [False, False, True, True, False]
    finally:
        pool.close()
    late = NS.keys([50, 51])
    assert pool.put(late, [payload(k.seq_hash) for k in late]).result(timeout=HANG_S).dropped == 2
    assert (_v(reg, miss, "corrupt"), _v(reg, miss, "absent")) == (2, 1)
    assert (_v(reg, bad, "magic"), _v(reg, bad, "integrity"), _v(reg, drop, "closed")) == (1, 1, 2)
    page = _page(reg)
    assert f'{drop}{{reason="closed"}} 2.0' in page and f'{miss}{{reason="absent"}} 1.0' in page
    assert f'{drop}{{reason="enospc"}} 0.0' in page  # the rest stay at 0


def test_a_closed_g4_pool_counts_dropped_and_missed_closed(tmp_path):
    reg = metrics.new_registry()
    ns = g4_namespace()
    pool = G4Pool(G4Config(url=f"file://{tmp_path / 'g4'}", encrypt=False), ns, registry=reg)
    pool.close(timeout=HANG_S)
    k = ns.keys([1], tenant="t")
    bpb = ns.layout.bytes_per_block
    assert pool.put(k, [aligned_empty(bpb)]).result(timeout=HANG_S).dropped == 1
    assert pool.get(k, [aligned_empty(bpb)]).result(timeout=HANG_S).ok == [False]
    assert _v(reg, "kvbm_backend_g4_offloads_dropped_total", "closed") == 1
    assert _v(reg, "kvbm_backend_g4_load_misses_total", "closed") == 1
    assert _v(reg, "kvbm_backend_g4_load_misses_total", "absent") == 0


def test_an_unlisted_reason_is_counted_logged_once_and_fails_the_run(caplog):
    import tests.conftest as suite
    reg = metrics.new_registry()
    c = metrics.counter("kvbm_backend_g3_test_reasons", "test", ("reason",), reg)
    key = ("kvbm_backend_g3_test_reasons", "not_a_reason")
    try:
        with caplog.at_level(logging.WARNING, logger="kvbm_backend.metrics"):
            metrics.count_reason(c, catalog.DROP_REASONS, "not_a_reason", 2)
            metrics.count_reason(c, catalog.DROP_REASONS, "not_a_reason")
            metrics.count_reason(c, catalog.DROP_REASONS, "queue_full")
        assert metrics.sample_value(reg, "kvbm_backend_g3_test_reasons_total", {"reason": "not_a_reason"}) == 3
        assert [r.getMessage() for r in caplog.records if "not_a_reason" in r.getMessage()] == [
            "kvbm_backend: kvbm_backend_g3_test_reasons counted reason 'not_a_reason', which its tier's list of "
            "reasons lacks (a bug: alerts and docs/operations.md do not know it)"]
        assert key in metrics.UNLISTED and len(caplog.records) == 1
        session = SimpleNamespace(exitstatus=0, config=SimpleNamespace(
            pluginmanager=SimpleNamespace(get_plugin=lambda name: None)))
        suite.pytest_sessionfinish(session, 0)
        assert session.exitstatus == 1  # the session check fails such a run
    finally:
        metrics.UNLISTED.discard(key)  # this one was on purpose
