"""The hand-off mismatch WARNINGs' per-field budget (:class:`kvbm_backend.integrations.vllm.handoff_ident.PairBudget`)
through the decode side's real :func:`~kvbm_backend.integrations.vllm.handoff.expected_blocks` and a real
:class:`~kvbm_backend.log_limits.LimitedLog` on a fake clock (seconds; the field's line is due once a minute).

Review (b51c685): past a field's 256 first-sight lines its pairs went into a 1,024-slot reservoir where a pair seen
twice was never evicted, so a client sending each forged value twice filled it for good and a real misconfiguration
starting later was never named; the minute line's "M pairs new to it" counted a pair the reservoir turned away again at
each repeat; and a held pair kept its client-chosen request id whole. Now a Space-Saving summary (k counters: a pair
above 1/k of the mismatches between two lines is always held) with bounded entries, distinct pairs counted exactly up
to 4,096, and a named pair quiet for an hour.
"""
from __future__ import annotations

import logging
import re
from types import SimpleNamespace

from kvbm_backend.integrations.vllm import handoff, handoff_ident
from kvbm_backend.integrations.vllm.handoff import KEY
from kvbm_backend.log_limits import LimitedLog

BS = 16
REAL = "a" * 16
OURS = {"namespace": "ns", "tenant": "b" * 16}


class Field:
    """The tenant field's mismatches on a fake clock: ``ask`` one decode request, the WARNING lines it logged kept
    with the clock's time in ``lines``."""

    def __init__(self, monkeypatch, caplog, budget: handoff_ident.PairBudget | None = None) -> None:
        self.now = [0.0]
        self.caplog = caplog
        self.lines: list[tuple[float, str]] = []
        monkeypatch.setattr(handoff, "LOG", LimitedLog(handoff.log, clock=lambda: self.now[0]))
        monkeypatch.setattr(handoff_ident, "_warned_pairs", {"tenant": budget or handoff_ident.PairBudget()})

    @property
    def budget(self) -> handoff_ident.PairBudget:
        return handoff_ident._warned_pairs["tenant"]

    def ask(self, rid: str, tenant: str) -> None:
        req = SimpleNamespace(request_id=rid, kv_transfer_params={KEY: {
            "blocks": 2, "block_size": BS, "namespace": "ns", "tenant": tenant}})
        n_before = len(self.caplog.records)
        assert handoff.expected_blocks(req, BS, OURS) is None
        self.lines.extend((self.now[0], r.getMessage()) for r in self.caplog.records[n_before:])

    def first_sights(self) -> None:
        """Use up the field's first-sight lines (pairs nobody sends again)."""
        for i in range(handoff_ident.FIRST_PAIRS):
            self.ask(f"s{i}", f"s{i:015x}")


def _flood(monkeypatch, caplog, repeats: int) -> list[tuple[float, str]]:
    """10 minutes of 3,000 distinct forged tenant tags a minute, each sent ``repeats`` times; from minute 2 the real
    misconfiguration, 30 requests a minute."""
    f = Field(monkeypatch, caplog)
    n = 0
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.handoff"):
        for minute in range(10):
            for i in range(3000):
                n += 1
                for k in range(repeats):  # each forged tenant tag sent `repeats` times
                    f.ask(f"f{n}-{k}", f"{n:016x}")
                if minute >= 2 and i % 100 == 50:  # the real misconfiguration starts in minute 2: 30 a minute
                    f.ask(f"r{n}", REAL)
            f.now[0] += 61.0
        f.ask("late", f"{n + 1:016x}")
    return f.lines


def test_control_forged_values_sent_once_the_real_pair_is_named(monkeypatch, caplog):
    lines = _flood(monkeypatch, caplog, repeats=1)
    assert [t for t, m in lines if REAL in m], "control: the real pair should be named"


def test_forged_values_each_sent_twice_never_lock_out_a_real_pair(monkeypatch, caplog):
    """Old code: every reservoir slot held a forged pair seen twice (never evicted) and the real pair, starting in
    minute 2, never got in: not named in 8 minutes (240 hand-offs amid 48,000 forged requests)."""
    lines = _flood(monkeypatch, caplog, repeats=2)
    named = [t for t, m in lines if REAL in m]
    assert named, "real misconfiguration never named in 8 minutes (240 hand-offs)"
    assert named[0] <= 2 * 61.0 + 2 * 61.0, named  # started in minute 2: named by minute 4's line at the latest


