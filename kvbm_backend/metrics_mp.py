"""One ``/metrics`` endpoint for every process of a pod: prometheus_client's multiprocess files, per port.

An engine is several processes (vLLM's API server, engine core with the connector's scheduler role, one
worker per TP rank with the worker role; Dynamo's worker the same), and the events behind one series happen
in different ones: prefix lookups (``kvbm_matched_tokens``, the hit rates) in the scheduler, loads and
offloads in the workers. Each process that opens tiers with ``metrics.port`` P keeps its series in mmap
files under :func:`metrics_dir` (P) (prometheus_client's multiprocess format: ``counter_<id>.db``,
``gauge_<mode>_<id>.db``, ``histogram_<id>.db``, where ``<id>`` is ``<pid>.<random>``: pids repeat, see
below), and the one process that holds the serving lock of P
(:func:`take_serve_lock`, first come) serves them all, merged by prometheus_client's
``MultiProcessCollector``: counters and histograms summed over processes (dead ones included: what
happened stays counted), gauges by the mode each series declares (:func:`kvbm_backend.metrics.gauge`:
capacities summed over live processes, the hit rates the most recent value, ``degraded`` the maximum). A
most-recent gauge is shown from its creation, at its value then (0), stamped :data:`SEED_TIMESTAMP`: any
value a process of the pod sets later (stamped with the time) wins over it, in that process or another.

This is vLLM's own scheme (``PROMETHEUS_MULTIPROC_DIR``, used by vLLM when it runs several API servers), with
a directory per port instead of one environment variable: the variable must be set before a process imports
prometheus_client, which vLLM has done long before the connector loads, and one variable for every series
would move vLLM's own in-process series into files its single API server does not read. Our value class
(:func:`value_class`) is prometheus_client's ``MmapedValue`` with the directory passed in.

Files of processes that are gone: live-mode gauge files are removed at each scrape (the gauge then no longer
counts that process); their counter and histogram files stay while the run goes on (a process of the pod still
lives with files here), so that the sums never go down. A new run (:func:`begin` finds no live process with
files) starts from clean: the files of an earlier run's processes are removed (counters restart with the pod,
as Prometheus expects after a restart). A process is live while it holds the shared flock on its
``live_<id>.lock`` (the kernel drops it when the process ends), not while its pid exists. Pids repeat: in a
fresh PID namespace (a container restarted with a persisting directory), and at the same time in two
containers of one pod that share the directory (each has its own PID namespace, both may be pid 1); the
random part of ``<id>`` (new in each process, a forked child included) keeps their files apart, so no
process writes, renames or removes another's files, live or dead. A forked child does not inherit its
parent's liveness (it closes the inherited live-lock descriptors at fork, which leaves the parent's lock
held) nor a lock another thread held at the fork (the module's locks are new in the child).

Disk space: every file is allocated on disk before it is mapped (:class:`_AllocatedDict`: ``posix_fallocate``,
under a temporary name until then). prometheus_client maps a sparse file, and the first write to a page of it
on a full filesystem (a full ``/tmp`` or ``$XDG_RUNTIME_DIR``) is a SIGBUS that killed the engine process with
no Python error (before 2026-11-30). :func:`reserve` allocates this process's files when it joins
(:func:`kvbm_backend.metrics.prepare`); a full filesystem is then an ``OSError`` there, and the process keeps its
series in memory (logged), never a zero-length file that would fail every scrape of the pod.

The serving process holds ``serve.lock`` (an ``flock``, which the kernel releases when the process ends); the
others wait for it in a thread (:func:`wait_serve_lock`), so that one of them serves once it ends. A forked
child closes its copies of the serve-lock descriptors at the fork (held or waited on: the parent's lock stays
held), so that it never keeps the port's lock after the parent ended.
"""
from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import tempfile
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import mmap_dict
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.utils import floatToGoString

log = logging.getLogger("kvbm_backend.metrics")

# ``<id>``: ``<pid>.<16 hex>``; a bare ``<pid>`` (and ``<pid>-<n>``, renamed: ended) is an earlier version's
_DB = re.compile(r"^(counter|histogram|summary|gauge_[a-z]+)_(\d+(?:\.[0-9a-f]{16})?)(-\d+)?\.db$")
_LIVE = re.compile(r"^live_(\d+(?:\.[0-9a-f]{16})?)\.lock$")
_me: dict[int, str] = {}  # pid -> its <id>: only this process's
_MOST_RECENT = frozenset(("mostrecent", "livemostrecent"))
# The timestamp a most-recent gauge's value gets when the gauge is created: MultiProcessCollector shows, of a
# most-recent gauge's values in the processes' files, the one with the latest timestamp later than 0, so a
# value no process has set (timestamp 0) is never shown and the series would be absent until its first set.
# 1 s after the epoch: above 0, below every set (Gauge.set stamps time.time()), so any set value wins.
SEED_TIMESTAMP = 1.0


