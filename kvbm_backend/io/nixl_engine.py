"""NIXL engine: NIXL 1.5.1's POSIX backend (``FILE_SEG`` <-> ``DRAM_SEG`` loopback transfers).

One background driver thread owns the NIXL agent (so no NIXL lock is needed and ``submit`` never
blocks). Per submitted job it registers the host buffers (one region per buffer) and the fds, builds
one NIXL transfer per group of at most ``queue_depth`` descriptors (each buffer of an op becomes one
descriptor at consecutive file offsets: NIXL has no iovec lists, and it merges touching descriptors
itself), posts up to ``threads`` transfers at once, polls ``check_xfer_state`` with a short backoff
sleep, and deregisters when the job is done.

Semantics kept equal to the posix engine (facts measured here, NIXL 1.5.1, see DESIGN.md):

* NIXL reports every failure as ``NIXL_ERR_BACKEND`` without an errno, and reports a read that
  crosses end of file as an error too. So before posting, the driver (a) checks O_DIRECT ops against
  the :class:`~kvbm_backend.io.base.IoOp` contract (4 KiB offset, addresses, lengths) and fails them
  with ``EINVAL`` as the kernel would, and (b) runs reads that cross the file's end with
  :func:`kvbm_backend.io.posix.run_op` so they return their short count. Other NIXL failures raise
  ``OSError(EIO)`` naming the NIXL error.
* NIXL never fsyncs: callers use :func:`kvbm_backend.io.fdatasync` before publishing.
* The POSIX backend's I/O queue is picked by ``mode``: ``aio`` (libaio, NIXL's default), ``uring``
  or ``posix_aio``. ``posix_aio`` is refused: its queue stays broken after one failed I/O (every
  later transfer fails), checked here.

File registrations are shared and reference-counted per fd (:class:`_FileRegs`). Why (root cause of
"io_submit rejected I/O: Bad file descriptor" under concurrent submits, NIXL 1.5.1 source
``src/plugins/posix/posix_backend.cpp``): registering a ``FILE_SEG`` fd allocates a
``nixlPosixFileMD`` holding the fd; ``prep_xfer_dlist`` copies a pointer to the *first matching*
registration of that fd into the prepared list, and ``postXfer`` reads the fd back through that
pointer when the transfer is posted. NIXL accepts the same fd registered twice, so with one
registration per job, job A's ``deregister_memory`` freed the metadata that job B's prepared list
still pointed at; B then posted whatever the freed memory held as its fd (EBADF here; it could as
well be another open file). Now one registration per fd exists while any job uses it and it is
deregistered only after the last such job has released its prepared lists. ``DRAM_SEG``
registrations carry no metadata in the POSIX backend (``out = nullptr``), so per-job DRAM
registrations, even of overlapping buffers, are safe. The backend's one I/O queue has
``ios_pool_size`` (65536) I/O slots shared by all transfers; descriptors in flight are kept below it.

Logging: NIXL's Python logger writes INFO to *stdout* and its C++ core reads ``NIXL_LOG_LEVEL``;
:func:`quiet_nixl_logging` (run before any agent is created here) sets ``NIXL_LOG_LEVEL=WARN`` unless
the user set it, and moves NIXL's console handler to stderr, so JSON on stdout stays clean.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Sequence, TypeAlias

from .base import IoOp, check_bufs
from .posix import run_op
from ..threads import start_thread

log = logging.getLogger(__name__)
ALIGN = 4096
MODES = {"aio": {"use_aio": "true"}, "uring": {"use_uring": "true"}}
DEFAULT_MODE = "aio"
_ids = itertools.count()
IOS_POOL_SIZE = 65536  # NIXL 1.5.1 POSIX ``ios_pool_size`` default (agent.get_plugin_params("POSIX"))


def quiet_nixl_logging() -> None:
    """Keep NIXL's log lines off stdout for the whole process; warnings and errors go to stderr.

    NIXL 1.5.1 configures the ``nixl`` Python logger on import (level INFO, handler on
    ``sys.stdout``; ``nixl_cu12/logging.py``) and both it and the C++ core honour ``NIXL_LOG_LEVEL``
    (TRACE/DEBUG/INFO/WARN/ERROR/FATAL). Sets ``NIXL_LOG_LEVEL=WARN`` unless already set (so a user's
    explicit level wins, and child processes inherit it), imports NIXL, sets the logger to WARNING
    (again unless the user chose a level) and points its console handlers at ``sys.stderr``.
    Idempotent; does nothing when NIXL cannot be imported.
    """
    user_level = os.environ.get("NIXL_LOG_LEVEL")
    if user_level is None:
        os.environ["NIXL_LOG_LEVEL"] = "WARN"
    try:
        import nixl._api  # noqa: F401 - configures the "nixl" logger
    except Exception:  # noqa: BLE001 - NIXL missing: nothing to quieten
        return
    nl = logging.getLogger("nixl")
    if user_level is None and nl.level < logging.WARNING:
        nl.setLevel(logging.WARNING)
    for h in nl.handlers:
        if type(h) is logging.StreamHandler and h.stream is not sys.stderr:
            # not h.setStream(): it flushes the old stream, which raises if that was closed (a
            # replaced sys.stdout, e.g. after an earlier in-process CLI run); nothing is lost.
            h.acquire()
            try:
                h.stream = sys.stderr
            finally:
                h.release()


class _FileRegs:
    """One NIXL ``FILE`` registration per fd, shared by the jobs using it (see module docstring).

    ``acquire(fds)`` registers the fds not yet registered and counts a use of each; ``release(fds)``
    drops one use each and deregisters an fd's registration when its last use ends. Called only from
    the driver thread. Raises whatever NIXL's ``register_memory`` raises (the counts are unchanged).
    """

    def __init__(self, agent: Any) -> None:  # a nixl_agent (nixl has no type information)
        self._agent = agent
        self._regs: dict[int, list[Any]] = {}  # fd -> [NIXL registration, uses: int]

    def acquire(self, fds: Sequence[int]) -> None:
        new = [fd for fd in fds if fd not in self._regs]
        added: list[int] = []
        try:
            for fd in new:
                self._regs[fd] = [self._agent.register_memory([(0, 0, fd, "")], "FILE"), 0]
                added.append(fd)
        except BaseException:
            for fd in added:
                self._deregister(fd)
            raise
        for fd in fds:
            self._regs[fd][1] += 1

    def release(self, fds: Sequence[int]) -> None:
        for fd in fds:
            ent = self._regs.get(fd)
            if ent is None:
                continue
            ent[1] -= 1
            if ent[1] <= 0:
                self._deregister(fd)

    def _deregister(self, fd: int) -> None:
        reg, _ = self._regs.pop(fd)
        try:
            self._agent.deregister_memory(reg)
        except Exception:  # noqa: BLE001 - nothing to do; NIXL logs it
            pass

    def __len__(self) -> int:
        return len(self._regs)


def nixl_unavailable_reason() -> str | None:
    """None if NIXL's POSIX plugin loads here, else why not (for skips, ``doctor`` and errors)."""
    quiet_nixl_logging()
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as e:  # noqa: BLE001 - any import failure is a reason
        return f"cannot import nixl ({type(e).__name__}: {e}); install nixl-cu12==1.5.1"
    try:
        agent = nixl_agent(f"kvbm-probe-{os.getpid()}-{next(_ids)}",
                           nixl_agent_config(enable_prog_thread=False, backends=[]))
        if "POSIX" not in agent.get_plugin_list():
            return f"NIXL POSIX plugin not found (plugins: {agent.get_plugin_list()})"
        agent.create_backend("POSIX", {})
    except Exception as e:  # noqa: BLE001
        return f"NIXL POSIX backend failed to start ({type(e).__name__}: {e})"
    return None


