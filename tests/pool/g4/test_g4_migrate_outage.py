"""``kvbm-backend g4 migrate`` when the store goes down part way (2026-12-03). Before, a
:class:`~kvbm_backend.pool.g4.store.StoreUnavailable` in the middle of the run was re-raised and the CLI exited 2
("refused run, nothing written") with no report, although objects had been renamed already: the operator learnt
neither that anything was written nor how far it got. Now the run stops with a report: ``stopped_unavailable``
(the store, the error, how many were renamed before it and how many were left under their old names), one
``error:`` line, exit 4; every source whose rename did not complete stays, and a run after the store is back
finishes. An outage before the run's first write (the listing fails) is still a refused run: exit 2, nothing
written.

A real SeaweedFS server SIGKILLed part way, at a deterministic point: the CLI talks to it through a loopback HTTP
proxy that kills it once the server answered the run's k-th DELETE (or k-th PUT), before that answer is relayed;
from then on the proxy reaches no server and closes each client connection unanswered, as a dead server does. The
server is then restarted on the same ports and data."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler

import pytest
from typer.testing import CliRunner

from kvbm_backend.apps.cli import app
from tests.conftest import TEST_BUCKET
from tests.helpers.g4_migrate import legacy_left, legacy_store, readable
from tests.helpers.lying_proxy import reply, start_proxy, stop, upstream

pytestmark = [pytest.mark.slow]  # a private SeaweedFS server, killed and restarted twice

N = 12  # blocks under format 1 names
FANOUT = 16


class DyingProxy:
    """A loopback HTTP proxy in front of ``server`` (a :class:`~tests.helpers.seaweed.SeaweedServer`) that forwards
    every request; with ``kill_on = (method, k)`` it SIGKILLs the server once the server answered the k-th request
    of ``method`` sent through it, then relays that answer. A request no server answers (it is dead) gets its
    connection closed without an answer."""

    def __init__(self, server):
        self.server = server
        self.kill_on: tuple[str, int] | None = None
        self.seen: dict[str, int] = {}
        self.killed = False
        self._mu = threading.Lock()
        self._srv, port = start_proxy(self._handle)
        self.endpoint = f"http://127.0.0.1:{port}"

    def _handle(self, h: BaseHTTPRequestHandler, body: bytes | None) -> None:
        try:
            answer = upstream(h, ("127.0.0.1", self.server.s3), body)
        except OSError:  # no server: no answer
            h.close_connection = True
            return
        self._answered(h.command)
        reply(h, *answer)

    def _answered(self, method: str) -> None:
        with self._mu:
            self.seen[method] = self.seen.get(method, 0) + 1
            if self.kill_on is not None and self.kill_on == (method, self.seen[method]):
                self.server.kill()  # before the client has this answer: nothing after it reaches the server
                self.killed = True

    def arm(self, method: str, k: int) -> None:
        with self._mu:
            self.seen, self.kill_on, self.killed = {}, (method, k), False

    def close(self) -> None:
        stop(self._srv)


def _cli(*args):
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def _migrate(url, endpoint):
    return _cli("g4", "migrate", "--url", url, "--endpoint-url", endpoint, "--unkeyed", "--dir-fanout", str(FANOUT),
                "--json")


def _stopped(code, out, err, url, renamed: int, left: int) -> dict:
    """The report of a run the outage stopped, checked: exit 4, ``renamed`` renamed, ``left`` not renamed, one
    error line saying so."""
    assert code == 4, (code, out, err)  # old code: exit 2, no report
    res = json.loads(out)
    stop = res["stopped_unavailable"]
    assert (res["migrated"], res["errors"], res["stopped_full"]) == (renamed, 0, None), out
    assert (stop["url"], stop["renamed"], stop["not_renamed"]) == (url, renamed, left), stop
    assert stop["error"], stop
    line = " ".join(err.split())
    assert f"{url} unavailable" in line and f"{renamed} renamed before it, {left} left under their old names" in line, err
    assert [ln.startswith("error:") for ln in err.splitlines()] == [True], err  # one line, not one per object
    return res


def test_migrate_stopped_by_a_dead_store_reports_how_far_it_got_and_a_rerun_finishes(
        seaweed_restartable, s3_prefix, tmp_path):
    """The server killed after the run's 4th DELETE: exit 4, 4 renamed (served under their keyed names), 8 left under
    their old names byte for byte. With the server still down a run is refused before it writes (exit 2, no
    report). Back up, a run killed after its 2nd PUT (that copy landed, its source not deleted yet) stops with 1
    renamed and 7 left: the source whose copy landed is one of them, untouched. Back up again, a run renames the
    rest (the landed copy counts ``already_present``) and every block is served."""
    srv = seaweed_restartable
    url = f"s3://{TEST_BUCKET}/{s3_prefix}"
    objs = legacy_store(tmp_path, url, srv.endpoint, N, FANOUT)
    proxy = DyingProxy(srv)
    try:
        proxy.arm("DELETE", 4)
        code, out, err = _migrate(url, proxy.endpoint)
        assert proxy.killed, (code, out, err)
        _stopped(code, out, err, url, 4, N - 4)

        code, out, err = _migrate(url, proxy.endpoint)  # still down: the listing fails, nothing written
        assert code == 2 and out == "" and "error:" in err, (code, out, err)

        srv.restart(bucket=TEST_BUCKET)
        assert len(legacy_left(url, srv.endpoint, objs)) == N - 4
        assert sum(readable(url, srv.endpoint, N, FANOUT)) == 4

        proxy.arm("PUT", 2)
        code, out, err = _migrate(url, proxy.endpoint)
        assert proxy.killed, (code, out, err)
        _stopped(code, out, err, url, 1, N - 4 - 1)

        srv.restart(bucket=TEST_BUCKET)
        assert len(legacy_left(url, srv.endpoint, objs)) == N - 4 - 1
        assert sum(readable(url, srv.endpoint, N, FANOUT)) == 4 + 2  # the landed copy is served already

        proxy.arm("GET", 10 ** 9)  # no outage
        code, out, err = _migrate(url, proxy.endpoint)
        res = json.loads(out)
        assert code == 0, (code, out, err)
        assert (res["migrated"], res["already_present"], res["errors"], res["stopped_unavailable"]) == (
            N - 4 - 2, 1, 0, None), out
        assert legacy_left(url, srv.endpoint, objs) == [] and readable(url, srv.endpoint, N, FANOUT) == [True] * N
    finally:
        proxy.close()
