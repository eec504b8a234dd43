"""A G3 pool and a child forked without exec (multiprocessing's fork, a zygote, an engine forking helpers), with real
forks, real SIGKILLs and real processes (:mod:`kvbm_backend.pool.g3.forked`, :mod:`kvbm_backend.pool.g3.dirs`);
and the files of an O_DIRECT probe a SIGKILL interrupted."""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvbm_backend.pool.g3 import G3ForkedError, G3LockedError
from kvbm_backend.pool.g3.dirs import LOCK_NAME, PROBE_STALE_S, pid_alive
from tests.helpers.crash_writer import NS, open_pool, payload
from tests.helpers.forked import exit_status
from tests.helpers.paths import REPO

HANG_S = 120.0  # a hang guard for what happens at once (a child's calls, its end), not a bound
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
KEYS = NS.keys(range(1, 11))


def _python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=str(REPO))


def _line(p: subprocess.Popen, prefix: str) -> str:
    for line in p.stdout:
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"no {prefix} line; stderr: {p.stderr.read()}")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _all_served(pool) -> bool:
    out = [np.zeros(pool.block_bytes, np.uint8) for _ in KEYS]
    res = pool.get(KEYS, out).result()
    return all(res.ok) and all(np.array_equal(o, payload(k.seq_hash)) for o, k in zip(out, KEYS))


def _refusal(d) -> str:
    """The one line another process's open of ``d`` is refused with ("" when it opened)."""
    p = _python("""
        import sys
        from tests.helpers.crash_writer import open_pool
        from kvbm_backend.pool.g3 import G3LockedError
        try:
            open_pool(sys.argv[1], capacity_gb=0.01).close()
        except G3LockedError as e:
            print("REFUSED", e)
    """, str(d))
    out, err = p.communicate(timeout=HANG_S)
    assert p.returncode == 0, err
    return out.strip()


