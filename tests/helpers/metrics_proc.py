"""One engine process of a pod for the ``metrics.port`` tests, driven over stdin/stdout.

``python tests/helpers/metrics_proc.py PORT [ADDR]`` prints ``pid <pid>`` and waits for a line ``start``: only
then it calls :func:`kvbm_backend.metrics.prepare` (PORT), creates ``TierMetrics("g3")`` (capacity gauge 1000)
and ``TierMetrics("g4")``, and :func:`kvbm_backend.metrics.serve_once` (PORT, ADDR: default 127.0.0.1), and prints ``serving <bool>`` (or
``serving raised <exception type>``). Then one answer line (``ok``) per command: ``inc N [REASON]`` (N
offloaded blocks, one load miss for REASON, default ``absent``); ``hit R H``: one G3 prefix lookup of R blocks, H found (the G3 hit rate); ``fork N``: a forked child sets the capacity
gauge to 500 and offloads N blocks, then lives as long as this process (answer ``ok <child pid>`` once it has
counted); ``fork N outlive [serve]``: the same, but the child lives on after this process ended, until its
standard input (this process's, inherited) ends; with ``serve`` it also calls ``serve_once`` (PORT, ADDR) first
(answer ``ok <child pid> <its result>``); ``quit`` (or end of input) ends it. Logs go to stderr. The environment picks the directory
(``XDG_RUNTIME_DIR``).

:class:`MetricsProc` starts and drives one from a test.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import REPO


class MetricsProc:
    """A :mod:`tests.helpers.metrics_proc` process; ``log`` (a file) gets its stderr."""

    def __init__(self, port: int, log: Path, xdg: Path, start: bool = True, addr: str = "127.0.0.1",
                 prefix: tuple[str, ...] = ()):
        """``prefix``: a command that runs the process (``unshare --pid --fork``: its pid is 1)."""
        env = dict(os.environ, XDG_RUNTIME_DIR=str(xdg),
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log = log
        self.serving = ""  # the answer to start
        self.p = subprocess.Popen([*prefix, sys.executable, __file__, str(port), addr], env=env, cwd=str(REPO),
                                  text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"))
        self.pid = int(self._line().split()[1])
        if start:
            self.start()

    def _line(self) -> str:
        line = self.p.stdout.readline()  # type: ignore[union-attr]
        assert line, f"process {self.p.pid} ended: {self.log.read_text()}"
        return line.strip()

    def start(self) -> bool:
        """Prepare, create the series and serve; True when this process's series are served (here or by a sibling)."""
        self.serving = self.cmd("start")
        return self.serving == "serving True"

    def cmd(self, line: str) -> str:
        self.p.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]
        return self._line()

    def quit(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.write("quit\n")  # type: ignore[union-attr]
            self.p.stdin.flush()  # type: ignore[union-attr]
        self.p.wait(timeout=600)

    def kill(self) -> None:
        self.p.kill()
        self.p.wait(timeout=600)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(process)d %(levelname)s %(message)s")
    port = int(sys.argv[1])
    print("pid", os.getpid(), flush=True)
    if sys.stdin.readline().strip() != "start":
        return
    from kvbm_backend import metrics
    metrics.prepare(port)
    m = metrics.TierMetrics("g3")
    assert m.capacity_bytes is not None
    m.capacity_bytes.set(1000)
    metrics.TierMetrics("g4")
    addr = sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1"
    try:
        print("serving", metrics.serve_once(port, addr), flush=True)
    except Exception as e:  # noqa: BLE001 - an integration logs it and runs on (tiers.announce_tiers)
        print("serving raised", type(e).__name__, flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "inc":
            m.offload_blocks.inc(int(cmd[1]))
            m.misses.labels(cmd[2] if len(cmd) > 2 else "absent").inc()
        elif cmd[0] == "hit":
            m.hit_rate.record(int(cmd[1]), int(cmd[2]))
        elif cmd[0] == "fork":
            serve = (port, addr) if cmd[2:] == ["outlive", "serve"] else None
            print("ok", _fork(m, int(cmd[1]), outlive=cmd[2:3] == ["outlive"], serve=serve), flush=True)
            continue
        print("ok", flush=True)


def _fork(m, n: int, outlive: bool = False, serve: tuple[int, str] | None = None) -> str:
    done_r, done_w = os.pipe()
    life_r, life_w = os.pipe()  # the child reads end of input here when this process ends
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(done_r)
            os.close(life_w)
            m.capacity_bytes.set(500)
            m.offload_blocks.inc(n)
            said = "x"
            if serve is not None:
                from kvbm_backend import metrics
                said += str(metrics.serve_once(*serve))
            os.write(done_w, said.encode())
            os.read(life_r, 1)
            while outlive and os.read(0, 4096):  # after this process ended: until the test closes its input
                pass
            code = 0
        finally:
            os._exit(code)
    os.close(done_w)
    os.close(life_r)
    said = os.read(done_r, 64).decode()
    assert said.startswith("x"), said
    os.close(done_r)
    return f"{pid} {said[1:]}".strip()


if __name__ == "__main__":
    main()