def test_the_minute_line_counts_pairs_new_to_it_once_each(monkeypatch, caplog):
    """The field's minute line says "N mismatches of M pairs new to it had none". Old code counted a pair in the
    reservoir's ``arrivals`` each time it was not held, so a pair the sample had turned away was "new" again at each
    repeat: 2,000 distinct pairs sent twice each were reported as ~2,977 new pairs."""
    f = Field(monkeypatch, caplog)
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.handoff"):
        for i in range(handoff_ident.FIRST_PAIRS + 1):  # the first-sight lines, then the field's first minute line
            f.ask(f"s{i}", f"{i:016x}")
        caplog.clear()
        for i in range(2000):  # 2,000 distinct pairs, each twice, within the minute
            for k in range(2):
                f.ask(f"f{i}-{k}", f"{10**6 + i:016x}")
        f.now[0] += 61.0
        f.ask("late", f"{2 * 10**6:016x}")
    (line,) = [r.getMessage() for r in caplog.records]
    said = line.split("since its last line ")[1].split(" had none")[0]
    assert said == "4001 mismatches of 2001 pairs new to it", said


def test_past_4096_distinct_pairs_the_minute_line_says_about_how_many(monkeypatch, caplog):
    """Distinct pairs past :data:`~kvbm_backend.integrations.vllm.handoff_ident.DISTINCT_EXACT` are an estimate
    (bounded memory), said "about"; it is within 10 % of the truth (12,000 pairs, each sent twice)."""
    f = Field(monkeypatch, caplog)
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.handoff"):
        f.first_sights()
        f.ask("open", "0" * 16)  # the field's first minute line
        caplog.clear()
        for i in range(12000):
            for k in range(2):
                f.ask(f"f{i}-{k}", f"{10**6 + i:016x}")
        f.now[0] += 61.0
        f.ask("late", "f" * 16)
    (line,) = [r.getMessage() for r in caplog.records]
    m = re.search(r"since its last line (\d+) mismatches of about (\d+) pairs new to it had none", line)
    assert m is not None, line
    assert int(m[1]) == 24001 and abs(int(m[2]) - 12001) < 1200, m.groups()


def test_forged_values_each_sent_three_times_a_real_pair_of_1_in_500_is_named_within_2_minutes(monkeypatch, caplog):
    """Forged tenant tags each sent 3 times in a row (each one's count - error 3 in the summary, the most a forged pair
    reaches) at 10,000 mismatches a minute, for 3 minutes; then the real pair joins as 1 in 500 of the mismatches. The
    field's minute line names it within 2 minutes of its first request (old code: the reservoir filled with forged
    pairs seen more than once, never evicted: never named)."""
    f = Field(monkeypatch, caplog)
    step = 60.0 / 10000  # 10,000 mismatches a minute
    start = 3 * 60.0
    n = 0
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.handoff"):
        f.first_sights()
        while f.now[0] < start + 4 * 60.0:
            n += 1
            if f.now[0] >= start and n % 500 == 0:
                f.ask(f"r{n}", REAL)
            else:
                f.ask(f"f{n}", f"{n // 3:016x}")  # each forged value 3 times in a row
            f.now[0] += step
    named = [(t, m) for t, m in f.lines if REAL in m]
    assert named, "the real pair was never named"
    t, m = named[0]
    assert t - start <= 120.0, (t - start, m)
    assert "seen more than once, likely a misconfiguration" in m and f"prefilled under '{REAL}'" in m, m
    assert len(named) == 1, named  # then quiet for the hour (NAMED_QUIET_S)


def test_a_held_pair_keeps_bounded_values_and_request_id(monkeypatch, caplog):
    """A client-chosen request id of 10,000 characters and a forged value of 100,000: the minute line names the pair
    with its last request id cut to 64 characters and its value to 80 (old code kept and logged the id whole)."""
    f = Field(monkeypatch, caplog)
    long_rid = "R" * 10000
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.handoff"):
        f.first_sights()
        f.ask("open", "0" * 16)  # the field's first minute line
        for i in range(3):
            f.ask(long_rid + str(i), "x" * 100000)
        f.now[0] += 61.0
        f.ask("late", "f" * 16)
    (line,) = [m for t, m in f.lines if "late" in m]
    last = line.split("(3 requests, last ")[1].split(")")[0]
    assert len(last) <= 64 and last.startswith("RRRR"), len(last)
    assert "RRRR" * 20 not in line.replace(last, "")
    shown = line.split("seen more than once, likely a misconfiguration: prefilled under ")[1].split(", this engine")[0]
    assert len(shown) <= 80, shown


def test_a_named_pair_is_named_again_after_the_quiet_hour(monkeypatch, caplog):
    """A pair a minute line named is left out of the field's lines for an hour (each mismatch still counted), then
    named again if it still recurs (old code: never again)."""
    now = [0.0]
    budget = handoff_ident.PairBudget()
    budget.clock = lambda: now[0]  # one clock for the limiter and the budget
    f = Field(monkeypatch, caplog, budget)
    f.now = now
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.handoff"):
        f.first_sights()
        f.ask("open", "0" * 16)  # the field's first minute line
        for minute in range(70):
            for i in range(3):
                f.ask(f"r{minute}-{i}", REAL)
                f.ask(f"f{minute}-{i}", f"{10**6 + 3 * minute + i:016x}")
            now[0] += 61.0
    named = [t for t, m in f.lines if REAL in m]
    assert len(named) == 2 and named[1] - named[0] >= 3600.0, named
