"""Every counter the pools count is in docs/operations.md: on ``/metrics`` (a series of its own, or a reason of
the ``offloads_dropped`` / ``load_misses`` / ``corrupt_blocks`` series: tests/core/test_metric_reasons.py), else a
row of the table "Counters in `stats()` / `stats_path` / gc output, not on `/metrics`" that names its tier
(``G4 `stats()``` / ``G3 `stats()```); and every G3 counter counted is reported by ``stats()``. Every counter of the
vLLM connector (the top level of ``stats_path``: names given to ``stats.add``) is in a row whose "where" says
``stats_path`` (top level), and every name such a row gives is counted.

The names are read from the code (its syntax tree), so a counter added without its row fails here: before
2026-12-04 ``namespace_json_errors``, ``unsettled_puts``, ``lookup_timeout`` and a dozen more were counted and
named nowhere in the table, and G3 counted ``duplicate_keys`` that no ``stats()`` reported; of the connector's 103
counter names (an f-string's family once) 83 were in no row, 49 of them (``save_blocks``, ``load_jobs``,
``lookup_timeouts``, the ``g3_put_*`` / ``g4_put_*`` and ``kv_events_*`` counters, most ``announce_*``, ...) named
nowhere in docs/operations.md."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
from prometheus_client import generate_latest

from kvbm_backend import metrics
from kvbm_backend.pool.g3 import lock_bounded
from kvbm_backend.pool.g4.events import REASONS, G4Counters
from tests.helpers.crash_writer import NS, open_pool, payload
from tests.helpers.paths import REPO

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do
FAMILY = "<...>"  # a counter name's variable part: ``f"throttled_{op}"`` -> ``throttled_<...>``
# G4 counters G4Counters._export mirrors into a series of their own (kvbm_backend/metrics.py's docstring lists them
# with their meanings), and the reason families (their reasons: the "Reasons" table, test_metric_reasons.py)
G4_ON_METRICS = {"written", "hits", "bytes_written", "bytes_read", "throttled_" + FAMILY}
G4_REASON_PREFIXES = ("dropped_", "miss_", "corrupt_")
# G3 counters on /metrics: kvbm_offload_blocks_h2d / kvbm_onboard_blocks_d2d / kvbm_backend_g3_bytes_* /
# kvbm_backend_g3_evictions, and the sums over a reason series' reasons (offloads_dropped, misses, corrupt)
G3_ON_METRICS = {"offloads_written", "hits", "bytes_written", "bytes_read", "evictions", "offloads_dropped",
                 "misses", "corrupt"}
G3_REASON_PREFIXES = ("dropped:", "miss:", "corrupt:", "restore:")  # restore: restore_dropped_by_reason
# the connector's rows: their "where" starts so (the top level of the stats_path JSON)
CONNECTOR_WHERE = "`stats_path` (top level"
# the values of a connector counter's leading variable part: offloads.put_all's f"{tier}_put_..." (its puts' tiers)
CONNECTOR_PREFIXES = ("g3", "g4")


def _table() -> dict[str, str]:
    """The counters table of docs/operations.md: counter name (each backticked name of a row's first column;
    ``unconfirmed_<reason>`` as ``unconfirmed_<...>``; not the values listed in parentheses after a name, as
    ``(`magic`, `integrity`, ...)``) -> the "where" columns of its rows (a name both tiers count, ``deleted``, has a
    row for each)."""
    text = (REPO / "docs" / "operations.md").read_text()
    start = text.index("**Counters in `stats()`")
    lines = text[start:].splitlines()
    head = lines.index("| counter | where | counts |")
    rows: dict[str, str] = {}
    for ln in lines[head + 2:]:
        if not ln.startswith("|"):
            break
        m = re.match(r"^\| (.+?) \| (.+?) \| (.+) \|$", ln)
        assert m, ln
        for name in re.findall(r"`([\w<>]+)`", re.sub(r"\([^)]*\)", "", m.group(1))):
            name = re.sub(r"<\w+>$", FAMILY, name)
            rows[name] = f"{rows[name]} / {m.group(2)}" if name in rows else m.group(2)
    return rows


def _names(node: ast.AST | None) -> set[str]:
    """The counter names an expression can give: a string, either branch of a conditional, either side of an
    ``or``, an f-string's or a concatenation's fixed start with :data:`FAMILY` for the rest."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _names(node.body) | _names(node.orelse)
    if isinstance(node, ast.BoolOp):
        return set().union(*(_names(v) for v in node.values))
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return {f"{node.values[0].value}{FAMILY}"}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return {f"{n}{FAMILY}" for n in _names(node.left)}
    return set()  # a variable: its values are written out where it is set (reasons, checked by their own test)


def _trees(pkg: Path) -> list[ast.AST]:
    return [ast.parse(p.read_text(), str(p)) for p in sorted(pkg.rglob("*.py"))]


