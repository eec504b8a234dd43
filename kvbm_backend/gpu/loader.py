"""Device load path: G3 slots -> device staging -> verified on the device -> caller's tensors.

This is what ``G3Pool.get(keys, tensors)`` runs (:meth:`kvbm_backend.pool.g3.pool.G3Pool.device_reader`):
the connector, the tiering tier and the benchmark reach it through the pool, never by wiring their own.

Data path per :meth:`DeviceLoader.load` (invariant 1 of DESIGN.md, "never wrong KV"):

1. ``source.lease(keys)`` pins each block's slot and gives a typed
   :class:`~kvbm_backend.pool.base.SlotLease` ``(key, path, offset, slot_len, token)`` (G3 slot: 4 KiB
   header + payload padded to 4 KiB); every lease goes back through ``source.release`` when the call
   ends, whatever happened. Anything but a ``SlotLease`` or None from ``lease`` is a wiring bug and
   raises ``TypeError`` (never a silent miss).
2. Leases are cut into passes of at most ``staging_bytes``; a pass's adjacent slots of one file form
   runs, and runs are cut at slot boundaries into reads of about ``io_bytes`` so many reads are in
   flight at once (``threads``). Passes are pipelined over a ring of ``depth`` staging buffers: the
   reads of passes k+1 .. k+depth-1 are on the wire while pass k is verified and copied out.
   ``gds`` / ``kvikio-compat`` -- kvikio ``CuFile.pread`` straight into device staging (GDS DMA, or
   kvikio's own pinned bounce buffer in compat mode); ``pinned-bounce`` -- ``preadv`` into a pinned host
   buffer, then each read's host-to-device copy from its reader thread on that thread's own CUDA stream
   (copies overlap the other reads); ``host`` -- the device is the CPU (same code, no copy).
   The mode is decided by :func:`probe_device_path` at start-up (a real write/read/compare in the
   pool's directory) and reported in :attr:`DeviceLoader.mode` / :attr:`DeviceLoader.mode_reason`.
3. The 4 KiB headers (only) come to the host: magic, version, header check, identity (namespace,
   tenant, rank, world, sequence hash), layout and lengths are checked
   (:class:`~kvbm_backend.model.frame.FrameHeader`).
4. Payload integrity is checked where the bytes landed: frames with ``FLAG_DEVCHECK`` are verified on
   the device with :func:`~kvbm_backend.gpu.checksum.device_checksums_torch` (one sync per pass);
   frames with only the xxh3_128 ``FLAG_CHECKSUM`` are copied to the host and checked there (counted as
   ``host_verified``); encrypted or unchecked frames are misses (``unverifiable``).
5. Only verified payloads are copied into ``dst[i]``; a failed probe, failed/short/late I/O, a bad
   header or a checksum mismatch leaves ``dst[i]`` untouched and returns ``False`` (a miss, counted;
   corrupt slots are reported to ``source.drop_corrupt(key, reason)``). Device work runs on the
   loader's own CUDA stream, so loads never queue behind (or in front of) the engine's compute.
"""
from __future__ import annotations

import errno
import logging
import os
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Sequence

from ..model.frame import FLAG_CHECKSUM, FLAG_DEVCHECK, FLAG_ENCRYPTED, HEADER_BYTES, FrameError
from ..model.frame import accept, payload_checksum
from ..model.layout import KvLayout
from ..model.namespace import BlockKey, tenant_tag
from ..pool.base import SlotLease, SlotLeaseSource
from .checksum import device_checksums_torch

log = logging.getLogger(__name__)

MODES = ("gds", "kvikio-compat", "pinned-bounce", "host")
PROBE_BYTES = 1 << 20


@dataclass
class ProbeResult:
    mode: str  # one of MODES
    reason: str
    kvikio: dict | None = None


def _torch():
    import torch
    return torch


