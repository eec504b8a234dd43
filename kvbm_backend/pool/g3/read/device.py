"""Device load path: G3 slots -> device staging -> verified on the device -> caller's tensors.

This is what ``G3Pool.get(keys, tensors)`` runs (:meth:`kvbm_backend.pool.g3.pool.G3Pool.device_reader`):
the connector, the tiering tier and the benchmark reach it through the pool, never by wiring their own.

Data path per :meth:`DeviceLoader.load` (docs/invariants.md #1, "never wrong KV"):

1. ``source.lease(keys)`` pins each block's slot and gives a typed
   :class:`~kvbm_backend.pool.base.SlotLease` ``(key, path, offset, slot_len, token)`` (G3 slot: 4 KiB
   header + payload padded to 4 KiB); every lease goes back through ``source.release`` when the call
   ends, whatever happened. Anything but a ``SlotLease`` or None from ``lease`` is a wiring bug and
   raises ``TypeError`` (never a silent miss).
2. Leases are cut into passes of at most ``staging_bytes``; a pass's adjacent slots of one file form
   runs, and runs are cut at slot boundaries into reads of about ``io_bytes`` so many reads are in
   flight at once (``threads``). Passes are pipelined over a ring of ``depth`` staging buffers: the
   reads of later passes are on the wire while pass k is verified and copied out, and the loader's
   thread never waits for the device: once pass k's reads are in it queues pass k's checks on the
   device (:meth:`~.verify.PassVerifier.launch`) and completes pass k - 1 (headers checked, checksums
   compared, good rows' copy-out queued: :meth:`~.verify.PassVerifier.complete`); a ring slot is reused
   after an event says the device is done with it, and the call ends with one stream sync.
   ``gds`` / ``kvikio-compat`` -- kvikio ``CuFile.pread`` straight into device staging (GDS DMA, or
   kvikio's own pinned bounce buffer in compat mode); ``pinned-bounce`` -- reader threads ``preadv``
   into the pass's pinned host rows (O_DIRECT where taken), then one host-to-device DMA per pass on the
   loader's stream; ``host`` -- the device is the CPU (the same reader threads, reads land in the staging).
   The mode is decided by :func:`probe_device_path` at start-up (a real write/read/compare in the
   pool's directory) and reported in :attr:`DeviceLoader.mode` / :attr:`DeviceLoader.mode_reason`.
3. The headers (only; their first 256 bytes on the kvikio paths) come to the host: magic, version,
   header check, identity (namespace, tenant, rank, world, sequence hash), layout and lengths are
   checked for a whole pass at once (:meth:`~kvbm_backend.model.frame.ChecksumFrames.check_headers`;
   a header that fails there is parsed again to name the reason, :func:`.stages.check_frame`).
4. Payload integrity is checked where the bytes landed: frames with ``FLAG_DEVCHECK`` are verified on
   the device with :func:`~kvbm_backend.gpu.checksum.device_limb_sums` (the sums come back to pinned
   memory by a queued copy; no sync);
   frames with only the xxh3_128 ``FLAG_CHECKSUM`` are copied to the host and checked there (counted as
   ``host_verified``); encrypted or unchecked frames are misses (``unverifiable``).
5. Only verified payloads are copied into ``dst[i]``; a failed probe, failed/short/late I/O, a bad
   header or a checksum mismatch leaves ``dst[i]`` untouched and returns ``False`` (a miss, counted;
   corrupt slots are reported to ``source.drop_corrupt(key, reason)``). Device work runs on the
   loader's own CUDA stream, so loads never queue behind (or in front of) the engine's compute.

Where each job lives (the device side of the G3 reader, :mod:`kvbm_backend.pool.g3.read`): this module
holds :class:`DeviceLoader` (arguments, the call, pipelining of passes, stats, close); :mod:`.stages`
the lease check and the frame header check shared with the layer-wise loads; :mod:`.passes`
:class:`~.passes.PassReader` (a part: file fds, the staging ring, a pass's reads and their reaping, the
bounce path included); :mod:`.verify` :class:`~.verify.PassVerifier` (a part: steps 3-5);
:mod:`kvbm_backend.transfer` plans passes and reads (:func:`~kvbm_backend.transfer.group_passes`,
:func:`~kvbm_backend.transfer.contiguous_runs`); device primitives come from :mod:`kvbm_backend.gpu`
(:func:`~kvbm_backend.gpu.probe.probe_device_path` the mode selection, re-exported here;
:mod:`kvbm_backend.gpu.staging` the pinned / host staging buffers; :mod:`kvbm_backend.gpu.checksum`),
slab file fds from :class:`kvbm_backend.io.files.ReadFiles`.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

import numpy as np

from ....model.frame import HEADER_BYTES
from ....model.layout import KvLayout
from ....model.namespace import BlockKey
from ...base import SlotLease, SlotLeaseSource
from ..index import key_tag
from ....deadlines import Deadline
from ....transfer import file_order, group_passes
from ....gpu.probe import MODES, PROBE_BYTES, ProbeResult, probe_device_path
from ....gpu.rows import BlockRows
from .passes import PassReader, _Pass
from .stages import add_seconds, lease_all, release_quietly
from .verify import PassVerifier

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceLoader", "probe_device_path", "ProbeResult", "MODES", "PROBE_BYTES"]

log = logging.getLogger(__name__)


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
        mode: ``auto`` (probe) or one of :data:`MODES`. A CPU device runs ``host`` unless ``pinned-bounce``
            is asked: then the bounce path itself (separate host rows, one copy into the staging per pass, the
            staging ring; plain host memory, no CUDA stream) runs on the CPU, so tests cover its wiring.
        world: the TP world size frames must name (None: not checked).
        tenant_tag_fn: expected 16-byte frame tenant tag of a key (default: :func:`~..index.key_tag`: a restored
            key's tag, else the tenant's).
        staging_bytes: most device staging bytes per pass (``depth`` passes in flight: at most
            ``depth * staging_bytes`` of extra HBM, plus as much pinned host memory in ``pinned-bounce``;
            default 128 MiB).
        depth: passes in flight (ring of staging buffers, at least 2; default 4).
        io_bytes: bytes per read on the bounce/host paths (cut at slot boundaries; at least one slot). The
            kvikio paths read a pass's runs whole (at least ``staging_bytes`` per read; kvikio cuts each into its
            ``task_size`` pieces over its threads): on an H200 host (tmpfs, 16 threads, 2026-12-04) 16 MiB reads
            put 392 reads on the wire per 4 GiB load, whole runs 132, and loads took 34.1 vs 34.6 GB/s (depth 4)
            and 33.7 vs 36.5 (depth 8).
        timeout_s: a call's reads not done by then are misses (their buffers are kept until the I/O
            finishes, never reused early).
        threads: reads in flight (bounce/host path) / kvikio thread pool size.
        o_direct: False: the bounce/host paths read the slab files buffered (``g3.o_direct: off``); True: with
            O_DIRECT where the filesystem takes it.
    Raises:
        TypeError: ``source`` is not a SlotLeaseSource. ValueError: bad arguments.
    """

    def __init__(self, source: SlotLeaseSource, layout: KvLayout, device: str | torch.device = "cuda", *,
                 probe_dir: str | None = None, mode: str = "auto", world: int | None = None,
                 tenant_tag_fn: Callable[[BlockKey], bytes] | None = None,
                 staging_bytes: int = 128 << 20, depth: int = 4, io_bytes: int = 8 << 20, timeout_s: float = 5.0,
                 threads: int = 8, o_direct: bool = True) -> None:
        import torch
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
        # a restored TagKey names its tag, not its tenant (before 2026-12-02 its tenant placeholder was hashed: every
        # key G3Pool.keys() gave out missed a device get, counted corrupt_identity, its slot re-read and kept)
        self.tenant_tag_fn = tenant_tag_fn or key_tag
        self.staging_bytes = staging_bytes
        self.depth = depth
        self.timeout_s = timeout_s
        self.threads = threads
        self.counters: Counter[str] = Counter()
        self._call_lock = threading.Lock()
        self._stream: torch.cuda.Stream | None = None
        if self.device.type == "cpu" and mode == "pinned-bounce":
            probe = ProbeResult("pinned-bounce", "forced on the CPU: reads land in host rows copied into the "
                                "staging once per pass (the CUDA bounce path's wiring, no pinned memory)")
        elif self.device.type == "cpu":
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
        # the parts: reads on the wire (files, staging ring, reader threads or kvikio), checks and copy-out
        if self.mode in ("gds", "kvikio-compat"):
            io_bytes = max(io_bytes, staging_bytes)  # a run is read whole: kvikio splits it over its own threads
        self.reads = PassReader(self.mode, self.device, io_bytes, threads, self.counters, direct=o_direct)
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # unannotated in torch
        self.verifier = PassVerifier(source, layout, self.device, world, self.tenant_tag_fn, self.counters,
                                     self._stream)
        log.info("device load path: %s (%s)", self.mode, self.mode_reason)

    @property
    def io_bytes(self) -> int:
        """Bytes per read (cut at slot boundaries; at least one slot)."""
        return self.reads.io_bytes

    @io_bytes.setter
    def io_bytes(self, v: int) -> None:
        self.reconfigure(io_bytes=v)

    def reconfigure(self, *, threads: int | None = None, depth: int | None = None,
                    staging_bytes: int | None = None, io_bytes: int | None = None) -> None:
        """Change the pipeline knobs between loads (``benchmarks/gpu_bench.py --sweep``): reader threads
        (bounce/host paths: the loader's; kvikio paths: kvikio's process-wide pool), passes in flight, staging bytes per pass, bytes
        per read. The staging ring is dropped (re-sized by the next load). Raises ValueError as the
        constructor does; waits for a load in progress."""
        for name, v, lo in (("threads", threads, 1), ("depth", depth, 2), ("staging_bytes", staging_bytes, 4096),
                            ("io_bytes", io_bytes, 4096)):
            if v is not None and v < lo:
                raise ValueError(f"{name}: at least {lo}, got {v}")
        with self._call_lock:
            if threads is not None and threads != self.threads:
                self.reads.set_threads(threads)
                self.threads = threads
            self.depth = self.depth if depth is None else depth
            self.staging_bytes = self.staging_bytes if staging_bytes is None else staging_bytes
            self.reads.io_bytes = self.reads.io_bytes if io_bytes is None else io_bytes
            self.reads.drop_ring()


    # -- public ------------------------------------------------------------------------------
    def load(self, keys: Sequence[BlockKey], dst: torch.Tensor | Sequence[torch.Tensor],
             reasons: list[str | None] | None = None, io: dict[str, int] | None = None) -> list[bool]:
        """Load ``keys[i]`` into ``dst[i]``.

        Args:
            keys: block keys of this rank.
            dst: one ``[n, layout.bytes_per_block]``-byte tensor on :attr:`device` whose row ``i`` is key
                ``i``'s destination (the form to use: copied out by runs of rows, no per-block tensor objects,
                :mod:`kvbm_backend.gpu.rows`), e.g. the connector's load staging that it then scatters into
                the engine's paged KV; or one contiguous tensor per key. Any dtype; the bytes are overwritten
                with the FullyContiguous block ``[layer, outer, page, inner]``.
            reasons: if given, a list that receives one entry per key: None (loaded) or why not
                (``not_found``, ``io_error``, ``short``, ``timeout``, ``unverifiable``, or a corrupt
                reason: ``devcheck``, ``integrity``, ``identity``, ``layout``, ``length``, ``magic``,
                ``version``, ``header_check``).
            io: if given, a dict that receives ``bytes_read``: the bytes this call read from the slab files
                (``lease_timeouts``: the keys, all of them, when the lease ran out of time: every row ``timeout``,
                already counted as misses by the source).
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
        rows = BlockRows(dst, self.layout.bytes_per_block, self.device)  # ValueError names a bad one
        n = len(keys)
        why: list[str | None] = ["not_found"] * n
        if n == 0:
            return []
        deadline = Deadline(self.timeout_s)  # the lease and the reads together
        try:  # the pool's lock may be held across another thread's journal I/O: waited for within timeout_s only
            leases = lease_all(self.source, keys, "DeviceLoader", deadline.left())
        except TimeoutError:  # nothing leased: every row a timeout (counted by the pool's lease)
            self.counters["timeout"] += n
            self.counters["missed"] += n
            if io is not None:
                io["lease_timeouts"] = n
            if reasons is not None:
                reasons[:] = ["timeout"] * n
            return [False] * n
        held = {i: ls for i, ls in enumerate(leases) if ls is not None}  # row -> its lease
        self.counters["not_found"] += n - len(held)
        try:
            with self._call_lock:
                b0 = self.counters["bytes_read"]
                try:
                    self._load_rows(keys, held, rows, why, deadline)
                finally:
                    if io is not None:
                        io["bytes_read"] = self.counters["bytes_read"] - b0
        finally:
            release_quietly(self.source, list(held.values()))
        ok = [w is None for w in why]
        self.counters["loaded"] += sum(ok)
        self.counters["missed"] += n - sum(ok)
        if reasons is not None:
            reasons[:] = why
        return ok

    def stats(self) -> dict[str, Any]:
        """Counters: ``loaded``, ``missed``, ``not_found``, ``io_error``, ``short``, ``timeout``,
        ``corrupt_<reason>`` (FrameError reasons, ``devcheck``), ``unverifiable``, ``host_verified``,
        ``bytes_read``, ``passes``, ``reads`` (reads put on the wire: runs of slots adjacent in a file, in
        file order), ``files_o_direct`` / ``files_buffered`` (how slab files are read on
        the bounce/host paths); seconds the caller's thread spent waiting for reads (``read_wait_s``),
        checking and copying out (``verify_s``: of it ``verify_headers_s`` checking headers on the host,
        ``verify_payload_s`` queueing the device checksums and comparing them, ``verify_copy_s`` queueing
        the copy-out) and in whole calls (``load_s``); ``h2d_submit_s`` (``pinned-bounce``: queueing the per-pass
        host-to-device copies); ``ring_wait_s`` (waiting for the device to be done with a staging slot
        before its next pass) and ``submit_s`` (putting a pass's reads on the wire); plus
        ``mode`` and ``mode_reason`` (kvikio paths: ``kvikio_direct_reads``, whether kvikio reads with
        O_DIRECT)."""
        d: dict[str, Any] = dict(self.counters)
        for k in ("read_wait_s", "verify_s", "load_s", "verify_headers_s", "verify_payload_s", "verify_copy_s",
                  "h2d_submit_s", "ring_wait_s", "submit_s"):
            if k in d:
                d[k] = round(d[k], 6)
        d.update(mode=self.mode, mode_reason=self.mode_reason)
        if self.reads.engine is not None:
            d["kvikio_direct_reads"] = self.reads.engine.direct_reads
        return d

    def close(self) -> None:
        """Wait for reads in flight, release files, threads and buffers. Idempotent."""
        self.reads.close()

    # -- internals ---------------------------------------------------------------------------
    def _load_rows(self, keys: Sequence[BlockKey], leases: dict[int, SlotLease], dst: BlockRows,
                   why: list[str | None], deadline: Deadline) -> None:
        import torch
        bpb = self.layout.bytes_per_block
        passes: list[tuple[list[int], int]] = []
        for rows, slot_len in group_passes([(i, ls.slot_len) for i, ls in leases.items()], self.staging_bytes):
            if slot_len < HEADER_BYTES + bpb or slot_len % 4096:
                self.counters["corrupt_length"] += len(rows)
                for i in rows:
                    why[i] = "length"
                continue
            # reads in file order (the writer stripes neighbours over the files): few long reads per pass
            passes.append((file_order(rows, lambda i: (leases[i].path, leases[i].offset)), slot_len))
        reading: deque[_Pass] = deque()  # reads on the wire, not reaped yet
        checking: deque[_Pass] = deque()  # reaped, checks queued on the device, not completed yet
        t0 = time.perf_counter()
        if self._stream is not None:  # dst may still be in use by work queued on the caller's stream (a scatter
            # of the previous load out of memory the allocator has just handed out again as this dst): wait for it
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        ctx: ContextManager[Any] = (torch.cuda.stream(self._stream) if self._stream is not None
                                    else contextlib.nullcontext())
        try:
            with ctx:
                for k, (rows, slot_len) in enumerate(passes):
                    while len(reading) + len(checking) >= self.depth:  # pass k - depth done: its ring slot is free
                        self._advance(reading, checking, keys, dst, why, deadline)
                    ring = k % self.depth
                    tw = time.perf_counter()
                    staging, host = self.reads.buffers(ring, len(rows), slot_len)  # waits for the slot's last pass
                    add_seconds(self.counters, "ring_wait_s", time.perf_counter() - tw)
                    cur = _Pass(rows, [leases[i] for i in rows], slot_len, staging, host, ring, [],
                                ["io_error"] * len(rows),
                                None if self.reads.pool is None else np.empty((len(rows), HEADER_BYTES), np.uint8))
                    if not deadline.expired():
                        tw = time.perf_counter()
                        self.reads.submit(cur)
                        add_seconds(self.counters, "submit_s", time.perf_counter() - tw)
                    else:
                        cur.status = ["timeout"] * len(rows)
                        self.counters["timeout"] += len(rows)
                    self.counters["passes"] += 1
                    reading.append(cur)
                while reading or checking:
                    self._advance(reading, checking, keys, dst, why, deadline)
                if self._stream is not None:
                    self._stream.synchronize()  # every copy-out into dst is done
        except BaseException:  # passes still in flight: their buffers must never be handed out again
            if self._stream is not None:
                self._stream.synchronize()
            for p in list(reading) + list(checking):
                self.reads.abandon(p)
            raise
        add_seconds(self.counters, "load_s", time.perf_counter() - t0)

    def _advance(self, reading: deque[_Pass], checking: deque[_Pass], keys: Sequence[BlockKey],
                 dst: BlockRows, why: list[str | None], deadline: Deadline) -> None:
        """One step of the pipeline: reap the oldest pass still reading and queue its checks on the device;
        complete (check on the host, copy out) the pass reaped before it. So the loader's thread waits for
        the reads of pass k while the device checks pass k - 1, and never for the device itself."""
        if reading:
            p = reading.popleft()
            t0 = time.perf_counter()
            self.reads.reap(p, deadline)
            t1 = time.perf_counter()
            add_seconds(self.counters, "read_wait_s", t1 - t0)
            self.verifier.launch(p)
            add_seconds(self.counters, "verify_s", time.perf_counter() - t1)
            checking.append(p)
            if len(checking) <= 1 and reading:
                return
        q = checking.popleft()
        t1 = time.perf_counter()
        try:
            self.verifier.complete(q, keys, dst, why)
        finally:
            if q.done is not None:
                self.reads.ring_done[q.ring] = q.done
            self.reads.finished(q)  # a buffer kept for its timed-out reads may go back once they end
            add_seconds(self.counters, "verify_s", time.perf_counter() - t1)
