"""Layer-wise loads of G3 blocks: layer ``l`` of every block is in (and usable) while later layers are
still being read, so an engine computes layer ``l - 1`` while layer ``l`` loads.

:class:`LayerwiseLoad` is one load of ``n`` blocks from a :class:`~kvbm_backend.pool.base.SlotLeaseSource`
(the G3 pool) into ``device`` (``cuda:N``, or ``cpu``: host memory, the same code):

1. :meth:`~LayerwiseLoad.start` leases the slots (pinned until :meth:`~LayerwiseLoad.finish`) and submits
   the reads of :func:`kvbm_backend.transfer.layers.plan_layer_reads` (one
   :class:`~kvbm_backend.transfer.layers.GroupReads` per group: int lists, no object per read), ordered by
   layer group (layer 0 alone first, growing groups after), on the caller's thread pool in ``parallel``
   tasks per group (each a tight loop of reads: few futures, little Python per read, the GIL held briefly):
   ``os.preadv`` (which releases the GIL) of a block's group of layers straight into a layer-major host
   staging ``[layer, block, layer_bytes]`` (O_DIRECT where the layers are 4 KiB-aligned and the filesystem
   takes it; pinned memory on a CUDA device), group 0 with the 4 KiB frame header into a header buffer;
   after its loop a task checks the headers it read together (:class:`~.stages.HeaderChecks`: identity,
   layout, lengths, header check in numpy compares; a refused one again alone by
   :func:`~.stages.check_frame`, which names the reason). Where a block is verified on the host, the task
   that reads its last group hashes it (xxh3_128), while later reads and the forward go on.
2. :meth:`~LayerwiseLoad.wait_layer` (``l``) waits (until the load's deadline) for the reads of ``l``'s
   group, applies the header checks when group 0 is in, copies the group's layers to the device (one host-to-device copy per
   group, on a side stream the caller's stream then waits for, followed there by the group's partial
   device checksums, :mod:`kvbm_backend.gpu.checksum_partial`; later groups whose reads are already in
   are copied then too, so their copies run under this layer's compute) and returns layer ``l`` as a
   ``[n, layer_bytes]`` uint8 tensor with the rows that are good so far. Those bytes are NOT verified
   yet: the caller may compute with them only if it drops that computation when :meth:`finish` says
   the row failed (vLLM does: a block reported in ``get_block_ids_with_load_errors`` after the forward
   resets the request to its valid prefix and throws the step's token away).
3. :meth:`~LayerwiseLoad.finish` waits for everything, verifies each whole payload where it landed (the
   device checksum of ``FLAG_DEVCHECK`` frames on a CUDA device, combined from the groups' partial sums:
   one small device-to-host copy on the side stream, not a pass over the payload after the forward; else
   the xxh3_128 of ``FLAG_CHECKSUM`` on the host, computed by the reader threads, hashed here only for
   rows they did not), reports slots proven bad with ``drop_corrupt`` (I/O errors, short reads and timeouts are
   misses that keep the slot), releases the leases and returns one reason per row (None = good).

A read still running at the deadline is a ``timeout``; its late bytes land only in this load's staging,
which is never handed to anyone else (the read's closure keeps it alive).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import xxhash

from ....io.files import ReadFiles
from ....memory import BufferPool
from ....model.frame import FLAG_CHECKSUM, FLAG_DEVCHECK, HEADER_BYTES, FrameError, header_dev_checks, \
    header_flags, header_integrity
from ....model.layout import KvLayout
from ....model.namespace import BlockKey
from ....transfer.layers import DEFAULT_MIN_READ, GroupReads, layer_aligned, layer_groups, plan_layer_reads
from ...base import BlockBuffer, SlotLease, SlotLeaseSource
from ..index import key_tag
from .stages import HEADER_COPY, HeaderChecks, add_seconds, check_frame, lease_all, release_quietly, report_corrupt
from ....deadlines import Deadline

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


#: the owner's read fds (one O_DIRECT open / fallback rule for every reader: :mod:`kvbm_backend.io.files`)
SlabFiles = ReadFiles


class LayerwiseLoad:
    """One layer-wise load of ``keys`` (see the module doc).

    Args:
        source: the G3 pool (:class:`SlotLeaseSource`).
        layout: the namespace's :class:`KvLayout` (``bytes_per_block`` divides into ``num_layers`` equal
            layers).
        keys: this rank's block keys, in sequence order.
        device: torch device the layers are delivered on.
        executor: the thread pool the reads run on (its queue order is the read order).
        files: the owner's :class:`~kvbm_backend.io.files.ReadFiles` (:data:`SlabFiles`).
        timeout_s: the whole load's deadline (from :meth:`start`); reads not in by then are ``timeout``.
        world: TP world size frames must name (None: not checked).
        min_read: bytes per read at least (:func:`~kvbm_backend.transfer.layers.layer_groups`).
        staging: a :class:`BufferPool` the host staging is taken from (``pinned`` on a CUDA device) and given
            back to by :meth:`finish` once no read can land in it: on the CPU the tensors :meth:`wait_layer`
            returned are views of it, valid until :meth:`finish` only. None: a fresh allocation (kept
            alive by whoever holds those tensors).
        parallel: tasks per group (each a loop over a share of the group's reads); default the executor's
            thread count (``_max_workers``), else 8.
        verify_on_device: verify ``FLAG_DEVCHECK`` frames with the device checksum where the layers landed,
            from per-group partial sums (:mod:`kvbm_backend.gpu.checksum_partial`). Default: on a CUDA
            device. True on ``cpu``: the same sums in CPU torch ops (tests the wiring; slower than xxh3).
        on_finish: called once by :meth:`finish` with ``(verified rows, reasons, bytes read, lease timed out)``
            (the pool's counters: ``G3Reader.count_load``; before 2026-12-02 layer-wise loads moved none of
            them, nor ``kvbm_onboard_blocks_d2d`` or ``kvbm_backend_g3_load_misses{reason}``).
    Raises:
        TypeError: ``source`` is not a SlotLeaseSource. ValueError: a layout whose block is not whole layers.
    """

    def __init__(self, source: SlotLeaseSource, layout: KvLayout, keys: Sequence[BlockKey],
                 device: str | torch.device, *, executor: Executor, files: ReadFiles, timeout_s: float,
                 world: int | None = None, min_read: int = DEFAULT_MIN_READ, staging: BufferPool | None = None,
                 tenant_tag_fn: Callable[[BlockKey], bytes] | None = None, parallel: int | None = None,
                 verify_on_device: bool | None = None,
                 on_finish: Callable[[int, list[str | None], int, bool], None] | None = None) -> None:
        if not isinstance(source, SlotLeaseSource):
            raise TypeError(f"LayerwiseLoad: source {type(source).__name__} is not a SlotLeaseSource (pass the G3 pool)")
        import torch
        self.source, self.layout, self.keys = source, layout, list(keys)
        self.device = torch.device(device)
        self.n, self.L = len(self.keys), layout.num_layers
        if layout.bytes_per_block % self.L:
            raise ValueError(f"layout: {layout.bytes_per_block} bytes per block is not {self.L} equal layers")
        self.lb = layout.bytes_per_block // self.L
        self.aligned = layer_aligned(self.lb)
        self.groups = layer_groups(self.lb, self.L, min_read)
        self.group_of = [gi for gi, (_, c) in enumerate(self.groups) for _ in range(c)]
        self.executor, self.files, self.world = executor, files, world
        self.parallel = max(1, int(parallel or getattr(executor, "_max_workers", 0) or 8))
        self.timeout_s = timeout_s
        self.on_finish = on_finish
        self._lease_timed_out = False
        self.tenant_tag_fn: Callable[[BlockKey], bytes] = tenant_tag_fn or key_tag
        self.why: list[str | None] = ["not_found"] * self.n  # None = good so far
        self.counters: Counter[str] = Counter()
        self._staging_pool = staging
        self._leases: list[SlotLease | None] = []
        self._held: dict[int, SlotLease] = {}  # row -> its lease, for rows whose frame is read
        self._futs: list[list[tuple[list[int], Future[list[str | None]]]]] = []  # per group: (rows, task)
        self._in: list[bool] = [False] * len(self.groups)  # group reaped (and on the device)
        self._events: list[torch.cuda.Event | None] = [None] * len(self.groups)
        self._stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # unannotated in torch
        on_dev = self.device.type == "cuda" if verify_on_device is None else verify_on_device
        self._dev_sums = on_dev and self.lb % 4 == 0  # partial device checksums per group (whole u32 words)
        self._dev_verify = on_dev
        self._gsums: list[torch.Tensor | None] = [None] * len(self.groups)  # int64 [count, n, 5] per group
        # rows' groups still to land (reader threads count down; the one that lands the last hashes the row)
        self._left: list[int] = []
        self._digest: list[bytes | None] = [None] * self.n
        # header checks made by the reader threads: None (not yet), True (accepted) or why refused
        self._pre: list[bool | str | None] = [None] * self.n
        self._checks = HeaderChecks(layout, world, self.tenant_tag_fn)  # a task's headers at once
        self._good: list[int] | None = None  # rows good so far (wait_layer), made again after a reap
        self._lock = threading.Lock()
        self._released = False
        self._staging_given = False  # finish() gave the pooled host staging back
        self.deadline: Deadline | None = None

    # ---- start ---------------------------------------------------------------------------------
    def start(self) -> "LayerwiseLoad":
        """Lease the slots and submit every read (returns at once). Raises TypeError when the source
        returns something other than SlotLease/None (a wiring bug; nothing stays leased)."""
        import torch
        self.deadline = Deadline(self.timeout_s)
        late = 0
        try:  # the pool's lock may be held across another thread's journal I/O: waited for within the deadline only
            leases = lease_all(self.source, self.keys, "LayerwiseLoad", self.deadline.left()) if self.n else []
        except TimeoutError:  # nothing leased: every row a timeout (the pool counted them)
            leases, late = [None] * self.n, self.n
            self._lease_timed_out = True
            self.why = ["timeout"] * self.n
            self.counters["timeout"] += late
        self._leases = leases
        frames: list[tuple[int, int]] = []
        need = HEADER_BYTES + self.L * self.lb
        for i, ls in enumerate(leases):
            if ls is None:
                continue
            if ls.slot_len < need or ls.slot_len % 4096:
                self.why[i] = "length"
                continue
            self.why[i] = None
            self._held[i] = ls
            frames.append((i, ls.offset))
        self.counters["not_found"] += self.n - len(frames) - late
        pinned = self.device.type == "cuda"
        nb = max(1, self.n) * (HEADER_BYTES + self.L * self.lb)
        pool = self._staging_pool or BufferPool("pinned" if pinned else "host", 0, name="layerwise-staging")
        if self._staging_pool is not None:  # power-of-two size classes: loads of other sizes reuse buffers
            self._host_arr = pool.take(max(1 << 20, 1 << (nb - 1).bit_length()))
        else:
            self._host_arr = pool.take(nb)
        host = torch.from_numpy(self._host_arr[:nb])
        nh = max(1, self.n) * HEADER_BYTES
        self.hdr = self._host_arr[:nh].reshape(max(1, self.n), HEADER_BYTES)
        self.lay_np = self._host_arr[nh:nb].reshape(self.L, max(1, self.n), self.lb)
        self.lay_host = host[nh:].view(self.L, max(1, self.n), self.lb)
        self.lay_dev = self.lay_host if self._stream is None else \
            torch.empty((self.L, max(1, self.n), self.lb), dtype=torch.uint8, device=self.device)
        if self._stream is not None:  # lay_dev's memory may still be read by work queued on the caller's stream
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if self._dev_sums and self._stream is not None:
            from ....gpu import checksum_partial  # noqa: F401 - imported (and triton checked) before the reads
        if not self.aligned:
            self.counters["unaligned_loads"] += 1
        self._left = [len(self.groups)] * max(1, self.n)
        paths = [self._held[r].path for r, _ in frames]  # in frames order, as each group's rows
        for reads in plan_layer_reads(frames, self.lb, self.groups):  # group 0's reads start before group 1 is built
            m = len(reads.rows)
            per = -(-m // self.parallel) if m else 1
            tasks = []
            for a in range(0, m, per):
                tasks.append((reads.rows[a:a + per],
                              self.executor.submit(self._read_many, reads, a, min(m, a + per), paths, self.hdr,
                                                   self.lay_np)))
            self._futs.append(tasks)
            self.counters["reads"] += m
            self.counters["read_tasks"] += len(tasks)
            if len(self._futs) == 1:
                time.sleep(0)  # let the woken readers take the GIL and start group 0 while the rest is planned
        self.counters["groups"] += len(self.groups)
        return self

    def _read_many(self, g: GroupReads, a: int, b: int, paths: list[str], hdr: BlockBuffer,
                   lay: BlockBuffer) -> list[str | None]:
        """Reads ``a .. b - 1`` of group ``g`` (a task on the executor), in order: a tight loop (an iovec
        of a few numpy views and one ``preadv`` per read); then, for the rows read in full, group 0's
        headers checked together (:class:`~.stages.HeaderChecks`) and each row whose last group this was
        hashed (host-verified loads). ``hdr`` / ``lay`` are passed in so a late read keeps the staging
        alive. Returns None or a reason per read."""
        out: list[str | None] = []
        landed: list[int] = []  # rows read in full
        nbytes = 0
        want = g.nbytes(self.lb)
        layers = [lay[g.first_layer + k] for k in range(g.n_layers)]  # [n, layer_bytes] each
        files, aligned, rows, offsets = self.files, self.aligned, g.rows, g.offsets
        for j in range(a, b):
            row = rows[j]
            iov = [x[row] for x in layers]
            if g.header:
                iov.insert(0, hdr[row])
            try:  # O_DIRECT where the layers are aligned and the filesystem takes it (else buffered, once)
                got = files.preadv(paths[j], iov, offsets[j], aligned)
            except OSError as e:
                log.warning("G3 layer-wise read of %s at %d failed: %s", paths[j], offsets[j], e)
                out.append("io_error")
                continue
            nbytes += got
            if got != want:
                out.append("short")
                continue
            out.append(None)
            landed.append(row)
        if g.header and landed:  # off the forward's path to layer 0: checked here, wait_layer applies it
            self._check_rows(landed)
        last: list[int] = []
        with self._lock:
            self.counters["bytes_read"] += nbytes
            if g.header:
                self.counters["headers_on_readers"] += len(landed)
            for row in landed:
                self._left[row] -= 1
                if self._left[row] == 0:
                    last.append(row)
        for row in last:
            self._hash_row(row, hdr, lay)
        return out

    def _check_rows(self, rows: list[int]) -> None:
        """Check the frame headers of ``rows`` (read in full) together; a header refused there is checked
        again alone (:func:`~.stages.check_frame`: its reason). Sets ``_pre`` for each row."""
        ok, _ = self._checks.check(self.hdr[:, :HEADER_COPY][rows], [self.keys[r] for r in rows])
        for row, good in zip(rows, ok.tolist()):
            self._pre[row] = True if good else self._check_one(row, self.hdr)

    def _hash_row(self, row: int, hdr: BlockBuffer, lay: BlockBuffer) -> None:
        """xxh3_128 of row ``row``'s whole payload (every group of it is in), kept for :meth:`finish`."""
        flags = int.from_bytes(bytes(hdr[row, 10:12]), "little")  # the unchecked header: finish checks it
        if not flags & FLAG_CHECKSUM or (self._dev_verify and flags & FLAG_DEVCHECK):
            return  # no host checksum, or verified on the device
        x = xxhash.xxh3_128()
        for layer in range(self.L):
            x.update(lay[layer, row])
        self._digest[row] = x.digest()
        with self._lock:
            self.counters["hashed_on_readers"] += 1

    # ---- per layer -----------------------------------------------------------------------------
    def _reap(self, gi: int) -> None:
        """Wait for group ``gi``'s reads (until the deadline), note failures, check headers (group 0),
        start its copy to the device (and its partial device checksums)."""
        if self._in[gi]:
            return
        self._good = None  # rows may fail here
        t0 = time.perf_counter()
        for rows, f in self._futs[gi] if gi < len(self._futs) else []:
            try:
                left = self.deadline.left() if self.deadline is not None else None  # reads exist once started
                res = f.result(timeout=max(0.0, left) if left is not None else None)
            except FutureTimeout:
                res = ["timeout"] * len(rows)
            except Exception as e:  # noqa: BLE001 - a failed read is a miss
                log.warning("G3 layer-wise read failed: %s", e)
                res = ["io_error"] * len(rows)
            for row, r in zip(rows, res):
                if r is not None and self.why[row] is None:
                    self.why[row] = r
                    self.counters[r] += 1
        add_seconds(self.counters, "read_wait_s", time.perf_counter() - t0)
        if gi == 0:
            self._check_headers()
        l0, cnt = self.groups[gi]
        if self._stream is not None:  # the group's layers to the device, one copy
            import torch
            with torch.cuda.stream(self._stream):
                self.lay_dev[l0:l0 + cnt].copy_(self.lay_host[l0:l0 + cnt], non_blocking=True)
                ev = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
                ev.record(self._stream)
                self._group_sums(gi)
            self._events[gi] = ev
        else:
            self._group_sums(gi)
        self._in[gi] = True

    def _group_sums(self, gi: int) -> None:
        """Enqueue group ``gi``'s partial device checksums (``[count, n, 5]``, no sync) where verified on the
        device and some row may need them."""
        if not self._dev_sums or not self.n or all(w is not None for w in self.why):
            return
        from ....gpu.checksum_partial import range_sums
        l0, cnt = self.groups[gi]
        self._gsums[gi] = range_sums(self.lay_dev[l0:l0 + cnt].reshape(cnt * self.n, self.lb)).view(cnt, self.n, 5)

    def _check_one(self, i: int, hdr: BlockBuffer) -> bool | str:
        """Row ``i``'s frame header checked alone (:func:`~.stages.check_frame`): True, or why it is refused."""
        k = self.keys[i]
        try:
            check_frame(hdr[i], k, self.layout, self.tenant_tag_fn(k), world=self.world,
                        slot_len=self._held[i].slot_len)
            return True
        except FrameError as e:
            return e.reason

    def _check_headers(self) -> None:
        """Apply the header checks of group 0's good rows (made by the reader threads as each task's headers
        landed; here for any they did not make)."""
        todo = [i for i in range(self.n) if self.why[i] is None and self._pre[i] is None]
        if todo:
            self._check_rows(todo)
            self.counters["headers_checked_in_wait"] += len(todo)
        for i in range(self.n):
            res = self._pre[i]
            if self.why[i] is None and isinstance(res, str):
                self.why[i] = res
                self.counters[f"corrupt_{res}"] += 1

    def wait_layer(self, layer: int) -> tuple[list[int], torch.Tensor]:
        """Wait for layer ``layer`` (until the deadline). Returns ``(good, t)``: the rows whose reads and
        headers are good so far (not yet payload-verified: see the module doc) and layer ``layer`` of
        every row as a ``[n, layer_bytes]`` uint8 tensor on :attr:`device` (rows not in ``good`` hold
        garbage). The caller's current CUDA stream is ordered after the copy. Raises IndexError for a
        layer out of range."""
        if not 0 <= layer < self.L:
            raise IndexError(f"layer {layer} of a {self.L}-layer block")
        gi = self.group_of[layer]
        for g in range(gi + 1):  # group 0 carries the headers
            self._reap(g)
        for g in range(gi + 1, len(self._futs)):  # later groups already read: their copies start now, under
            if self._in[g]:  # the compute of this layer, not when the forward reaches them
                continue
            if not all(f.done() for _, f in self._futs[g]):
                break  # in group order: a group's copy never waits on a later one
            self._reap(g)
            self.counters["groups_copied_early"] += 1
        ev = self._events[gi]
        if ev is not None:
            import torch
            torch.cuda.current_stream(self.device).wait_event(ev)
        if self._good is None:
            self._good = [i for i in range(self.n) if self.why[i] is None]
        return list(self._good), self.lay_dev[layer, :self.n]

    # ---- finish --------------------------------------------------------------------------------
    def finish(self) -> list[str | None]:
        """Wait for every read, verify every good row's whole payload where it landed, drop slots proven
        bad, release the leases. Returns one reason per row: None (verified) or why not (``not_found``,
        ``io_error``, ``short``, ``timeout``, ``unverifiable``, ``integrity``, ``devcheck``, or a header
        reason). Idempotent."""
        if self._released:
            return list(self.why)
        try:
            for g in range(len(self.groups)):
                self._reap(g)
            t0 = time.perf_counter()
            self._verify()
            add_seconds(self.counters, "verify_s", time.perf_counter() - t0)
            # while the leases still pin the slots: the pool re-reads a slot to prove it bad before dropping
            # it, and an unpinned slot could meanwhile be freed and hold another block
            report_corrupt(self.source, self.keys, self.why)
        finally:
            self._released = True
            if self.on_finish is not None:
                try:
                    self.on_finish(self.why.count(None), list(self.why), int(self.counters["bytes_read"]),
                                   self._lease_timed_out)
                except Exception as e:  # noqa: BLE001 - counting must not mask the load's result
                    log.warning("LayerwiseLoad: counting the load failed: %s", e)
            release_quietly(self.source, [ls for ls in self._leases if ls is not None])
            if self._staging_pool is not None and all(f.done() for fs in self._futs for _, f in fs):
                if self._stream is not None:
                    self._stream.synchronize()  # its host-to-device copies have read it
                self._staging_pool.give(self._host_arr)  # no read can land in it any more
                self._staging_given = True
        return list(self.why)

    def _device_checks(self, dev: list[int]) -> list[int]:
        """The device checksums of rows ``dev``: from the groups' partial sums (one small copy to the host,
        ordered on the side stream only), else (layers not whole u32 words) a pass over the payloads."""
        import torch
        if self._dev_sums and all(s is not None for s in self._gsums):
            from ....gpu.checksum_partial import combine
            parts = [s for s in self._gsums if s is not None]
            if self._stream is not None:
                with torch.cuda.stream(self._stream):  # where the sums were made, after them
                    host = torch.cat(parts).cpu()  # waits for this stream only, not for the caller's forward
            else:
                host = torch.cat(parts)  # [L, n, 5]
            got = combine(host.numpy(), np.arange(self.L, dtype=np.int64) * (self.lb // 4))
            self.counters["devcheck_partial"] += len(dev)
            return [int(got[i]) for i in dev]
        from ....gpu.checksum import device_checksums_torch
        from ....gpu.rows import device_index
        self.counters["devcheck_whole"] += len(dev)
        # on the side stream, after the groups' copies: its one sync (the sums' copy to the host) waits for this
        # stream only, never for the caller's forward (no index copy from pageable memory on the caller's stream)
        with (torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()):
            idx = device_index(dev, self.device)
            rows = self.lay_dev.index_select(1, idx).permute(1, 0, 2).reshape(len(dev), self.L * self.lb)
            return device_checksums_torch(rows.contiguous(), 0, self.L * self.lb)

    def _verify(self) -> None:
        good = [i for i in range(self.n) if self.why[i] is None]
        if not good:
            return
        # a good row's header was checked (HeaderChecks / check_frame): its fields are read from the bytes
        hg = self.hdr[:, :HEADER_COPY][good]
        flags = header_flags(hg).tolist()
        want_dev = header_dev_checks(hg).tolist()
        integrity = header_integrity(hg)
        devs = [j for j, i in enumerate(good) if self._dev_verify and flags[j] & FLAG_DEVCHECK]
        if devs:
            for j, got in zip(devs, self._device_checks([good[j] for j in devs])):
                if got != want_dev[j]:
                    self.why[good[j]] = "devcheck"
                    self.counters["corrupt_devcheck"] += 1
        on_dev = set(devs)
        for j, i in enumerate(good):
            if j in on_dev:
                continue
            if not flags[j] & FLAG_CHECKSUM:
                self.why[i] = "unverifiable"  # devcheck-only frame on the host: not checked here
                self.counters["unverifiable"] += 1
                continue
            digest = self._digest[i]
            if digest is None:  # not hashed by a reader thread (verified on the device, or no flag seen there)
                x = xxhash.xxh3_128()
                for layer in range(self.L):
                    x.update(self.lay_np[layer, i])
                digest = x.digest()
                self.counters["hashed_in_finish"] += 1
            if digest != integrity[j].tobytes():
                self.why[i] = "integrity"
                self.counters["corrupt_integrity"] += 1
            else:
                self.counters["host_verified"] += 1

    def block(self, row: int) -> torch.Tensor:
        """Row ``row``'s payload as one contiguous ``[bytes_per_block]`` uint8 tensor on :attr:`device`
        (a copy; FullyContiguous ``[layer, outer, page, inner]``). For tests and callers that want whole
        blocks after :meth:`finish`. Raises RuntimeError after :meth:`finish` where the rows were the pool's
        host staging (a CPU device): finish gave it back, and another load may have read into it since."""
        if self._staging_given and self.lay_dev is self.lay_host:
            raise RuntimeError("LayerwiseLoad.block: the host staging went back to its pool at finish(); "
                               "take the blocks (or wait_layer's tensors) before finish()")
        return self.lay_dev[:, row].reshape(-1).clone()
