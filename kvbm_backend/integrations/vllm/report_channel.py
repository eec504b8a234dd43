"""Worker -> scheduler G3 index reports that do not wait for an engine step (issue 26 B).

vLLM carries a worker's ``KvbmWorkerMeta`` to the scheduler only inside the output of a later engine step;
blocks whose offload completed after the last step stayed unknown to the scheduler's
:class:`~.g3_mirror.G3Mirror` (and unpublished to the KV router) until the engine ran again, so a user
returning after a pause recomputed what G3 held. Here the worker's report pump
(:class:`ReportPump`) sends its G3 index changes every ``PUMP_INTERVAL_S`` seconds:

* to a scheduler in the same process (vLLM's ``uni`` executor with KV events on) by a direct call;
* to a scheduler in another process (the ``mp`` executor: ``vllm serve`` on CPU, TP > 1 under ``mp`` or ray)
  over a Unix stream socket in a directory only this user can enter (``$XDG_RUNTIME_DIR`` or the system
  temp dir, ``kvbm-backend-<uid>``, mode 0700, refused when another user owns it). Messages are
  length-prefixed binary records (:func:`encode`), never pickles: a peer that can connect can at worst
  announce blocks the worker does not hold, which makes a load miss and recompute (loads verify every
  block), never wrong KV;
* under ``external_launcher`` with TP > 1 (every TP rank a process hosting a scheduler and its own rank's worker)
  to that process's scheduler by a direct call, which holds it until every rank's scheduler exchanges what it holds
  over vLLM's TP group at the same step (:class:`TpReportExchange`).

Both ends derive the address from the engine's ``kv_transfer_config.engine_id``, data-parallel rank, namespace
and a random token the scheduler draws at start and sends its workers in every step's connector metadata
(``KvbmConnectorMetadata.channel``; :func:`channel_key`). The token makes the address one engine's even when two
engines on one host (or in one process) are given the same explicit ``engine_id`` (a copied Dynamo config):
before 2026-11-30 the address came from the engine id alone, so the second engine's scheduler took the first's
socket (unlinked as "stale") and its in-process listener, and the first engine's worker reports reached the other
engine's scheduler (its own mirror never filled: G3 hits missed). A worker uses the channel when it can reach the
scheduler's listener at its first report, with the token of the metadata bound then; otherwise (no token, no
listener: an older scheduler, a directory it may not use) its reports keep travelling in the step output. Each worker's reports take exactly one of the two ways for the engine's
lifetime, so they arrive in order. A scheduler that takes none of a report's bytes for ``STALL_S`` seconds (a
stopped or hung process) fails the channel (the worker's reports go back to the step output, with a new
snapshot) rather than blocking the worker's pump for ever, and at shutdown the pump is not waited for more than
2 s; one pump sends at a time (before 2026-11-30 the pump sent with a blocking ``sendall`` and no timeout, and
``ReportPump.stop`` sent a second report on the same socket while the pump thread was blocked in the first).
"""
from __future__ import annotations

import atexit
import hashlib
import logging
import os
import secrets
import socket
import struct
import tempfile
import threading
from typing import Callable, Iterator
from ...threads import start_thread

log = logging.getLogger("kvbm_backend.connector")

PUMP_INTERVAL_S = 0.1  # how often a worker sends the G3 index changes it has (seconds)
_ENTRY = struct.Struct("<16sIQ")  # (tenant tag, rank, seq_hash): metadata.mirror_id
_HEAD = struct.Struct("<IIIBII")  # length of the rest, group, TP rank, snapshot, n added, n removed
MAX_ENTRIES = 1 << 22             # per message: a message announcing more is refused (not applied)
#: a worker gives the channel up when the scheduler has taken none of a report's bytes for this long (seconds;
#: a scheduler process that is stopped or hung): its reports go back to the step output
STALL_S = 30.0

#: listeners of schedulers in this process, by channel key (the ``uni`` executor's worker calls them)
_local: dict[str, Callable] = {}
_local_lock = threading.Lock()

Report = tuple[int, int, list, list, bool]  # (group, TP rank, added, removed, snapshot)


def channel_key(engine_id: str, dp_rank: int, namespace: str, token: str = "") -> str:
    """Key shared by an engine's scheduler and its workers: sha256 of engine id, data-parallel rank, namespace
    fingerprint and the scheduler's token (:func:`new_token`), 24 hex characters (the socket is
    ``<dir>/<key>.sock``: its length does not grow with the inputs)."""
    raw = f"{engine_id}|{dp_rank}|{namespace}|{token}"
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def new_token() -> str:
    """A scheduler's report channel token: 16 random hex characters (64 bits), new at every start."""
    return secrets.token_hex(8)