def _g4_counted() -> set[str]:
    """Every name the G4 pool's parts give its counters (:meth:`G4Counters.count`): ``self._count("x")``,
    ``counters.count("x", n)``, ``(count or self._count)("x")``, and the late settler's ``self._finish(u, "x")``."""
    found: set[str] = set()
    for tree in _trees(REPO / "kvbm_backend" / "pool" / "g4"):
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            f = node.func
            if isinstance(f, ast.BoolOp) and any(isinstance(v, ast.Attribute) and v.attr == "_count"
                                                 for v in f.values):
                found |= _names(node.args[0])
            elif isinstance(f, ast.Attribute) and f.attr == "_count":
                found |= _names(node.args[0])
            elif isinstance(f, ast.Attribute) and f.attr == "count" and "counters" in ast.unparse(f.value):
                found |= _names(node.args[0])
            elif isinstance(f, ast.Attribute) and f.attr == "_finish" and len(node.args) > 1:
                found |= _names(node.args[1])
    return found


def _g3_counted() -> set[str]:
    """Every name the G3 pool counts in its catalog's counters: ``cat.c["x"] += n``, ``cat.side["x"] += n``,
    ``c.update(x=n)``, ``cat.add_unlocked(x=n)``, a helper's ``_count(cat, "restore:...", ...)``, and the
    request lookup counters (:mod:`~kvbm_backend.pool.g3.lookup_defer`'s ``counts["x"] += n``)."""
    found: set[str] = set()
    for tree in _trees(REPO / "kvbm_backend" / "pool" / "g3"):
        for node in ast.walk(tree):
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Subscript):
                t = node.target.value
                if isinstance(t, ast.Attribute) and t.attr in ("c", "side", "counts"):
                    found |= _names(node.target.slice)
            elif isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "c"
                    for t in node.targets):
                for t in node.targets:
                    assert isinstance(t, ast.Subscript)
                    found |= _names(t.slice)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                f = node.func
                if f.attr == "add_unlocked" or (f.attr == "update" and isinstance(f.value, ast.Attribute)
                                                and f.value.attr in ("c", "side")):
                    found |= {k.arg for k in node.keywords if k.arg}
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_count":
                found |= _names(node.args[1]) if len(node.args) > 1 else set()
    return found


def _connector_counted() -> tuple[set[str], list[str]]:
    """Every name the vLLM connector gives its counters (:func:`kvbm_backend.integrations.vllm.stats.add`), and the
    calls whose names cannot be read here (a ``**`` of a variable: each must be written out, else a counter could
    hide). Forms: ``stats.add(x=n)``; ``stats.add(**{"x": n, NAME: n, f"x_{v}": n})`` (``NAME`` a module-level
    string, an f-string's variable parts :data:`FAMILY`); and :class:`~kvbm_backend.integrations.revoked_tenants.
    RevokedTenants`' ``self._count(x=n)``, its ``count``, which the connector's wiring gives ``stats.add``."""
    found: set[str] = set()
    unread: list[str] = []
    for p in sorted((REPO / "kvbm_backend" / "integrations").rglob("*.py")):
        tree = ast.parse(p.read_text(), str(p))
        consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                  for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = ast.unparse(node.func)
            if f != "stats.add" and not (f == "self._count" and p.name == "revoked_tenants.py"):
                continue
            for k in node.keywords:
                if k.arg is not None:
                    found.add(k.arg)
                    continue
                if not isinstance(k.value, ast.Dict) or None in k.value.keys:
                    unread.append(f"{p.name}:{node.lineno}")
                    continue
                for key in k.value.keys:
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        found.add(key.value)
                    elif isinstance(key, ast.Name) and key.id in consts:
                        found.add(consts[key.id])
                    elif isinstance(key, ast.JoinedStr):
                        found.add("".join(v.value if isinstance(v, ast.Constant) else FAMILY for v in key.values))
                    else:
                        unread.append(f"{p.name}:{node.lineno}")
    return found, unread


def _connector_rows() -> set[str]:
    """The names the connector's rows of the counters table give (a "where" of :data:`CONNECTOR_WHERE`)."""
    return {n for n, where in _table().items() if CONNECTOR_WHERE in where}


def _expand(name: str) -> set[str]:
    """The table names that document counter ``name``: itself (a trailing variable part too: the row names
    ``announce_ignored_<why>``, its values in parentheses); a leading one (``<...>_put_errors``) as each of
    :data:`CONNECTOR_PREFIXES`, all of which the table must name."""
    if name.startswith(FAMILY):
        return {v + name[len(FAMILY):] for v in CONNECTOR_PREFIXES}
    return {name}


def _undocumented(counted: set[str], tier: str, on_metrics: set[str], reason_prefixes: tuple[str, ...]):
    table = _table()
    where = f"{tier} `stats()`"
    return sorted(n for n in counted if n not in on_metrics and not n.startswith(reason_prefixes)
                  and where not in table.get(n, ""))