def probe_device_path(directory: str, device, prefer: str = "auto") -> ProbeResult:
    """Decide how frames reach ``device``: a real probe, not a guess.

    For a CUDA device with kvikio usable: writes ``PROBE_BYTES`` random bytes to a unique temp file in
    ``directory``, reads them with kvikio into a device tensor and compares on the device. Success gives
    ``gds`` (kvikio reports GDS available) or ``kvikio-compat``; any failure gives ``pinned-bounce`` with
    the reason. A CPU device gives ``host``.

    Args:
        directory: a directory of the pool (the probe file is removed afterwards).
        device: torch device or string.
        prefer: ``auto``, or a mode to force (``pinned-bounce`` skips kvikio; ``gds``/``kvikio-compat``
            still run the probe and fall back if it fails).
    Raises:
        ValueError: unknown ``prefer``. OSError: ``directory`` not writable.
    """
    torch = _torch()
    if prefer not in ("auto",) + MODES:
        raise ValueError(f"prefer: expected auto or one of {MODES}, got {prefer!r}")
    dev = torch.device(device)
    if dev.type == "cpu":
        return ProbeResult("host", "device is the CPU: frames are read into host memory and verified there")
    if dev.type != "cuda":
        return ProbeResult("pinned-bounce", f"device type {dev.type!r}: no kvikio path, host bounce + copy")
    if prefer == "pinned-bounce":
        return ProbeResult("pinned-bounce", "forced by configuration")
    from ..io.kvikio_engine import KvikioEngine, kvikio_available, kvikio_mode
    ok, why = kvikio_available()
    if not ok:
        return ProbeResult("pinned-bounce", f"kvikio unusable: {why}")
    info = kvikio_mode()
    data = os.urandom(PROBE_BYTES)
    fd_tmp, path = tempfile.mkstemp(prefix=".kvbm-gpu-probe-", dir=directory)
    eng = None
    try:
        os.write(fd_tmp, data)
        os.fsync(fd_tmp)
        eng = KvikioEngine(threads=1)
        dst = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=dev)
        n = eng.read_to_device(fd_tmp, dst, PROBE_BYTES, 0)
        want = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        if n != PROBE_BYTES or not torch.equal(dst, want):
            return ProbeResult("pinned-bounce", f"kvikio probe read returned wrong bytes ({n} of {PROBE_BYTES})", info)
    except Exception as e:  # noqa: BLE001 - any failure means: do not use this path
        return ProbeResult("pinned-bounce", f"kvikio probe failed: {type(e).__name__}: {e}", info)
    finally:
        if eng is not None:
            eng.forget_fd(fd_tmp)
            eng.close()
        os.close(fd_tmp)
        os.unlink(path)
    if info.get("io") == "gds":
        return ProbeResult("gds", "kvikio probe read verified; cuFile reports GDS available", info)
    return ProbeResult("kvikio-compat", f"kvikio probe read verified; {info.get('reason', 'compat mode')}", info)


@dataclass
class _Pass:
    """One pass: leases ``rows`` (indexes into the call's keys) read into ``staging`` rows 0..n-1."""
    rows: list
    leases: list
    slot_len: int
    staging: object  # torch uint8 [n, slot_len] on the device (host mode: the CPU)
    host: object  # pinned/host torch uint8 [n, slot_len] the reads land in (None: kvikio reads to the device)
    ring: int  # ring slot the buffers came from
    futs: list  # (row0, nrows, future) per read
    status: list  # per pass row: None (read in full) or a reason