def _id() -> str:
    """This process's ``<id>`` in file names: its pid and 64 random bits, drawn again in a forked child."""
    pid = os.getpid()
    if pid not in _me:
        _me.clear()
        _me[pid] = f"{pid}.{os.urandom(8).hex()}"
    return _me[pid]


#: the file prefixes of this package's series (counters, the offload histogram, the gauges' modes:
#: :func:`kvbm_backend.metrics.gauge`), each allocated by :func:`reserve`
PREFIXES = ("counter", "histogram", "gauge_livesum", "gauge_livemax", "gauge_livemostrecent")


_INITIAL_BYTES = getattr(mmap_dict, "_INITIAL_MMAP_SIZE", 1 << 16)  # a new MmapedDict file's size (64 KiB)


def _allocate(fd: int, size: int) -> None:
    """Allocate ``size`` bytes of ``fd``'s file on disk (its size grows to at least ``size``).
    Raises OSError (ENOSPC: the filesystem is full)."""
    os.posix_fallocate(fd, 0, size)


class _AllocatedDict(MmapedDict):
    """prometheus_client's ``MmapedDict`` over a file whose mapped bytes are allocated on disk (writing to an
    unallocated page of a mapped file on a full filesystem is a SIGBUS, not an error). A new file appears
    under its name only once allocated (a zero-length ``.db`` would fail every scrape of the pod).

    Raises:
        OSError: the file cannot be created or allocated (ENOSPC); nothing is left under ``filename``.
    """

    def __init__(self, filename: str):
        if not os.path.exists(filename):
            tmp = f"{filename}.{os.urandom(4).hex()}.new"  # not *.db: the collector never reads it
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _allocate(fd, _INITIAL_BYTES)
                os.rename(tmp, filename)
            except BaseException:
                os.unlink(tmp)
                raise
            finally:
                os.close(fd)
        super().__init__(filename)

    def _init_value(self, key):
        used, cap0, f = (getattr(self, a, None) for a in ("_used", "_capacity", "_f"))
        if isinstance(used, int) and isinstance(cap0, int) and cap0 > 0 and f is not None:  # prometheus_client's
            encoded = key.encode("utf-8")  # internals (0.26); a version without them: its own growth, unallocated
            need = used + 4 + len(encoded) + (8 - (len(encoded) + 4) % 8) + 16  # MmapedDict's entry size
            cap = cap0
            while need > cap:
                cap *= 2
            if cap > cap0:  # MmapedDict grows the file (truncate: sparse) to cap: allocate it first
                _allocate(f.fileno(), cap)
        super()._init_value(key)


def metrics_dir(port: int) -> str:
    """``kvbm-backend-<uid>/metrics-<port>`` under ``$XDG_RUNTIME_DIR`` (else the temp dir), created 0700.

    Raises:
        OSError: it cannot be created, or it (or its parent) is not a private directory of this user.
    """
    base = os.path.join(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(), f"kvbm-backend-{os.getuid()}")
    d = os.path.join(base, f"metrics-{int(port)}")
    for p in (base, d):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(p)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise OSError(f"{p} is not a private directory of this user (owner {st.st_uid}, mode "
                          f"{st.st_mode & 0o777:o})")
    return d