def _private_dir() -> str | None:
    """``kvbm-backend-<uid>`` under ``$XDG_RUNTIME_DIR`` (else the temp dir), created 0700; None when it
    exists but belongs to another user or others may enter it (then the channel is not used)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    d = os.path.join(base, f"kvbm-backend-{os.getuid()}")
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        log.info("kvbm_backend: report channel directory %s: %s; G3 reports travel with engine steps", d, e)
        return None
    st = os.lstat(d)
    import stat as _stat
    if not _stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        log.warning("kvbm_backend: report channel directory %s is not a private directory of this user "
                    "(owner %d, mode %o); G3 reports travel with engine steps", d, st.st_uid, st.st_mode & 0o777)
        return None
    return d


def socket_path(key: str) -> str | None:
    d = _private_dir()
    return None if d is None else os.path.join(d, f"{key}.sock")


def encode(group: int, rank: int, added: list, removed: list, snapshot: bool) -> bytes:
    """One report of TP rank ``rank`` as bytes: ``_HEAD`` then the added and removed ``(tag, rank, seq_hash)``
    entries."""
    body = b"".join(_ENTRY.pack(*e) for e in added) + b"".join(_ENTRY.pack(*e) for e in removed)
    return _HEAD.pack(_HEAD.size - 4 + len(body), group, rank, 1 if snapshot else 0, len(added), len(removed)) + body


def pieces(added: list, removed: list, snapshot: bool, cap: int) -> Iterator[tuple[list, list, bool]]:
    """One report as messages of at most ``cap`` entries, in the order the mirror applies them: removals,
    then additions; a snapshot's first message replaces the rank's set, the others add to it. Before
    2026-11-29 a report was one message, and one over ``MAX_ENTRIES`` (a restored G3 of more than 4.2M blocks
    per rank) was refused: the channel closed and the mirror stayed empty for the engine's life."""
    if len(added) + len(removed) <= cap:
        yield added, removed, snapshot
        return
    first = True
    for i in range(0, len(removed), cap):
        yield [], removed[i:i + cap], snapshot and first
        first = False
    for i in range(0, len(added), cap):
        yield added[i:i + cap], [], snapshot and first
        first = False


