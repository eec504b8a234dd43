"""``kvbm-backend g4 migrate`` against a store that answers "slow down" (S3 ``503 SlowDown``, 2026-12-03).

Before, a :class:`~kvbm_backend.pool.g4.store.StoreThrottled` in either pass (the header checks, the renames) was one
error per object and the run went on with the next object at once: a store that asked for fewer requests got the
run's full rate, the run ended exit 1 with part of the blocks renamed and an error per throttled object (a throttled
listing page refused the run, exit 2). Now each throttled request is sent again after the G4 pool's full-jitter
backoff (:mod:`kvbm_backend.pool.g4.throttle`), up to ``--throttle-attempts`` tries; a store still throttling then
stops the run there (``stopped_throttled``: the store, the error, the phase, how many were renamed and left; one
``error:`` line; exit 5), and a rerun finishes.

A real SeaweedFS server behind loopback proxies that throttle as S3 does (``tests/helpers/throttle_proxy.py``);
``--throttle-attempts 3`` keeps each throttled request's backoff under 0.15 s (50 ms, then 100 ms, full jitter)."""
from __future__ import annotations

import json
from urllib.parse import urlparse

from typer.testing import CliRunner

from kvbm_backend.apps.cli import app
from tests.helpers.g4_migrate import legacy_left, legacy_store, readable
from tests.helpers.throttle_proxy import ThrottleProxy

N = 8  # blocks under format 1 names
FANOUT = 16
ATTEMPTS = 3  # --throttle-attempts in these tests: two backoffs (<= 50 ms, <= 100 ms) per throttled request


class ThrottleFrom(ThrottleProxy):
    """A :class:`ThrottleProxy` that also throttles every request of ``method`` (``"LIST"``: listing pages) once
    ``after`` of them passed: a store that keeps throttling from some point of the run on."""

    def __init__(self, host: str, port: int, method: str, after: int):
        super().__init__(host, port)
        self.method, self.after, self.passed = method, after, 0

    def _throttle(self, method: str, path: str, kind: str) -> bool:
        if super()._throttle(method, path, kind):
            return True
        asked = "LIST" if kind == "list" else method if kind == "object" else None
        with self._mu:
            if asked != self.method or self.passed < self.after:
                self.passed += asked == self.method
                return False
            self.throttled += 1
            return True


def _proxy(seaweed, cls=ThrottleProxy, **kw):
    u = urlparse(seaweed.endpoint)
    return cls(u.hostname, u.port, **kw)


def _migrate(url, endpoint, *extra):
    r = CliRunner().invoke(app, ["g4", "migrate", "--url", url, "--endpoint-url", endpoint, "--unkeyed",
                                 "--dir-fanout", str(FANOUT), "--throttle-attempts", str(ATTEMPTS), "--json", *extra])
    return r.exit_code, r.stdout, r.stderr


def _stopped(code, out, err, url, phase: str, renamed: int, left: int | None) -> dict:
    """The report of a run a throttling store stopped, checked: exit 5, ``stopped_throttled`` naming the store, the
    phase, ``renamed`` and ``left``, no error counted, one ``error:`` line saying so."""
    assert code == 5, (code, out, err)  # old code: exit 1 (an error per throttled object) or 2 (listing)
    res = json.loads(out)
    stop = res["stopped_throttled"]
    assert (res["migrated"], res["errors"], res["stopped_full"], res["stopped_unavailable"]) == (renamed, 0, None,
                                                                                                 None), out
    assert (stop["url"], stop["phase"], stop["attempts"], stop["renamed"], stop["not_renamed"]) == (
        url, phase, ATTEMPTS, renamed, left), stop
    assert "SlowDown" in stop["error"] or "throttled" in stop["error"], stop
    line = " ".join(err.split())
    assert f"{url} still throttled" in line and f"after {ATTEMPTS} tries" in line, err
    if left is not None:  # a dry run's line says it wrote nothing (before 2026-12-03: a real run's line)
        assert (f"{renamed} would be renamed before it, {left} from it on not checked (a dry run: nothing written)"
                if res["dry_run"] else f"{renamed} renamed before it, {left} left under their old names") in line, err
    assert [ln.startswith("error:") for ln in err.splitlines()] == [True], err  # one line, not one per object
    return res


def _object_requests(proxy: ThrottleProxy, method: str) -> int:
    return proxy.requests[(method, "object")]


def test_migrate_retries_throttled_requests_after_a_backoff_and_renames_every_block(seaweed, s3_prefix, tmp_path):
    """The first request of each (method, object) is answered ``503 SlowDown`` (the header read, the copy's PUT, the
    source's DELETE): each is sent again after a backoff and every block is renamed, exit 0, no error, the throttled
    answers counted. Old code: every header read throttled was an error, exit 1, nothing renamed."""
    url = seaweed.url(s3_prefix)
    objs = legacy_store(tmp_path, url, seaweed.endpoint, N, FANOUT)
    proxy = _proxy(seaweed, first_n=1)
    proxy.methods = {"GET", "HEAD", "PUT", "DELETE"}
    try:
        code, out, err = _migrate(url, proxy.endpoint)
        res = json.loads(out)
        assert code == 0, (code, out, err)  # old code: 1
        assert (res["migrated"], res["errors"], res["stopped_throttled"]) == (N, 0, None), out
        assert res["throttled"] == proxy.throttled >= 3 * N, (res["throttled"], proxy.throttled)
    finally:
        proxy.close()
    assert legacy_left(url, seaweed.endpoint, objs) == []
    assert readable(url, seaweed.endpoint, N, FANOUT) == [True] * N