def value_class(directory: str):
    """prometheus_client's ``MmapedValue`` (``values.MultiProcessValue``) writing under ``directory``."""
    files: dict = {}
    values: list = []
    pid = {"value": os.getpid()}

    class MmapedValue:
        _multiprocess = True

        def __init__(self, typ, metric_name, name, labelnames, labelvalues, help_text, multiprocess_mode="", **kw):
            self._params = typ, metric_name, name, labelnames, labelvalues, help_text, multiprocess_mode
            with _value_lock:
                self._check_pid()
                self._reset()
                values.append(self)

        def _reset(self):
            typ, metric_name, name, labelnames, labelvalues, help_text, mode = self._params
            prefix = f"{typ}_{mode}" if typ == "gauge" else typ
            if prefix not in files:
                files[prefix] = _AllocatedDict(os.path.join(directory, f"{prefix}_{_id()}.db"))
            self._file = files[prefix]
            self._key = mmap_key(metric_name, name, labelnames, labelvalues, help_text)
            self._value, self._timestamp = self._file.read_value(self._key)
            if typ == "gauge" and mode in _MOST_RECENT and not self._timestamp:
                self._timestamp = SEED_TIMESTAMP  # exported (at its value, 0) before its first set
                self._file.write_value(self._key, self._value, self._timestamp)

        def _check_pid(self):
            if pid["value"] != os.getpid():  # forked: the child writes its own files
                pid["value"] = os.getpid()
                for f in files.values():
                    f.close()
                files.clear()
                try:
                    begin(directory)  # its own live lock (its own <id>)
                except OSError:
                    pass
                for v in values:
                    v._reset()

        def inc(self, amount):
            with _value_lock:
                self._check_pid()
                self._value += amount
                self._timestamp = 0.0
                self._file.write_value(self._key, self._value, self._timestamp)

        def set(self, value, timestamp=None):
            with _value_lock:
                self._check_pid()
                self._value = value
                self._timestamp = timestamp or 0.0
                self._file.write_value(self._key, self._value, self._timestamp)

        def set_exemplar(self, exemplar):
            return

        def get(self):
            with _value_lock:
                self._check_pid()
                return self._value

        def get_exemplar(self):
            return None

    return MmapedValue


def metric_classes(directory: str) -> dict:
    """``{Counter: cls, Gauge: cls, Histogram: cls}``: prometheus_client's classes whose values (label
    children included) live in ``directory``'s files."""
    vc = value_class(directory)

    class MpCounter(Counter):
        def _metric_init(self) -> None:
            self._value = vc(self._type, self._name, self._name + "_total", self._labelnames, self._labelvalues,
                             self._documentation)
            self._created = 0.0

    class MpGauge(Gauge):
        def _metric_init(self) -> None:
            self._value = vc(self._type, self._name, self._name, self._labelnames, self._labelvalues,
                             self._documentation, multiprocess_mode=self._multiprocess_mode)

    class MpHistogram(Histogram):
        def _metric_init(self) -> None:
            self._buckets = []
            self._created = 0.0
            self._sum = vc(self._type, self._name, self._name + "_sum", self._labelnames, self._labelvalues,
                           self._documentation)
            for b in self._upper_bounds:
                self._buckets.append(vc(self._type, self._name, self._name + "_bucket", self._labelnames + ("le",),
                                        self._labelvalues + (floatToGoString(b),), self._documentation))

    return {Counter: MpCounter, Gauge: MpGauge, Histogram: MpHistogram}


_live: dict[str, tuple[int, int]] = {}  # directory -> (pid, fd) of this process's live lock there
_live_lock = threading.Lock()
_value_lock = threading.Lock()  # the values of every value_class
_serve_fds: set[int] = set()  # this process's serve.lock descriptors (held, or waited on by a thread)
_serve_fds_lock = threading.Lock()  # opening / closing one and recording it in _serve_fds


def _before_fork() -> None:
    _live_lock.acquire()  # no live-lock descriptor half-recorded in _live at the fork
    _serve_fds_lock.acquire()  # nor a serve-lock descriptor in _serve_fds


def _after_fork_in_parent() -> None:
    _serve_fds_lock.release()
    _live_lock.release()