class DeviceLoader:
    """Loads G3 frames into device tensors, verifying them where they land first.

    Use through :meth:`kvbm_backend.pool.g3.pool.G3Pool.get` with tensor destinations (the pool owns one
    loader per device). Thread-safe: concurrent :meth:`load` calls are serialised (one I/O pipeline
    per device keeps the storage queue full; two would only compete for it).

    Args:
        source: a :class:`~kvbm_backend.pool.base.SlotLeaseSource` (the G3 pool); checked here.
        layout: the namespace's :class:`KvLayout`; ``dst`` tensors hold ``layout.bytes_per_block`` bytes.
        device: torch device for staging (``cuda:N``; ``cpu`` runs the same path on the host).
        probe_dir: directory for the start-up probe (a pool directory); default: none, which on CUDA
            means ``pinned-bounce`` unless ``mode`` forces otherwise.
        mode: ``auto`` (probe) or one of :data:`MODES`.
        world: the TP world size frames must name (None: not checked).
        tenant_tag_fn: expected 16-byte frame tenant tag of a key (default: G3's
            :func:`~kvbm_backend.model.namespace.tenant_tag` of ``key.tenant``).
        staging_bytes: most device staging bytes per pass (``depth`` passes in flight: at most
            ``depth * staging_bytes`` of extra HBM, plus as much pinned host memory in ``pinned-bounce``;
            default 128 MiB).
        depth: passes in flight (ring of staging buffers, at least 2; default 4).
        io_bytes: bytes per read (cut at slot boundaries; at least one slot).
        timeout_s: a call's reads not done by then are misses (their buffers are kept until the I/O
            finishes, never reused early).
        threads: reads in flight (bounce/host path) / kvikio thread pool size.
    Raises:
        TypeError: ``source`` is not a SlotLeaseSource. ValueError: bad arguments.
    """

    def __init__(self, source: SlotLeaseSource, layout: KvLayout, device="cuda", *, probe_dir: str | None = None,
                 mode: str = "auto", world: int | None = None,
                 tenant_tag_fn: Callable[[BlockKey], bytes] | None = None,
                 staging_bytes: int = 128 << 20, depth: int = 4, io_bytes: int = 8 << 20, timeout_s: float = 5.0,
                 threads: int = 8):
        torch = _torch()
        if not isinstance(source, SlotLeaseSource):
            missing = [m for m in ("lease", "release", "drop_corrupt") if not callable(getattr(source, m, None))]
            raise TypeError(f"DeviceLoader: source {type(source).__name__} is not a SlotLeaseSource "
                            f"(missing {missing}); pass the G3 pool itself")
        if mode not in ("auto",) + MODES:
            raise ValueError(f"mode: expected auto or one of {MODES}, got {mode!r}")
        if staging_bytes < 4096:
            raise ValueError(f"staging_bytes: at least 4096 bytes, got {staging_bytes}")
        if depth < 2:
            raise ValueError(f"depth: at least 2 passes in flight, got {depth}")
        if io_bytes < 4096:
            raise ValueError(f"io_bytes: at least 4096 bytes, got {io_bytes}")
        if not timeout_s > 0 or timeout_s == float("inf"):
            raise ValueError(f"timeout_s: must be a finite number > 0 seconds, got {timeout_s}")
        if threads < 1:
            raise ValueError(f"threads: at least 1, got {threads}")
        self.source = source
        self.layout = layout
        self.world = world
        self.device = torch.device(device)
        self.tenant_tag_fn = tenant_tag_fn or (lambda k: tenant_tag(k.tenant))
        self.staging_bytes = staging_bytes
        self.depth = depth
        self.io_bytes = io_bytes
        self.timeout_s = timeout_s
        self.threads = threads
        self.counters: Counter = Counter()
        self._fds: dict[str, int] = {}
        self._buffered: set = set()  # paths whose filesystem refused O_DIRECT
        self._stale_fds: list = []
        self._lock = threading.Lock()
        self._call_lock = threading.Lock()
        self._tls = threading.local()  # per reader thread: its CUDA stream for bounce copies
        self._abandoned: list = []  # (futures, buffers) of timed-out reads, kept alive until done
        self._ring: dict = {}  # (ring slot) -> (staging, host) buffers reused across calls
        self._engine = None
        self._pool = None
        self._stream = None
        if self.device.type == "cpu":
            probe = ProbeResult("host", "device is the CPU: frames are read into host memory and verified there")
        elif mode == "pinned-bounce":
            probe = ProbeResult("pinned-bounce", "forced by configuration")
        elif probe_dir is not None:
            probe = probe_device_path(probe_dir, self.device, prefer=mode)
        else:
            probe = ProbeResult("pinned-bounce", "no probe directory given: kvikio path not verified, not used")
        if mode in ("gds", "kvikio-compat") and probe.mode != mode:
            log.warning("device path %s requested but probe chose %s: %s", mode, probe.mode, probe.reason)
        self.mode, self.mode_reason, self.kvikio_info = probe.mode, probe.reason, probe.kvikio
        if self.mode in ("gds", "kvikio-compat"):
            from ..io.kvikio_engine import KvikioEngine
            self._engine = KvikioEngine(threads=threads)
        else:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvbm-dev-read")
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)
        log.info("device load path: %s (%s)", self.mode, self.mode_reason)

    # -- files -------------------------------------------------------------------------------
    def _fd(self, path: str) -> int:
        """The read fd of ``path``: O_DIRECT on the bounce/host paths where the filesystem takes it
        (reads DMA into the aligned staging, no page-cache copy: the storage's own rate), else buffered
        (kvikio opens its own handles from this fd)."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
                if self._engine is None and path not in self._buffered:
                    try:
                        fd = os.open(path, flags | os.O_DIRECT)
                        self.counters["files_o_direct"] += 1
                    except OSError as e:
                        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                            raise
                        self._buffered.add(path)
                if fd is None:
                    fd = os.open(path, flags)
                    self.counters["files_buffered"] += 1
                self._fds[path] = fd
            return fd

    def _fall_back_to_buffered(self, path: str, fd: int) -> None:
        """The filesystem opened ``path`` with O_DIRECT but refused the read (EINVAL): buffered from now
        on (the old fd stays open until :meth:`close`, another reader may still be using it)."""
        with self._lock:
            if self._fds.get(path) == fd and path not in self._buffered:
                self._buffered.add(path)
                self._stale_fds.append(self._fds.pop(path))
                self.counters["files_o_direct"] -= 1
                log.info("device reads of %s: O_DIRECT refused by the filesystem, buffered reads", path)

    # -- public ------------------------------------------------------------------------------
    def load(self, keys: Sequence[BlockKey], dst: Sequence, reasons: list | None = None) -> list[bool]:
        """Load ``keys[i]`` into ``dst[i]``.

        Args:
            keys: block keys of this rank.
            dst: one contiguous tensor per key on :attr:`device`, ``layout.bytes_per_block`` bytes each
                (any dtype; its bytes are overwritten with the FullyContiguous block
                ``[layer, outer, page, inner]``), e.g. rows of a staging tensor that the connector then
                scatters into the engine's paged KV.
            reasons: if given, a list that receives one entry per key: None (loaded) or why not
                (``not_found``, ``io_error``, ``short``, ``timeout``, ``unverifiable``, or a corrupt
                reason: ``devcheck``, ``integrity``, ``identity``, ``layout``, ``length``, ``magic``,
                ``version``, ``header_check``).
        Returns:
            ``ok[i]``: True only if the frame was found, read in full, its header identity matched and
            its payload checksum verified on :attr:`device`; only then was ``dst[i]`` written.
        Raises:
            ValueError: ``len(keys) != len(dst)``, or a ``dst`` tensor of the wrong size, device or
                layout (programming errors, not storage trouble).
            TypeError: the source returned something other than SlotLease/None (a wiring bug).
        """
        if len(keys) != len(dst):
            raise ValueError(f"load: {len(keys)} keys but {len(dst)} destination tensors")
        bpb = self.layout.bytes_per_block
        for i, t in enumerate(dst):
            if t.device != self.device and not (t.device.type == self.device.type == "cuda"
                                                and (self.device.index is None or t.device.index is None)):
                raise ValueError(f"dst[{i}]: on {t.device}, loader stages on {self.device}")
            if not t.is_contiguous() or t.numel() * t.element_size() != bpb:
                raise ValueError(f"dst[{i}]: need a contiguous tensor of {bpb} bytes, got "
                                 f"{t.numel() * t.element_size()} bytes contiguous={t.is_contiguous()}")
        n = len(keys)
        why: list = ["not_found"] * n
        if n == 0:
            return []
        leases = self.source.lease(list(keys))
        if len(leases) != n:
            raise TypeError(f"DeviceLoader: source.lease returned {len(leases)} leases for {n} keys")
        held = []
        for i, ls in enumerate(leases):
            if ls is None:
                continue
            if not isinstance(ls, SlotLease):
                # release what is typed before raising: a wiring bug must not leak pins
                self.source.release([x for x in leases if isinstance(x, SlotLease)])
                raise TypeError(f"DeviceLoader: source.lease returned {type(ls).__name__} for key {i}; "
                                "expected SlotLease or None")
            if ls.key != keys[i]:
                self.source.release([x for x in leases if isinstance(x, SlotLease)])
                raise TypeError(f"DeviceLoader: lease {i} is for {ls.key}, not {keys[i]}")
            held.append(i)
        self.counters["not_found"] += n - len(held)
        try:
            with self._call_lock:
                self._load_rows(keys, leases, held, dst, why)
        finally:
            try:
                self.source.release([leases[i] for i in held])
            except Exception as e:  # noqa: BLE001 - never mask the load's result
                log.warning("releasing %d slot leases failed: %s", len(held), e)
        ok = [w is None for w in why]
        self.counters["loaded"] += sum(ok)
        self.counters["missed"] += n - sum(ok)
        if reasons is not None:
            reasons[:] = why
        return ok

    def stats(self) -> dict:
        """Counters: ``loaded``, ``missed``, ``not_found``, ``io_error``, ``short``, ``timeout``,
        ``corrupt_<reason>`` (FrameError reasons, ``devcheck``), ``unverifiable``, ``host_verified``,
        ``bytes_read``, ``passes``, ``files_o_direct`` / ``files_buffered`` (how slab files are read on
        the bounce/host paths); seconds the caller's thread spent waiting for reads (``read_wait_s``),
        verifying and copying out on the device (``verify_s``) and in whole calls (``load_s``); plus
        ``mode`` and ``mode_reason`` (kvikio paths: ``kvikio_direct_reads``, whether kvikio reads with
        O_DIRECT)."""
        d = dict(self.counters)
        for k in ("read_wait_s", "verify_s", "load_s"):
            if k in d:
                d[k] = round(d[k], 6)
        d.update(mode=self.mode, mode_reason=self.mode_reason)
        if self._engine is not None:
            d["kvikio_direct_reads"] = self._engine.direct_reads
        return d

    def close(self) -> None:
        """Wait for reads in flight, release files, threads and buffers. Idempotent."""
        if self._engine is not None:
            for fs, _ in self._abandoned:
                for f in fs:
                    try:
                        f.get() if not hasattr(f, "result") else f.result()
                    except Exception:  # noqa: BLE001
                        pass
            for fd in list(self._fds.values()):
                self._engine.forget_fd(fd)
            self._engine.close()
            self._engine = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._abandoned = []
        self._ring = {}
        with self._lock:
            fds, self._fds = list(self._fds.values()) + self._stale_fds, {}
            self._stale_fds = []
        for fd in fds:
            os.close(fd)

    # -- internals ---------------------------------------------------------------------------
    @staticmethod
    def _runs(leases: list, max_rows: int | None = None) -> list[tuple[int, int]]:
        """[(first row, row count)] of rows whose slots are adjacent in one file, each run cut after
        ``max_rows`` rows (one read each)."""
        runs = []
        s = 0
        for r in range(1, len(leases) + 1):
            if (r == len(leases) or leases[r].path != leases[r - 1].path
                    or leases[r].offset != leases[r - 1].offset + leases[r - 1].slot_len
                    or (max_rows is not None and r - s >= max_rows)):
                runs.append((s, r - s))
                s = r
        return runs

    def _passes(self, leases: list, held: list) -> list[tuple[list, int]]:
        """Rows grouped into passes: one slot length each, at most ``staging_bytes`` of staging."""
        out = []
        todo = list(held)
        while todo:
            slot_len = leases[todo[0]].slot_len
            per = max(1, self.staging_bytes // slot_len)
            same = [i for i in todo if leases[i].slot_len == slot_len]
            for a in range(0, len(same), per):
                out.append((same[a:a + per], slot_len))
            sset = set(same)
            todo = [i for i in todo if i not in sset]
        return out

    def _buffers(self, ring: int, n: int, slot_len: int):
        """(staging, host) for a pass of ``n`` rows from ring slot ``ring`` (grown as needed)."""
        torch = _torch()
        need = n * slot_len
        buf = self._ring.get(ring)
        if buf is None or buf[0].numel() < need:
            if self.mode == "host":
                from ..memory import aligned_empty
                st = torch.from_numpy(aligned_empty(need))  # 4 KiB aligned: O_DIRECT reads land here
                host = st
            else:
                st = torch.empty(need, dtype=torch.uint8, device=self.device)
                host = torch.empty(need, dtype=torch.uint8, pin_memory=True) if self.mode == "pinned-bounce" else None
            buf = self._ring[ring] = (st, host)
        st, host = buf
        return (st[:need].view(n, slot_len), None if host is None else host[:need].view(n, slot_len))

    def _submit(self, p: _Pass) -> None:
        """Put the pass's reads on the wire (returns at once)."""
        rows_per_io = max(1, self.io_bytes // p.slot_len)
        for r0, nr in self._runs(p.leases, rows_per_io):
            ls = p.leases[r0]
            try:
                fd = self._fd(ls.path)
                if p.host is not None:
                    f = self._pool.submit(self._read_bounce, ls.path, fd, p.host[r0:r0 + nr], p.staging[r0:r0 + nr],
                                          ls.offset)
                else:
                    f = self._engine.read_to_device_async(fd, p.staging[r0:r0 + nr].reshape(-1), nr * p.slot_len,
                                                          ls.offset)
            except Exception as e:  # noqa: BLE001 - a read that cannot start: its rows are misses
                log.warning("frame read submit failed (%d rows at %s:%d): %s", nr, ls.path, ls.offset, e)
                self.counters["io_error"] += nr
                continue
            p.futs.append((r0, nr, f))

    def _read_bounce(self, path: str, fd: int, host, dev, offset: int) -> int:
        """One read of the bounce path (a reader thread): ``preadv`` into pinned host rows, then their
        host-to-device copy on this thread's own CUDA stream, so copies overlap the other reads (host
        mode: the rows are the staging, no copy). Returns the bytes read."""
        buf = host.numpy().reshape(-1)
        try:
            got = os.preadv(fd, [buf], offset)
        except OSError as e:
            if e.errno != errno.EINVAL or path in self._buffered:
                raise
            self._fall_back_to_buffered(path, fd)
            got = os.preadv(self._fd(path), [buf], offset)
        if got and dev.data_ptr() != host.data_ptr():
            torch = _torch()
            s = getattr(self._tls, "stream", None)
            if s is None:
                s = self._tls.stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(s):
                dev.view(-1)[:got].copy_(host.view(-1)[:got], non_blocking=True)
            s.synchronize()
        return got

    def _reap(self, p: _Pass, deadline: float) -> None:
        """Wait for the pass's reads (until ``deadline``); fill ``p.status``."""
        pending = []
        for r0, nr, f in p.futs:
            left = deadline - time.monotonic()
            try:
                if hasattr(f, "result"):  # concurrent.futures
                    got = f.result(timeout=max(0.0, left))
                else:  # kvikio IOFuture: poll to honour the deadline
                    while not f.done() and time.monotonic() < deadline:
                        time.sleep(0.0002)
                    if not f.done():
                        raise TimeoutError
                    got = f.get()
            except TimeoutError:
                self.counters["timeout"] += nr
                for r in range(r0, r0 + nr):
                    p.status[r] = "timeout"
                pending.append(f)
                continue
            except Exception as e:  # noqa: BLE001 - I/O failure: a miss
                log.warning("frame read failed (%d rows at %s:%d): %s", nr, p.leases[r0].path,
                            p.leases[r0].offset, e)
                self.counters["io_error"] += nr
                continue
            self.counters["bytes_read"] += got
            full = got // p.slot_len
            for r in range(r0, r0 + nr):
                p.status[r] = None if r - r0 < full else "short"
            if full < nr:
                self.counters["short"] += nr - full
        if pending:  # keep the buffers alive until the I/O ends; never hand them out again
            self._abandoned.append((pending, self._ring.pop(p.ring, None)))
        self._abandoned = [a for a in self._abandoned if not all(
            (x.done() if hasattr(x, "done") else True) for x in a[0])]

    def _load_rows(self, keys, leases, held, dst, why) -> None:
        torch = _torch()
        bpb = self.layout.bytes_per_block
        deadline = time.monotonic() + self.timeout_s
        passes = []
        for rows, slot_len in self._passes(leases, held):
            if slot_len < HEADER_BYTES + bpb or slot_len % 4096:
                self.counters["corrupt_length"] += len(rows)
                for i in rows:
                    why[i] = "length"
                continue
            passes.append((rows, slot_len))
        inflight: deque = deque()
        t0 = time.perf_counter()
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else _null()
        with ctx:
            for k, (rows, slot_len) in enumerate(passes):
                if len(inflight) == self.depth:  # the ring slot of pass k - depth is free after this
                    self._finish(inflight.popleft(), keys, dst, why, deadline)
                ring = k % self.depth
                staging, host = self._buffers(ring, len(rows), slot_len)
                cur = _Pass(rows, [leases[i] for i in rows], slot_len, staging, host, ring, [],
                            ["io_error"] * len(rows))
                if time.monotonic() < deadline:
                    self._submit(cur)
                else:
                    cur.status = ["timeout"] * len(rows)
                    self.counters["timeout"] += len(rows)
                self.counters["passes"] += 1
                inflight.append(cur)
            while inflight:
                self._finish(inflight.popleft(), keys, dst, why, deadline)
        self.counters["load_s"] += time.perf_counter() - t0

    def _finish(self, p: _Pass, keys, dst, why, deadline: float) -> None:
        """Reap, verify and copy out one pass (its ring buffers are free again on return)."""
        t0 = time.perf_counter()
        self._reap(p, deadline)
        t1 = time.perf_counter()
        self.counters["read_wait_s"] += t1 - t0
        try:
            self._verify_copy(p, keys, dst, why)
        finally:
            self.counters["verify_s"] += time.perf_counter() - t1

    def _verify_copy(self, p: _Pass, keys, dst, why) -> None:
        """Check headers and payloads of a read pass; copy the verified payloads into ``dst``."""
        n = len(p.rows)
        bpb = self.layout.bytes_per_block
        staging = p.staging
        for r in range(n):
            why[p.rows[r]] = p.status[r]
        good = [r for r in range(n) if p.status[r] is None]
        if not good:
            return
        # headers come to the host (pinned-bounce: already there)
        if p.host is not None:
            headers = p.host[:, :HEADER_BYTES].numpy()
        elif self.device.type == "cpu":
            headers = staging[:, :HEADER_BYTES].numpy()
        else:
            headers = staging[:, :HEADER_BYTES].cpu().numpy()
        devcheck_rows, expect, host_rows = [], [], []
        for r in good:
            i = p.rows[r]
            try:
                h = accept(headers[r], keys[i], self.layout, self.tenant_tag_fn(keys[i]), world=self.world,
                           stored_len=bpb, frame_bytes=p.slot_len)
                if h.flags & FLAG_ENCRYPTED:
                    raise FrameError("unverifiable", "encrypted frame on the device path (G4 loads go through the host)")
                if h.flags & FLAG_DEVCHECK:
                    devcheck_rows.append(r)
                    expect.append(h.dev_check)
                elif h.flags & FLAG_CHECKSUM:
                    host_rows.append((r, h))
                else:
                    raise FrameError("unverifiable", "frame carries no checksum")
            except FrameError as e:
                p.status[r] = e.reason
        ok_rows = []
        if devcheck_rows:
            rows_t = staging[devcheck_rows] if len(devcheck_rows) != n else staging
            got = device_checksums_torch(rows_t, HEADER_BYTES, bpb)  # one sync for the pass
            for r, g, e in zip(devcheck_rows, got, expect):
                if g == e:
                    ok_rows.append(r)
                else:
                    p.status[r] = "devcheck"
        for r, h in host_rows:
            pay = p.host[r, HEADER_BYTES:HEADER_BYTES + bpb] if p.host is not None else \
                staging[r, HEADER_BYTES:HEADER_BYTES + bpb]
            pay_h = pay.numpy() if pay.device.type == "cpu" else pay.cpu().numpy()
            if payload_checksum(pay_h) == h.integrity:
                ok_rows.append(r)
                self.counters["host_verified"] += 1
            else:
                p.status[r] = "integrity"
        if ok_rows:  # one multi-tensor copy for the pass (not one launch per block)
            dsts = [_bytes_view(dst[p.rows[r]]) for r in ok_rows]
            srcs = [staging[r, HEADER_BYTES:HEADER_BYTES + bpb] for r in ok_rows]
            _copy_all(dsts, srcs)
        for r in range(n):
            i = p.rows[r]
            why[i] = p.status[r]
            reason = p.status[r]
            if reason in (None, "io_error", "short", "timeout"):
                continue
            self.counters["unverifiable" if reason == "unverifiable" else f"corrupt_{reason}"] += 1
            if reason != "unverifiable":
                try:
                    self.source.drop_corrupt(keys[i], reason)
                except Exception as e:  # noqa: BLE001
                    log.warning("drop_corrupt failed for %s: %s", keys[i], e)
        if self._stream is not None:
            self._stream.synchronize()  # dst written; staging free for the pass after next


def _bytes_view(t):
    """1-D uint8 view of a contiguous tensor's bytes."""
    torch = _torch()
    t = t.view(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _copy_all(dsts: list, srcs: list) -> None:
    """``dsts[i].copy_(srcs[i])`` for all i on the current stream, fused where torch can
    (``torch._foreach_copy_``), else one copy per pair."""
    torch = _torch()
    fused = getattr(torch, "_foreach_copy_", None)
    if fused is not None and len(dsts) > 1:
        fused(dsts, srcs, non_blocking=True)
        return
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=True)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