@pytest.mark.slow
def test_a_child_forked_after_the_open_does_not_keep_the_directory_locked_once_its_parent_was_killed(tmp_path):
    """Review finding (G3 4): the lock is an flock of the directory and the lock file, and a child forked without
    exec shares their open file descriptions (O_CLOEXEC covers exec only). The parent SIGKILLed while the child
    lived, the restarted worker got G3LockedError naming the dead parent until the child ended. Now the child
    closes its copies at the fork: the restart opens the directory and finds the parent's blocks, the child still
    running."""
    d = tmp_path / "g3"
    parent = _python("""
        import os, sys
        from tests.helpers.crash_writer import NS, open_pool, payload
        pool = open_pool(sys.argv[1], capacity_gb=0.01)
        keys = NS.keys(range(1, 11))
        assert pool.put(keys, [payload(k.seq_hash) for k in keys]).result().written == 10
        if os.fork() == 0:  # a helper forked after the pool opened: it lives on, never touching the pool
            print("CHILD", os.getpid(), flush=True)
            os.read(0, 1)  # until the test closes its stdin
            os._exit(0)
        os.read(0, 1)
    """, str(d))
    child = int(_line(parent, "CHILD").split()[1])
    try:
        parent.kill()  # SIGKILL
        parent.wait(HANG_S)
        assert pid_alive(child)
        with open_pool(d, capacity_gb=0.01) as pool:  # before: G3LockedError (holder: pid <the dead parent>)
            assert pool.stats()["restored_blocks"] == 10
            assert _all_served(pool)
        assert pid_alive(child)
    finally:
        parent.stdin.close()  # the child ends at EOF
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fds_into(d) -> list[str]:
    """This process's fds that name ``d`` or a file in it."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target == str(d) or target.startswith(str(d) + os.sep):
            out.append(target)
    return out


def test_a_forked_childs_close_leaves_its_parents_lock_held_and_the_child_holds_no_file_of_the_pool(tmp_path):
    """A child that closes its copy of the pool (a ``with`` block it leaves, a connector's ``__del__`` at its exit)
    unlocked the shared lock file (``LOCK_UN`` acts on the open file description, the parent's too): a second
    worker could open the directory under the running parent. Now a forked child's close does nothing; the child
    holds no descriptor of the pool's directory or files (closed at the fork), the parent's lock stays held (an
    flock belongs to the open file description, which the parent's descriptors keep) and its pool serves on."""
    d = tmp_path / "g3"
    with open_pool(d, capacity_gb=0.01) as pool:
        assert pool.put(KEYS, [payload(k.seq_hash) for k in KEYS]).result().written == 10
        assert _fds_into(d)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                held = _fds_into(d)
                pool.close()
                code = 3 if held else 0
            finally:
                os._exit(code)
        assert exit_status(pid, HANG_S) == 0, "the child held a descriptor of the pool's files after the fork"
        fd = os.open(d / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
        try:  # the lock file's flock (what older versions take) is held: before, the child's close unlocked it
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        refused = _refusal(d)
        assert refused.startswith("REFUSED") and "in use by another pool" in refused
        assert f"holder: pid {os.getpid()}, running" in refused
        assert _all_served(pool)
        assert pool.put(NS.keys([11]), [payload(11)]).result().written == 1
    assert _refusal(d) == ""  # the parent's close released it


def test_every_call_of_a_forked_childs_pool_raises_G3ForkedError_even_with_the_lock_held_at_the_fork(tmp_path):
    """A child has none of the pool's threads: its puts and gets waited for ever, and a lock another thread held at
    the fork hung its first call. Now each call raises G3ForkedError naming the directory, the opener and the
    child, before any lock is waited for (here the forking thread holds the pool's lock at the fork); close does
    nothing; the parent's pool is untouched."""
    d = tmp_path / "g3"
    with open_pool(d, capacity_gb=0.01) as pool:
        assert pool.put(KEYS, [payload(k.seq_hash) for k in KEYS]).result().written == 10
        me = os.getpid()
        with pool.cat.lock:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    buf = [np.zeros(pool.block_bytes, np.uint8)]
                    calls = [lambda: pool.contains(KEYS[0]), lambda: pool.lookup_prefix(KEYS),
                             lambda: pool.get(KEYS[:1], buf), lambda: pool.put(KEYS[:1], [payload(1)]),
                             lambda: pool.delete(KEYS), lambda: pool.keys(), lambda: pool.stats(),
                             lambda: pool.flush(1.0)]
                    code = 0
                    for i, call in enumerate(calls):
                        try:
                            call()
                            code = 10 + i
                        except G3ForkedError as e:
                            if not (str(d) in str(e) and f"process {me}" in str(e)
                                    and f"process {os.getpid()}" in str(e)):
                                code = 30 + i
                        if code:
                            break
                    pool.close()
                finally:
                    os._exit(code)
        assert exit_status(pid, HANG_S) == 0
        assert pool.stats()["blocks"] == 10 and _all_served(pool)
    with open_pool(d, capacity_gb=0.01) as pool:
        assert pool.stats()["restored_blocks"] == 10 and _all_served(pool)


def test_a_refusal_says_whether_the_holder_named_in_the_lock_file_still_runs(tmp_path):
    """The refusal names the pid the lock file holds; now it says whether that process runs (when not, one that
    inherited its descriptors holds the lock: a child forked by an older version, a C-level fork)."""
    d = tmp_path / "g3"
    open_pool(d, capacity_gb=0.01).close()
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)  # another holder of the directory's lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        dead = _dead_pid()
        (d / LOCK_NAME).write_text(f"pid {dead}\n")
        with pytest.raises(G3LockedError, match=rf"holder: pid {dead}, no longer running \(in this pid "
                                                r"namespace\): a process that inherited its descriptors"):
            open_pool(d, capacity_gb=0.01)
        (d / LOCK_NAME).write_text(f"pid {os.getpid()}\n")
        with pytest.raises(G3LockedError, match=rf"holder: pid {os.getpid()}, running\)"):
            open_pool(d, capacity_gb=0.01)
    finally:
        os.close(fd)


def test_an_o_direct_probe_killed_by_sigkill_leaves_a_file_the_next_open_removes(tmp_path):
    """Review finding (G3 4): a SIGKILL during the O_DIRECT probe at open left its 4 KiB temp file for good. Now
    the probe's file names its pid, and an open (lock held) removes the probe files of pids that no longer run
    and those older than PROBE_STALE_S (names without a pid, of older versions, only then); a probe file of a
    running process stays."""
    d = tmp_path / "g3"
    open_pool(d, capacity_gb=0.01).close()
    probe = _python("""
        import sys, tempfile
        real = tempfile.mkstemp
        def held(*a, **kw):  # the probe's file is created: wait here to be killed
            fd, path = real(*a, **kw)
            print("CREATED", path, flush=True)
            sys.stdin.read()
            return fd, path
        tempfile.mkstemp = held
        from kvbm_backend.io.probe import probe_o_direct
        probe_o_direct(sys.argv[1])
    """, str(d))
    path = _line(probe, "CREATED").split(maxsplit=1)[1]
    probe.kill()
    probe.wait(HANG_S)
    killed = os.path.basename(path)
    assert os.path.exists(path)
    live = f".kvbm-odirect-probe-{os.getpid()}-abcd_123"  # a probe of a running process (this one)
    old_live = f".kvbm-gpu-probe-{os.getpid()}-abcd_124"  # ... older than the bound: stale whatever its pid
    legacy_old, legacy_new = ".kvbm-odirect-probe-x1y2z3w4", ".kvbm-gpu-probe-x1y2z3w5"  # names without a pid
    for name in (live, old_live, legacy_old, legacy_new):
        (d / name).write_bytes(b"\0" * 4096)
    past = time.time() - PROBE_STALE_S - 60
    for name in (old_live, legacy_old):
        os.utime(d / name, (past, past))
    with open_pool(d, capacity_gb=0.01) as pool:
        removed = pool.slabs.dirs[str(d)].stale_temps_removed
    assert sorted(removed) == sorted([killed, old_live, legacy_old])
    left = {n for n in os.listdir(d) if "probe" in n}
    assert left == {live, legacy_new}