def _after_fork_in_child() -> None:
    """New locks (another thread of the parent may have held one at the fork: the child's copy stays held),
    a new ``<id>``, and the parent's live-lock and serve-lock descriptors closed: an flock belongs to the open
    file description, which the parent's descriptor keeps (its lock stays held), while the child's copy would
    keep the parent live, or keep serving the port locked, after the parent ended. A serve lock a thread of
    the parent was waiting for goes too (that thread is not in the child, and its lock, once taken, would be
    the child's as well)."""
    global _live_lock, _value_lock, _serve_fds_lock
    _live_lock = threading.Lock()
    _value_lock = threading.Lock()
    _serve_fds_lock = threading.Lock()
    _id()
    for fd in [fd for _, fd in _live.values()] + list(_serve_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _live.clear()
    _serve_fds.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def _live_path(directory: str, ident: str) -> str:
    return os.path.join(directory, f"live_{ident}.lock")


def _hold_live(directory: str) -> None:
    """Hold a shared flock on ``live_<id>.lock`` for as long as this process lives (the kernel drops it
    when the process ends: liveness that a reused pid cannot fake). A forked child closes its parent's."""
    me = os.getpid()
    with _live_lock:
        ent = _live.get(directory)
        if ent is not None and ent[0] == me:
            return
        if ent is not None:
            os.close(ent[1])  # the parent's, inherited by fork: the parent alone keeps its lock
        path = _live_path(directory, _id())
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # removed by a new run's clean-up meanwhile (:func:`_gone`): again, on a new file
        _live[directory] = (me, fd)


def _gone(directory: str, ident: str, remove: bool = False) -> bool:
    """True when no live process holds the live lock of ``<id>`` ``ident`` (``remove``: its lock file is
    removed too)."""
    path = _live_path(directory, ident)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:
        if remove and os.fstat(fd).st_ino == os.stat(path).st_ino:  # removed while locked: see _hold_live
            os.remove(path)
    except OSError:
        pass
    finally:
        os.close(fd)
    return True


def _db_files(directory: str) -> list[tuple[str, str, str, bool]]:
    """``(file, kind, id, ended)`` of each series file: ``ended`` for the files an earlier version renamed."""
    out = []
    for f in os.listdir(directory):
        m = _DB.match(f)
        if m:
            out.append((f, m.group(1), m.group(2), m.group(3) is not None))
    return out


def begin(directory: str) -> None:
    """Call before this process's series exist under ``directory`` (and in a forked child before it writes).

    When no other live process has files there (liveness by flock, not by pid), this is a new run: the files
    of the earlier run's processes are removed. While the run goes on, no process's files are removed or
    renamed (the counts of those that ended keep counting in the sums; :func:`reap` drops their live
    gauges). This process's files are named by its own ``<id>``, never another's (pids repeat).
    """
    me = _id()
    files = _db_files(directory)
    new_run = all(_gone(directory, i) for i in {i for _, _, i, ended in files if i != me and not ended})
    if new_run:
        for f, _, i, ended in files:
            try:
                if i != me and (ended or _gone(directory, i, remove=True)):
                    os.remove(os.path.join(directory, f))
            except OSError:
                pass
        for f in os.listdir(directory):
            m = _LIVE.match(f)
            if m and m.group(1) != me:
                _gone(directory, m.group(1), remove=True)
    _hold_live(directory)


def reserve(directory: str) -> None:
    """Create and allocate this process's files of :data:`PREFIXES` under ``directory`` (after :func:`begin`).

    Raises:
        OSError: the filesystem is full (ENOSPC) or refuses; the files allocated so far stay (valid, empty).
    """
    for prefix in PREFIXES:
        _AllocatedDict(os.path.join(directory, f"{prefix}_{_id()}.db")).close()


def reap(directory: str) -> None:
    """Remove the live-mode gauge files of processes that are gone (their counters stay)."""
    for i in {i for _, _, i, ended in _db_files(directory) if not ended and i != _id()}:
        if _gone(directory, i):
            mark_process_dead(i, directory)


class _Collector:
    """``MultiProcessCollector`` over ``directory`` that first forgets the gauges of dead processes."""

    def __init__(self, directory: str):
        self.directory = directory
        self._mp = MultiProcessCollector(None, path=directory)

    def collect(self):
        try:
            reap(self.directory)
        except OSError:
            pass
        return self._mp.collect()


def registry_for(directory: str) -> CollectorRegistry:
    """A registry whose collection is every process's series under ``directory``."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(directory))
    return reg


def _lock_file(directory: str) -> int:
    """A new descriptor of ``serve.lock``, recorded (a forked child closes it: :func:`_after_fork_in_child`);
    :func:`drop_serve_lock` closes it."""
    with _serve_fds_lock:
        fd = os.open(os.path.join(directory, "serve.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        _serve_fds.add(fd)
    return fd


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


def _own(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)


def take_serve_lock(directory: str) -> tuple[int | None, str]:
    """Try to become the process serving ``directory``'s port: ``(fd, "")`` holding an exclusive flock on
    ``serve.lock`` (keep the fd open while serving; :func:`drop_serve_lock`), or ``(None, holder)`` when
    another live process holds it (``holder``: its pid as written in the file, or ``"?"``)."""
    fd = _lock_file(directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        drop_serve_lock(fd)
        return None, holder
    _own(fd)
    return fd, ""


def wait_serve_lock(directory: str) -> tuple[int, str]:
    """Block until this process holds ``serve.lock`` (the serving process ended, or stopped serving):
    ``(fd, previous holder)``, the pid the previous holder wrote (``"?"`` when unknown)."""
    fd = _lock_file(directory)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        before = _holder(fd)
        _own(fd)
    except BaseException:
        drop_serve_lock(fd)
        raise
    return fd, before


def drop_serve_lock(fd: int | None) -> None:
    """Close a descriptor :func:`take_serve_lock` or :func:`wait_serve_lock` gave (its lock goes with it)."""
    if fd is not None:
        with _serve_fds_lock:
            _serve_fds.discard(fd)
            try:
                os.close(fd)
            except OSError:
                pass