def test_migrate_stops_where_the_store_keeps_throttling_and_a_rerun_finishes(seaweed, s3_prefix, tmp_path):
    """Every DELETE after the 3rd throttled: the run renames 3, then stops at the 4th source (its copy landed, its
    DELETE refused ``ATTEMPTS`` times) and sends nothing more: exit 5, 3 renamed, 5 left under their old names byte for
    byte. A rerun once the store answers renames the rest (the landed copy ``already_present``). Old code: every later
    DELETE throttled was an error (exit 1) and the run went on PUTting copies."""
    url = seaweed.url(s3_prefix)
    objs = legacy_store(tmp_path, url, seaweed.endpoint, N, FANOUT)
    proxy = _proxy(seaweed, ThrottleFrom, method="DELETE", after=3)
    try:
        code, out, err = _migrate(url, proxy.endpoint)
        res = _stopped(code, out, err, url, "rename", 3, N - 3)
        old = sorted(objs)
        assert res["stopped_throttled"]["at"] in old, res
        assert (_object_requests(proxy, "DELETE"), _object_requests(proxy, "PUT")) == (3 + ATTEMPTS, 4), proxy.requests
        assert res["throttled"] == proxy.throttled == ATTEMPTS, res
    finally:
        proxy.close()
    assert len(legacy_left(url, seaweed.endpoint, objs)) == N - 3
    assert sum(readable(url, seaweed.endpoint, N, FANOUT)) == 4  # the one it stopped at has its copy: served already

    code, out, err = _migrate(url, seaweed.endpoint)
    rerun = json.loads(out)
    assert code == 0, (code, out, err)
    assert (rerun["migrated"], rerun["already_present"], rerun["errors"], rerun["stopped_throttled"]) == (
        N - 4, 1, 0, None), out
    assert legacy_left(url, seaweed.endpoint, objs) == [] and readable(url, seaweed.endpoint, N, FANOUT) == [True] * N


def test_migrate_throttled_before_its_first_write_stops_with_nothing_written(seaweed, s3_prefix, tmp_path):
    """A store throttling every listing page: exit 5, ``phase`` ``list``, nothing renamed (old code: exit 2, no
    report). One throttling every header read from the 3rd on: the header checks stop at the 3rd object (``check``),
    no PUT or DELETE sent, every source in place (old code: an error per object, exit 1). A dry run stops the same
    way. Then a run finishes."""
    url = seaweed.url(s3_prefix)
    objs = legacy_store(tmp_path, url, seaweed.endpoint, N, FANOUT)
    proxy = _proxy(seaweed, ThrottleFrom, method="LIST", after=0)
    try:
        code, out, err = _migrate(url, proxy.endpoint)
        res = _stopped(code, out, err, url, "list", 0, None)
        assert res["stopped_throttled"]["at"] is None and "while listing: nothing renamed" in " ".join(err.split())
        assert proxy.lists() == ATTEMPTS, proxy.requests
    finally:
        proxy.close()
    for extra in ((), ("--dry-run",)):
        proxy = _proxy(seaweed, ThrottleFrom, method="GET", after=2)
        try:
            code, out, err = _migrate(url, proxy.endpoint, *extra)
            res = _stopped(code, out, err, url, "check", 0, N)
            assert res["dry_run"] == bool(extra) and res["stopped_throttled"]["at"] in objs, res
            assert _object_requests(proxy, "GET") == 2 + ATTEMPTS, proxy.requests
            assert _object_requests(proxy, "PUT") == _object_requests(proxy, "DELETE") == 0, proxy.requests
        finally:
            proxy.close()
    assert legacy_left(url, seaweed.endpoint, objs) == sorted(objs)

    code, out, err = _migrate(url, seaweed.endpoint)
    assert code == 0 and json.loads(out)["migrated"] == N, (code, out, err)
    assert legacy_left(url, seaweed.endpoint, objs) == [] and readable(url, seaweed.endpoint, N, FANOUT) == [True] * N


def test_throttle_attempts_below_one_is_refused(seaweed, s3_prefix):
    """``--throttle-attempts 0`` is one ``error:`` line naming it, exit 2, before the store is asked anything."""
    url = seaweed.url(s3_prefix)
    r = CliRunner().invoke(app, ["g4", "migrate", "--url", url, "--endpoint-url", seaweed.endpoint, "--unkeyed",
                                 "--throttle-attempts", "0"])
    assert r.exit_code == 2 and "--throttle-attempts: must be >= 1 (got 0)" in r.stderr, (r.exit_code, r.stderr)