@dataclass
class _Job:
    ops: list[IoOp]
    future: Future[list[int]]
    results: list[int] = field(default_factory=list)
    error: BaseException | None = None
    groups_left: int = 0
    regs: list[Any] = field(default_factory=list)  # this job's DRAM registrations (NIXL objects)
    fds: list[int] = field(default_factory=list)  # fds whose shared FILE registration this job holds
    dlists: list[Any] = field(default_factory=list)  # NIXL prepared descriptor list handles


#: (job, op indices, descriptor indices): one NIXL transfer of a job, not yet posted
_Group: TypeAlias = tuple[_Job, list[int], list[int]]
#: (job, op indices, NIXL transfer handle, descriptor count): one transfer in flight
_InFlight: TypeAlias = tuple[_Job, list[int], Any, int]


class NixlEngine:
    """NIXL POSIX engine.

    Args:
        threads: NIXL transfers in flight at once (>= 1).
        queue_depth: most descriptors (buffers) per NIXL transfer (default 64; NIXL's kernel queue is
            256 deep; at most :data:`IOS_POOL_SIZE`). Descriptors in flight over all transfers are
            kept at or below :data:`IOS_POOL_SIZE`; further transfers wait in the engine.
        mode: ``aio`` or ``uring`` (see module docstring).

    Raises:
        RuntimeError: NIXL or its POSIX plugin cannot load here (message says why).
        ValueError: bad arguments.
    """

    name = "nixl"

    def __init__(self, threads: int = 8, queue_depth: int | None = None, mode: str = DEFAULT_MODE):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        queue_depth = 64 if queue_depth is None else queue_depth
        if not 1 <= queue_depth <= IOS_POOL_SIZE:
            raise ValueError(f"queue_depth must be in 1..{IOS_POOL_SIZE} (NIXL POSIX ios_pool_size), "
                             f"got {queue_depth}")
        if mode not in MODES:
            raise ValueError(f"unknown NIXL POSIX mode {mode!r}; expected one of {sorted(MODES)}")
        quiet_nixl_logging()
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"nixl engine unavailable: cannot import nixl ({type(e).__name__}: {e})") from e
        self.threads, self.queue_depth, self.mode = threads, queue_depth, mode
        self._agent_name = f"kvbm-io-{os.getpid()}-{next(_ids)}"
        try:
            self._agent = nixl_agent(self._agent_name, nixl_agent_config(enable_prog_thread=False, backends=[]))
            self._agent.create_backend("POSIX", dict(MODES[mode]))
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"nixl engine unavailable: POSIX backend failed to start ({type(e).__name__}: {e})") from e
        self._files = _FileRegs(self._agent)
        self._inflight_descs = 0  # descriptors posted and not yet finished, over all transfers
        self._q: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._starting: _Job | None = None
        self._lock = threading.Lock()
        self._thread = start_thread(self._drive, name="kvbm-nixl-io")

    # -- public ------------------------------------------------------------------------------------
    def submit(self, ops: Sequence[IoOp]) -> Future[list[int]]:
        """Queue ``ops``; returns at once. The Future resolves to bytes per op (short only for reads
        past end of file) after every op has finished, or raises the first OSError."""
        fut: Future[list[int]] = Future()
        fut.set_running_or_notify_cancel()
        ops = list(ops)
        if not ops:
            fut.set_result([])
            return fut
        with self._lock:
            if self._closed:
                fut.set_exception(OSError(errno.EBADF, "nixl engine is closed"))
                return fut
            self._q.put(_Job(ops, fut, results=[0] * len(ops)))
        return fut

    def close(self) -> None:
        """Finish queued jobs, stop the driver thread and release the NIXL agent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._q.put(None)
        self._thread.join()
        self._agent = None

    # -- driver thread -----------------------------------------------------------------------------
    def _drive(self) -> None:
        pending: list[_Group] = []  # not yet posted
        inflight: list[_InFlight] = []
        try:
            self._loop(pending, inflight)
        except BaseException as e:  # a bug here must fail the callers' Futures, never hang them
            with self._lock:
                self._closed = True
            err = OSError(errno.EIO, f"nixl engine driver stopped: {type(e).__name__}: {e}")
            jobs = {id(j): j for j, *_ in pending + inflight}
            if self._starting is not None:
                jobs[id(self._starting)] = self._starting
            while True:
                try:
                    j = self._q.get_nowait()
                except queue.Empty:
                    break
                if j is not None:
                    jobs[id(j)] = j
            for j in jobs.values():
                if not j.future.done():
                    j.future.set_exception(err)
            log.error("nixl engine driver stopped; %d jobs failed", len(jobs), exc_info=True)

    def _loop(self, pending: list[_Group], inflight: list[_InFlight]) -> None:
        stopping = False
        sleep = 0.0
        while True:
            # take new jobs (block only when there is nothing to poll)
            while True:
                try:
                    job = self._q.get(block=not (pending or inflight or stopping))
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                self._starting = job
                pending.extend(self._start(job))
                self._starting = None
            if stopping and not pending and not inflight:
                return
            progressed = False
            while (pending and len(inflight) < self.threads
                   and self._inflight_descs + len(pending[0][2]) <= IOS_POOL_SIZE):
                job, idx, descs = pending.pop(0)
                handle = self._post(job, idx, descs)
                if handle is not None:
                    inflight.append((job, idx, handle, len(descs)))
                    self._inflight_descs += len(descs)
                progressed = True
            still = []
            for job, idx, handle, ndesc in inflight:
                err: Exception | None
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception as e:  # noqa: BLE001 - NIXL raises its own types
                    state, err = "ERR", e
                else:
                    err = None
                if state == "PROC":
                    still.append((job, idx, handle, ndesc))
                    continue
                progressed = True
                self._release(handle)
                self._inflight_descs -= ndesc
                if state == "DONE":
                    self._group_done(job, idx, None)
                else:
                    self._group_done(job, idx, self._nixl_error(job, idx, err))
            inflight[:] = still
            if progressed:
                sleep = 0.0
            elif inflight:
                sleep = min(2e-4, max(2e-5, sleep * 2))
                time.sleep(sleep)

    def _start(self, job: _Job) -> list[_Group]:
        """Validate, handle EOF-crossing reads, register memory, and split the job into groups."""
        agent = self._agent
        nixl_ops: list[int] = []
        sizes: dict[int, int] = {}
        try:
            for i, op in enumerate(job.ops):
                if op.nbytes == 0:
                    continue
                check_bufs(op, i)  # NIXL takes (address, bytes): a strided view would be overrun
                if os.O_DIRECT & fcntl.fcntl(op.fd, fcntl.F_GETFL):
                    _check_o_direct(op, i)
                if not op.write:
                    if op.fd not in sizes:
                        sizes[op.fd] = os.fstat(op.fd).st_size
                    if op.offset + op.nbytes > sizes[op.fd]:
                        job.results[i] = run_op(op)  # short read at EOF: NIXL would call it an error
                        continue
                nixl_ops.append(i)
            if not nixl_ops:
                job.future.set_result(job.results)
                return []
            bufs = [b for i in nixl_ops for b in job.ops[i].bufs if b.nbytes]
            fds = sorted({job.ops[i].fd for i in nixl_ops})
            job.regs.append(agent.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in bufs], "DRAM"))
            self._files.acquire(fds)  # shared per fd: see the module docstring
            job.fds = fds
        except OSError as e:
            self._finish(job, e)
            return []
        except Exception as e:  # noqa: BLE001 - NIXL registration errors
            self._finish(job, OSError(errno.EIO, f"NIXL registration failed: {type(e).__name__}: {e}"))
            return []

        # one descriptor per buffer, at consecutive file offsets; both lists prepared once per job
        local: list[tuple[int, int, int]] = []  # (address, bytes, device id)
        remote: list[tuple[int, int, int]] = []  # (file offset, bytes, fd)
        groups: list[_Group] = []
        g_idx: list[int] = []
        g_first = 0
        for i in nixl_ops:
            op = job.ops[i]
            n = sum(1 for b in op.bufs if b.nbytes)
            # one transfer has one direction: a read and a write never share a group
            if g_idx and (len(local) - g_first + n > self.queue_depth or job.ops[g_idx[0]].write != op.write):
                groups.append((job, g_idx, list(range(g_first, len(local)))))
                g_idx, g_first = [], len(local)
            pos = op.offset
            for b in op.bufs:
                if b.nbytes:
                    local.append((b.ctypes.data, b.nbytes, 0))
                    remote.append((pos, b.nbytes, op.fd))
                    pos += b.nbytes
            g_idx.append(i)
        groups.append((job, g_idx, list(range(g_first, len(local)))))
        try:
            job.dlists.append(agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM"))
            job.dlists.append(agent.prep_xfer_dlist(self._agent_name, remote, "FILE"))
        except Exception as e:  # noqa: BLE001
            self._finish(job, OSError(errno.EIO, f"NIXL could not prepare descriptors: {type(e).__name__}: {e}"))
            return []
        job.groups_left = len(groups)
        return groups

    def _post(self, job: _Job, idx: list[int], descs: list[int]) -> Any:
        """Create and start one transfer; returns its handle while in progress, else None (done or
        failed, already accounted to the job)."""
        if job.error is not None:  # an earlier group failed: skip the rest, still count it down
            self._group_done(job, idx, None, ok=False)
            return None
        agent = self._agent
        op_type = "WRITE" if job.ops[idx[0]].write else "READ"
        try:
            handle = agent.make_prepped_xfer(op_type, job.dlists[0], descs, job.dlists[1], descs)
        except Exception as e:  # noqa: BLE001
            self._group_done(job, idx, OSError(errno.EIO, f"NIXL could not create the {op_type} transfer: "
                                                         f"{type(e).__name__}: {e}"))
            return None
        err: Exception | None
        try:
            state = agent.transfer(handle)
        except Exception as e:  # noqa: BLE001
            state, err = "ERR", e
        else:
            err = None
        if state == "PROC":
            return handle
        self._release(handle)
        self._group_done(job, idx, None if state == "DONE" else self._nixl_error(job, idx, err))
        return None

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - nothing to do; NIXL logs it
            pass

    @staticmethod
    def _nixl_error(job: _Job, idx: list[int], err: BaseException | None) -> OSError:
        ops = job.ops
        what = "write" if ops[idx[0]].write else "read"
        first, last = ops[idx[0]], ops[idx[-1]]
        detail = f"{type(err).__name__}: {err}" if err is not None else "state ERR"
        return OSError(errno.EIO, f"NIXL POSIX {what} failed ({detail}); {len(idx)} ops, fd {first.fd} "
                                  f"offsets {first.offset}..{last.offset + last.nbytes}")

    def _group_done(self, job: _Job, idx: list[int], err: OSError | None, ok: bool = True) -> None:
        if err is not None and job.error is None:
            job.error = err
        elif err is None and ok:
            for i in idx:
                job.results[i] = job.ops[i].nbytes
        job.groups_left -= 1
        if job.groups_left == 0:
            self._finish(job, job.error)

    def _finish(self, job: _Job, err: BaseException | None) -> None:
        for dl in job.dlists:
            try:
                self._agent.release_dlist_handle(dl)
            except Exception:  # noqa: BLE001
                pass
        job.dlists.clear()
        for reg in job.regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001
                pass
        job.regs.clear()
        self._files.release(job.fds)  # after the prepared lists that point at the registrations
        job.fds = []
        if err is not None:
            job.future.set_exception(err)
        else:
            job.future.set_result(job.results)


def _check_o_direct(op: IoOp, i: int) -> None:
    """The IoOp contract for O_DIRECT fds; the kernel would answer EINVAL (NIXL loses the errno)."""
    if op.offset % ALIGN:
        raise OSError(errno.EINVAL, f"op {i}: O_DIRECT offset {op.offset} is not a multiple of {ALIGN}")
    for b in op.bufs:
        if b.nbytes and (b.ctypes.data % ALIGN or b.nbytes % ALIGN):
            raise OSError(errno.EINVAL, f"op {i}: O_DIRECT buffer at 0x{b.ctypes.data:x} of {b.nbytes} bytes "
                                        f"is not {ALIGN}-byte aligned")