def test_the_patterns_find_the_counters():
    """The syntax-tree walks find counters of every form (else the checks below would pass on nothing)."""
    g4 = _g4_counted()
    assert {"namespace_json_errors", "written", "deleted", "unsettled_puts", "settled_late", "dropped_unsettled",
            "skipped_unservable", "deleted_unencrypted", "unconfirmed_unencrypted", "lookup_hits",
            "dropped_queue_full", "throttled_" + FAMILY, "unconfirmed_" + FAMILY} <= g4, g4
    g3 = _g3_counted()
    assert {"offloads_written", "journal_errors", "enospc", "write_errors", "puts_late", "device_hits",
            "restored_blocks", "duplicate_keys", "lookup_blocks", "lookups_deferred", "restore:" + FAMILY} <= g3, g3
    table = _table()
    assert "G4 `stats()`" in table["skipped_exists"] and "G3 `stats()`" in table["puts_late"]
    assert "kvbm-backend gc" in table["deleted_by"]
    conn, unread = _connector_counted()
    assert {"save_blocks", "load_jobs", "announce_poll_errors", "g3_revoked_purges", "save_g3_revoked_blocks",
            "load_failed_blocks_any_rank", "announce_ignored_" + FAMILY, FAMILY + "_put_written_blocks",
            "handoff_wait_s", "kv_events_idle_batches"} <= conn, conn
    assert not unread, f"connector counters passed in a form this test cannot read: {unread}"
    wiring = (REPO / "kvbm_backend" / "integrations" / "vllm" / "wiring.py").read_text()
    assert "count=stats.add)" in wiring  # RevokedTenants' self._count is the connector's stats.add


def test_every_g4_counter_counted_is_documented():
    missing = _undocumented(_g4_counted(), "G4", G4_ON_METRICS, G4_REASON_PREFIXES)
    assert not missing, f"G4 counters counted but in no G4 row of docs/operations.md's counters table: {missing}"
    listed = {r for reasons in REASONS.values() for r in reasons}
    for name in _g4_counted():
        if name.startswith(G4_REASON_PREFIXES) and not name.endswith(FAMILY):
            assert name.partition("_")[2] in listed, name


def test_every_connector_counter_counted_is_documented():
    """Each counter of the connector's ``stats_path`` (top level) is in a row that says so (before 2026-12-04 83 of
    its 103 names were in no row, 49 named nowhere in docs/operations.md)."""
    rows = _connector_rows()
    counted, _ = _connector_counted()
    missing = sorted(n for n in counted if not _expand(n) <= rows)
    assert not missing, ("connector counters counted but in no `stats_path` (top level) row of docs/operations.md's "
                         f"counters table: {missing}")


def test_every_connector_counter_documented_is_counted():
    """No connector row names a counter the connector never counts (a renamed or removed one)."""
    counted, _ = _connector_counted()
    names = set().union(*(_expand(n) for n in counted))
    stale = sorted(n for n in _connector_rows() if n not in names)
    assert not stale, f"`stats_path` (top level) rows of docs/operations.md name counters nothing counts: {stale}"


def test_g4_counters_said_to_be_on_metrics_move_a_series():
    """What :data:`G4_ON_METRICS` exempts from the table is on ``/metrics``: counting it moves a series."""
    for name in sorted(G4_ON_METRICS):
        reg = metrics.new_registry()
        c = G4Counters(metrics.TierMetrics("g4", registry=reg, reasons=REASONS), page_size=16)
        before = generate_latest(reg).decode()
        c.count(name.replace(FAMILY, "get"), 3)
        assert generate_latest(reg).decode() != before, name


def test_every_g3_counter_counted_is_reported_and_documented(tmp_path):
    counted = _g3_counted()
    with open_pool(tmp_path) as pool:
        st = pool.stats()
    plain = {n for n in counted if not n.startswith(G3_REASON_PREFIXES)}
    unreported = sorted(plain - set(st))
    assert not unreported, f"G3 counters counted that stats() never reports (lock_bounded._COUNTERS): {unreported}"
    assert set(lock_bounded._COUNTERS) <= counted
    missing = _undocumented(counted, "G3", G3_ON_METRICS, G3_REASON_PREFIXES)
    assert not missing, f"G3 counters counted but in no G3 row of docs/operations.md's counters table: {missing}"


def test_a_g3_get_naming_keys_twice_reports_duplicate_keys(tmp_path):
    """A real pool: keys repeated in one get are served from their first copy and counted in ``duplicate_keys``
    (before 2026-12-04 counted and never reported: ``stats()`` had no such key)."""
    with open_pool(tmp_path) as pool:
        keys = NS.keys(range(1, 6), tenant="t")
        assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S).written == 5
        asked = keys + [keys[2], keys[0], keys[0]]
        out = [np.zeros(NS.layout.bytes_per_block, np.uint8) for _ in asked]
        assert pool.get(asked, out).result(timeout=HANG_S).ok == [True] * 8
        assert np.array_equal(out[6], payload(keys[0].seq_hash))
        st = pool.stats()
    assert st["duplicate_keys"] == 3 and st["hits"] == 8, st