def decode(buf: bytes) -> Report:
    """Inverse of :func:`encode` (``buf`` without its 4-byte length). Raises ValueError on a malformed report."""
    if len(buf) < _HEAD.size - 4:
        raise ValueError("report channel: short header")
    group, rank, snap, na, nr = struct.unpack_from("<IIBII", buf, 0)
    off = _HEAD.size - 4
    if na + nr > MAX_ENTRIES or len(buf) != off + (na + nr) * _ENTRY.size:
        raise ValueError(f"report channel: {na}+{nr} entries do not match {len(buf)} bytes")
    ents = [_ENTRY.unpack_from(buf, off + i * _ENTRY.size) for i in range(na + nr)]
    return group, rank, ents[:na], ents[na:], bool(snap)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        b = sock.recv(min(n - got, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


class ReportListener:
    """The scheduler's end: ``on_report(group, rank, added, removed, snapshot)`` is called for every report, from
    the caller's thread (same process) or this listener's threads (one per connected worker)."""

    def __init__(self, key: str, on_report: Callable[[int, int, list, list, bool], None]):
        self.key, self.on_report = key, on_report
        self.path: str | None = None
        self._sock: socket.socket | None = None
        self._closed = False
        with _local_lock:
            _local[key] = on_report
        path = socket_path(key)
        if path is None:
            return
        try:
            if os.path.exists(path):
                os.unlink(path)  # a stale socket of a scheduler that died (the key names this engine)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            os.chmod(path, 0o600)
            s.listen(64)
        except OSError as e:
            log.warning("kvbm_backend: report channel %s not available (%s); G3 reports travel with engine "
                        "steps", path, e)
            return
        self.path, self._sock = path, s
        atexit.register(self.close)  # the socket file goes with the process (engine ids are new each start)
        start_thread(self._accept, args=(s,), name="kvbm-report-listen")

    def _accept(self, sock: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            start_thread(self._serve, args=(conn,), name="kvbm-report-recv")

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed:
                head = _recv_exact(conn, 4)
                if head is None:
                    return
                (n,) = struct.unpack("<I", head)
                if n > (_HEAD.size + MAX_ENTRIES * _ENTRY.size):
                    log.warning("kvbm_backend: report channel: a %d-byte report refused; connection closed", n)
                    return
                buf = _recv_exact(conn, n)
                if buf is None:
                    return
                try:
                    self.on_report(*decode(buf))
                except Exception as e:  # noqa: BLE001 - a bad report is dropped, the channel goes on
                    log.warning("kvbm_backend: report channel: report not applied: %s", e)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _local_lock:
            if _local.get(self.key) is self.on_report:
                del _local[self.key]
        if self._sock is not None and self.path is not None:  # set together
            try:
                self._sock.close()
            finally:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass


class ReportSender:
    """A worker's end: :meth:`connect` once, then :meth:`send` reports (in order, from one thread at a time)."""

    def __init__(self, key: str):
        self.key = key
        self._direct: Callable | None = None
        self._sock: socket.socket | None = None
        self._broken = False

    def connect(self) -> bool:
        """True when a listener for this key is reachable (in this process, or its socket)."""
        with _local_lock:
            self._direct = _local.get(self.key)
        if self._direct is not None:
            return True
        path = socket_path(self.key)
        if path is None or not os.path.exists(path):
            return False
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            s.settimeout(STALL_S)  # each send waits at most this long for the scheduler to take bytes
        except OSError:
            return False
        self._sock = s
        return True

    def send(self, group: int, rank: int, added: list, removed: list, snapshot: bool) -> None:
        """Deliver one report of TP rank ``rank``, in messages of at most :data:`MAX_ENTRIES` entries (a
        restored G3 of millions of blocks is one snapshot). Raises OSError when the scheduler's end is gone,
        or has taken none of the bytes for :data:`STALL_S` seconds (``TimeoutError``); the channel is then
        closed (a message may have been cut: nothing more may follow it) and every later send raises too."""
        if self._direct is not None:
            self._direct(group, rank, added, removed, snapshot)
            return
        sock = self._sock
        if sock is None or self._broken:
            raise OSError("report channel not connected")
        try:
            for a, r, snap in pieces(added, removed, snapshot, MAX_ENTRIES):
                view = memoryview(encode(group, rank, a, r, snap))
                while view:  # send(), not sendall(): the timeout bounds a stall, not a long message
                    view = view[sock.send(view):]
        except OSError:
            self.abort()
            raise

    def abort(self) -> None:
        """Give the channel up: the scheduler sees it end (a cut message is dropped there), and a send blocked
        in another thread returns with an OSError."""
        self._broken = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        if self._sock is not None:
            self._broken = True
            self._sock.close()
            self._sock = None


class ReportPump:
    """Sends TP rank ``rank``'s G3 index changes (``sources[group]()`` -> ``(added, removed, snapshot)`` or
    None) through ``sender`` every ``interval_s`` seconds, on its own thread, until :meth:`stop`."""

    def __init__(self, sender: ReportSender, sources: list[Callable], rank: int = 0,
                 interval_s: float = PUMP_INTERVAL_S, on_closed: Callable[[], None] | None = None):
        self.sender, self.sources, self.rank, self.interval_s = sender, sources, rank, interval_s
        self.on_closed = on_closed  # the channel failed: reports go back to the step output (a new snapshot)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one pump at a time: two senders' bytes would interleave on the socket
        self._t = start_thread(self._loop, name="kvbm-report-pump")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.pump()

    def pump(self) -> None:
        with self._lock:
            self._pump_locked()

    def _pump_locked(self) -> None:
        if self.sender._broken:  # the channel failed before (on_closed was called then)
            return
        for gi, src in enumerate(self.sources):
            try:
                rep = src()
                if rep is not None:
                    self.sender.send(gi, self.rank, *rep)
            except OSError as e:  # the scheduler's end went away or refused a report
                log.info("kvbm_backend: report channel closed: %s; G3 reports travel with engine steps", e)
                self._stop.set()
                if self.on_closed is not None:
                    self.on_closed()
                return
            except Exception as e:  # noqa: BLE001 - never kill the pump
                log.warning("kvbm_backend: G3 report not sent: %s", e)

    def stop(self) -> None:
        """Stop the pump and send what the last interval gathered; a pump blocked on a scheduler that takes
        no bytes is not waited for more than 2 s (the channel is given up: the engine is shutting down)."""
        self._stop.set()
        self._t.join(timeout=2.0)
        if self._t.is_alive():
            self.sender.abort()
        self.pump()  # what the last interval gathered (nothing once the channel was given up)
        self.sender.close()


def start_worker_reports(key: str, workers: list, rank: int = 0) -> ReportPump | None:
    """TP rank ``rank``'s decision at its first report: when the scheduler's listener for ``key`` is reachable,
    every worker (one per KV cache group; ``report_g3``, ``report_by_channel``, ``take_g3_report`` of
    :class:`~.worker_side.WorkerSide`) sends its G3 index changes by a :class:`ReportPump` from now on;
    else (None) they keep travelling in the step output."""
    if not any(w.report_g3 for w in workers):
        return None
    sender = ReportSender(key)
    if not sender.connect():
        log.info("kvbm_backend: no report channel to the scheduler; G3 reports travel with engine steps")
        return None
    for w in workers:
        w.report_by_channel = True

    def back_to_steps() -> None:  # a report the channel lost is made whole by a new snapshot in the step output
        for w in workers:
            w.resend_snapshot()
            w.report_by_channel = False
    return ReportPump(sender, [w.take_g3_report if w.report_g3 else (lambda: None) for w in workers], rank,
                      on_closed=back_to_steps)


class TpReportExchange:
    """G3 reports under vLLM's ``external_launcher`` with TP > 1, where every TP rank is its own process hosting a
    scheduler and that rank's worker, and each process's engine sees only its own worker's output (vLLM's
    ``ExecutorWithExternalLauncher`` runs one worker and aggregates nothing). Before 2026-12-03 each scheduler's
    :class:`~.g3_mirror.G3Mirror` received its own rank's reports only: a lookup, which needs every rank's slice,
    never hit (the whole G3 tier silently lost), and the mirror never got every rank's snapshot.

    Here the reports the scheduler's channel receives (its own worker's, from any thread: :meth:`put`) are held,
    and at :meth:`exchange`, which every rank's scheduler calls at the same point of the same step
    (``build_connector_meta``; ``external_launcher`` needs deterministic scheduling anyway), every rank's held
    reports are gathered over vLLM's TP group (its CPU process group: :func:`encode`'s bytes, no pickle) and applied
    on every rank in rank order by ``apply(group, rank, added, removed, snapshot)``: every rank's mirror holds the
    same blocks at the same step, so every scheduler decides the same hits (ranks that decided differently would
    schedule differently and desynchronise the engine's collectives). The mirror's bounded wait for the first
    snapshots is agreed too: ``on_wait_over()`` is called on every rank at the same step, once any rank has waited
    ``wait_s`` seconds (the scheduler's own wall-clock wait would end at different steps on different ranks)."""

    def __init__(self, group, apply: Callable[[int, int, list, list, bool], None], wait_s: float,
                 on_wait_over: Callable[[], None]):
        self.group, self.apply, self.wait_s, self.on_wait_over = group, apply, float(wait_s), on_wait_over
        self._held: list[bytes] = []
        self._lock = threading.Lock()
        self._t0: float | None = None
        self._wait_over = False

    def put(self, group: int, rank: int, added: list, removed: list, snapshot: bool) -> None:
        """Hold one report (TP rank ``rank``'s, of KV cache group ``group``) for the next :meth:`exchange`."""
        msgs = [encode(group, rank, a, r, s) for a, r, s in pieces(added, removed, snapshot, MAX_ENTRIES)]
        with self._lock:
            self._held.extend(msgs)

    def exchange(self) -> int:
        """Gather every TP rank's held reports and apply them all, in rank order; returns how many were applied.
        Raises RuntimeError when the TP group's collective fails (a rank is gone): going on would leave this
        rank's mirror unlike the others', and their schedules would diverge."""
        import time

        from .tp_agree import all_gather_bytes
        with self._lock:
            held, self._held = self._held, []
        now = time.monotonic()
        self._t0 = self._t0 if self._t0 is not None else now
        expired = int(not self._wait_over and now - self._t0 >= self.wait_s)
        blobs = all_gather_bytes(self.group, bytes([expired]) + b"".join(held), "the G3 reports")
        if not self._wait_over and any(b[:1] == b"\x01" for b in blobs):
            self._wait_over = True
            self.on_wait_over()
        applied = 0
        for data in blobs:
            off, size = 1, len(data)  # after the rank's wait-over flag
            while off + 4 <= size:
                (n,) = struct.unpack_from("<I", data, off)
                try:
                    self.apply(*decode(data[off + 4:off + 4 + n]))
                    applied += 1
                except Exception as e:  # noqa: BLE001 - the same bytes on every rank: dropped on every rank
                    log.warning("kvbm_backend: G3 report of the TP group not applied: %s", e)
                off += 4 + n
        return applied
