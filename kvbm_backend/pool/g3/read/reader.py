""":class:`G3Reader`: the G3 pool's one reader, a part of :class:`~kvbm_backend.pool.g3.pool.G3Pool` (the pool
delegates ``get``, ``lease``, ``release``, ``drop_corrupt`` and ``device_reader`` to it).

It owns the read side's threads and per-device loaders (the verifier thread of host gets, the load-timeout
timer, one :class:`~.device.DeviceLoader` per device and the thread that runs tensor gets; for layer-wise
loads the reader threads, slab fds and host staging, made on first use) and reaches slot
state only through the pool's slot catalog (``cat``: the index, slab files, journal and counters under
``cat.lock``, :class:`~kvbm_backend.pool.g3.catalog.SlotCatalog`): it pins slots it reads, unpins them, and drops a slot
from the index and the journal only once its stored bytes are proven bad (:meth:`G3Reader.prove_bad`), or, asked by
a failed load's caller (:meth:`G3Reader.drop_unreadable`), once its slot stayed unreadable (:mod:`.unreadable`).
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence, cast

from ....deadlines import Deadlines
from ....io.files import ReadFiles
from ....memory import BufferPool, aligned_empty
from ....model import frame
from ....model.frame import FrameError
from ....model.namespace import BlockKey
from ....transfer.layers import DEFAULT_MIN_READ
from ...base import BlockBuffer, GetDestinations, GetResult, SlotLease, is_tensor_batch
from ....gpu.rows import is_matrix
from .. import journal as jr, vacancy
from ..index import TagKey
from ..catalog import _MISS_REASON, HDR, SlotCatalog
from ..entry import check_buffers
from ..lock_bounded import LOCK_WAIT_S, held_within
from ..pieces import Slot
from .host import HostGet, same_slot, valid_key
from .layerwise import LayerwiseLoad
from .unreadable import UNREADABLE_SPAN_S, UNREADABLE_STRIKES, UnreadableBlocks
from ....threads import executor

if TYPE_CHECKING:
    import torch

    from ..pool import G3Pool
    from .device import DeviceLoader

log = logging.getLogger(__name__)

#: bytes of free host staging kept for the next layer-wise loads, per kind (pinned for CUDA devices:
#: allocating page-locked memory per load would cost more than the reads). Staging comes in power-of-two
#: classes: a Llama-3.1-8B hit of 4-8k tokens (0.5-1 GiB) takes a 1 GiB buffer, which 512 MiB did not keep
#: (every such load page-locked 1 GiB anew)
LAYERWISE_STAGING_KEEP_BYTES = 2 << 30


class _LayerwiseParts:
    """What layer-wise loads of one pool share: reader threads (``threads``; their queue order is the read
    order), slab fds (:class:`~kvbm_backend.io.files.ReadFiles`; ``direct`` False: never O_DIRECT, ``g3.o_direct:
    off``) and host staging (pinned / host)."""

    def __init__(self, threads: int, direct: bool = True) -> None:
        self.executor = executor(max(1, threads), "kvbm-g3-layerwise")
        self.files = ReadFiles(direct=direct)
        self._staging: dict[bool, BufferPool] = {}

    def staging(self, pinned: bool) -> BufferPool:
        """The staging pool of one kind (made on first use)."""
        pool = self._staging.get(pinned)
        if pool is None:
            pool = self._staging[pinned] = BufferPool("pinned" if pinned else "host", LAYERWISE_STAGING_KEEP_BYTES,
                                                      name="layerwise-staging")
        return pool

    def close(self) -> None:
        """Wait for reads in flight (late reads land in their load's staging only), close the fds."""
        self.executor.shutdown(wait=True)
        self.files.close()


class G3Reader:
    """The read part of a G3 pool: host gets (numpy), device gets (torch tensors), slot leases.

    It is itself a :class:`~kvbm_backend.pool.base.SlotLeaseSource` (the device loaders lease through it).

    Args:
        cat: the pool's :class:`~kvbm_backend.pool.g3.catalog.SlotCatalog` (slot state, counters, its lock).
        pool: the pool facade, for what the parts share read-only: ``cfg``, ``engine``, ``_frames`` (checksum
            frames), ``_staging``, ``_io_size``, ``block_bytes`` and the read tuning (``read_chunk_bytes``,
            ``chunk_bytes``, ``min_chunk_blocks``, ``read_chunks_in_flight``), read at each get.
    """

    def __init__(self, cat: SlotCatalog, pool: G3Pool) -> None:
        self.cat = cat
        self.pool = pool
        # read chunks are verified here, not on the engine's completion thread, so the engine keeps
        # posting and reaping I/O while a chunk's headers/checksums are checked and copied out
        self.verifier = executor(1, "kvbm-g3-verify")
        self.deadlines = Deadlines("kvbm-g3-deadlines")
        self.device_readers: dict[str, DeviceLoader] = {}  # str(device) -> DeviceLoader (device_reader)
        self._device_lock = threading.Lock()
        self._device_exec = executor(2, "kvbm-g3-device")
        self._layerwise: _LayerwiseParts | None = None  # made by the first layerwise_load
        self._closed = False
        self.unreadable = UnreadableBlocks()  # drop_unreadable's failed re-reads (how long a block is kept)
        self._unpins: ThreadPoolExecutor | None = None  # unpins deferred while the lock was busy (unpin)

    # ---- get: numpy (host pipeline) or tensors (device loader) -----------------------------------
    def get(self, keys: list[BlockKey], out: GetDestinations) -> Future[GetResult]:
        """``G3Pool.get``: numpy buffers through :class:`~.host.HostGet`, tensors through the device loader.
        Raises ValueError for mismatched lengths or bad numpy buffers (see ``G3Pool.get``)."""
        if is_tensor_batch(out):
            if len(keys) != len(out):
                raise ValueError(f"get: {len(keys)} keys but {len(out)} buffers")
            # a [n, bytes] matrix stays one tensor (copied out by runs of rows, kvbm_backend.gpu.rows)
            return self._get_tensors(keys, cast("torch.Tensor", out) if is_matrix(out)
                                     else cast("list[torch.Tensor]", list(out)))
        check_buffers(keys, cast("Sequence[BlockBuffer]", out), "get", self.pool.block_bytes, writable=True)
        # check_buffers let only contiguous 1-D uint8 numpy buffers through
        return HostGet(self, keys, cast("list[BlockBuffer]", list(out))).start()

    # ---- SlotLeaseSource: in-place reads by the device and layer-wise loaders ---------------------
    def lease(self, keys: Sequence[BlockKey], timeout_s: float | None = None) -> list[SlotLease | None]:
        """See ``G3Pool.lease`` (TimeoutError: the lock stayed busy ``timeout_s`` s; nothing pinned, counted).

        The slots are found (and made most recently used, tag entries adopted) by one
        :meth:`~..compact_index.CompactLruIndex.get_many`: a load's keys (one namespace, tenant and rank) in one
        vectorised probe, other lists key by key; a key of another namespace is absent."""
        cat = self.cat
        if not cat.lock.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s)):
            cat.miss_unlocked("timeout", len(keys))
            raise TimeoutError(f"G3: lease of {len(keys)} slots: the pool's lock stayed busy {timeout_s:.3g} s "
                               "(another thread's journal I/O)")
        try:
            slots = cat.index.get_many(keys, cat.fp)
            absent = slots.count(None)
            cat.index.pin_many(cast("list[Slot]", slots) if not absent else [s for s in slots if s is not None])
            files, sb = cat.slabs.by_index, cat.slot_bytes
            out = [None if s is None else SlotLease(k, files[s[0]].path, s[1] * sb, sb, s) for k, s in zip(keys, slots)]
            if absent:
                cat.miss("absent", absent)
        finally:
            cat.lock.release()
        return out

    def release(self, leases: Sequence[SlotLease]) -> None:
        """See ``G3Pool.release``."""
        self.unpin([cast(Slot, ls.token) for ls in leases])  # lease() makes each token its slot

    def unpin(self, slots: Sequence[Slot]) -> None:
        """Unpin ``slots`` (a slot evicted meanwhile is freed now). Waits at most
        :data:`~..lock_bounded.LOCK_WAIT_S` for the pool's lock (a layer-wise load's ``finish`` runs in the
        forward; the lock may be held across another thread's journal I/O); past it the slots are unpinned on the
        ``kvbm-g3-unpin`` thread once the lock is free (pinned a little longer: never evicted early)."""
        if not slots:
            return
        cat = self.cat
        with held_within(cat.lock, LOCK_WAIT_S) as got:
            if got:
                cat.release_slots(slots)
                return
        with self._device_lock:
            if self._closed:  # closing: the catalog's close takes every pin with it; no thread after close
                return
            if self._unpins is None:
                self._unpins = executor(1, "kvbm-g3-unpin")
            unpins = self._unpins
        unpins.submit(self._unpin_later, list(slots))

    def _unpin_later(self, slots: list[Slot]) -> None:
        """The ``kvbm-g3-unpin`` thread: unpin ``slots`` once the pool's lock is free."""
        with self.cat.lock:
            self.cat.release_slots(slots)

    def drop_corrupt(self, key: BlockKey, reason: str) -> None:
        """See ``G3Pool.drop_corrupt``."""
        cat = self.cat
        with cat.lock:
            slot = cat.index.get(key) if valid_key(key) else None
            rec = None if slot is None else cat.index.identity(key, slot)
            if reason != "token_digest" or rec is None:  # else counted once proven (other_digest: kept)
                cat.miss(_MISS_REASON.get(reason, "corrupt"))
            if slot is not None and rec is not None:
                # pinned while it is proven (prove_bad's precondition): the caller's lease, if any, may pin
                # another slot (the key moved since), and an unpinned slot deleted meanwhile is free at once, so
                # the key's new copy could be written into it and then be dropped on the old bytes' verdict
                cat.index.pin(slot)
        if slot is None or rec is None:
            return
        try:
            why = self.prove_bad(slot, rec, frame.key_digest(key))
        except BaseException:
            self.unpin([slot])
            raise
        if reason == "token_digest":
            with cat.lock:
                cat.miss("other_digest" if why == "other_digest" else "token_digest")
        if why == "other_digest":  # another token sequence's verified block: a miss for this key, kept
            self.unpin([slot])
            return
        if why in ("good", "unreadable"):
            self.unpin([slot])
            log.warning("G3: a device load reported slot %s bad (%s) but it %s; kept", slot, reason,
                        "re-reads and verifies" if why == "good" else "cannot be re-read now")
            return
        with cat.lock:  # counted under the reason of the check that found it (the re-read only proves it)
            cat.release_slots([slot])  # unpinned first: a slot deleted meanwhile is freed here
            if not same_slot(cat.index.get(key), slot):  # deleted (and maybe written again elsewhere) meanwhile:
                return  # its new copy stays, and no DEL record drops it at the next restart
            cat.count_corrupt(reason)
            cat.remove(key, slot)
            vacancy.journal_dels(cat, [jr.encode(jr.DEL, key)])
            cat.c["deleted"] += 1
            cat.update_gauges()

    def drop_unreadable(self, keys: Sequence[BlockKey]) -> int:
        """See ``G3Pool.drop_unreadable`` (and :mod:`.unreadable`)."""
        cat, n, kept, persistent = self.cat, 0, 0, 0
        for key in keys:
            with cat.lock:
                slot = cat.index.get(key) if valid_key(key) and key.namespace == cat.fp else None
                rec = None if slot is None else cat.index.identity(key, slot)
                if slot is None or rec is None:
                    continue
                cat.index.pin(slot)  # not evicted or reused while it is re-read
            try:
                why = self.prove_bad(slot, rec, frame.key_digest(key))
                if why == "other_digest":  # another token sequence's verified block: not this key's, kept
                    continue
                if why == "good":  # the read's failure, not the bytes'
                    self.unreadable.forget(key)
                    log.warning("G3: a load reported slot %s unreadable but it re-reads and verifies; kept", slot)
                    continue
                if why == "unreadable" and not self.unreadable.failed(key, slot):  # an I/O error proves nothing
                    kept += 1
                    continue
                with cat.lock:
                    if not same_slot(cat.index.get(key), slot):  # deleted (maybe written again) meanwhile
                        continue
                    cat.remove(key, slot)
                    vacancy.journal_dels(cat, [jr.encode(jr.DEL, key)])
                    cat.c["deleted"] += 1
                    if why == "unreadable":
                        cat.c["unreadable_deleted"] += 1
                        persistent += 1
                    n += 1
                self.unreadable.forget(key)
            finally:
                self.unpin([slot])
        if kept:
            with cat.lock:
                cat.c["unreadable_kept"] += kept
            log.warning("G3: %d block(s) a load could not read and a re-read could not either (I/O error, no proof of "
                        "bad bytes): kept (deleted once unreadable in %d failed loads over %.0f s)", kept,
                        UNREADABLE_STRIKES, UNREADABLE_SPAN_S)
        if persistent:
            log.warning("G3: %d block(s) unreadable in %d failed loads or more over %.0f s or more: deleted", persistent,
                        UNREADABLE_STRIKES, UNREADABLE_SPAN_S)
        if n:
            cat.update_gauges()
        return n

    def prove_bad(self, slot: Slot, rec: tuple[bytes, int, int], digest: bytes | None = None) -> str:
        """Re-read ``slot`` (one synchronous ``preadv`` of the whole slot into a fresh aligned buffer) and
        check it against ``rec`` = (tenant tag, rank, seq_hash), what the index says the slot holds, and
        ``digest``, the token digest the requesting key named (None: not checked).

        Returns ``"good"`` (the stored frame verifies: the failed read was a read error, or the caller's
        key did not name what the slot holds), ``"other_digest"`` (it verifies but holds another NONZERO token
        digest: another token sequence's good block under this name, a miss for the asker and kept: a forged
        prompt must not delete it, docs/format.md "Token digest"), ``"unreadable"`` (the re-read failed too: a
        read error, the stored bytes are not proven bad), or the reason the stored bytes are bad: ``"short"``
        (the file ends inside the slot), a FrameError reason, or ``"token_digest"`` (it verifies but holds the
        zero digest, written without one: dropped so the key's own block, with its digest, can be saved).
        Only the last kind may drop a slot.
        The slot must stay pinned (or be otherwise unreusable) meanwhile."""
        cat = self.cat
        fi, si = slot
        f = cat.slabs.by_index.get(fi)
        if f is None:
            return "unreadable"
        sb = cat.slot_bytes
        buf = aligned_empty(sb)
        try:
            n = os.preadv(f.fd, [buf.data], si * sb)  # buf.data: numpy's stubs give ndarray no buffer before 3.12
        except OSError:
            return "unreadable"
        if n < sb:
            try:
                size = os.fstat(f.fd).st_size
            except OSError:
                return "unreadable"
            return "short" if size < (si + 1) * sb else "unreadable"
        tag, rank, seq = rec
        try:
            # accept reads the key's namespace, rank and seq_hash (the tenant is ``tag``): a TagKey names them
            key = cast(BlockKey, TagKey(cat.fp, tag, rank, seq))
            hdr = frame.accept(buf[:HDR], key, cat.layout, tag,
                               world=cat.namespace.tp_world_size, stored_len=cat.block_bytes)
            if not hdr.flags & frame.FLAG_CHECKSUM:
                raise FrameError("integrity", "frame carries no checksum")
            frame.verify_payload(hdr, buf[HDR:HDR + cat.block_bytes])
        except FrameError as e:
            return e.reason
        if digest is None or hdr.token_digest == digest:
            return "good"
        # a verified frame of another token sequence with this name: someone else's good block, kept (a forged
        # prompt's failed load must not delete it); one written without a digest cannot prove it is the asker's
        return "token_digest" if hdr.token_digest == frame.NO_DIGEST else "other_digest"

    # ---- device loads ------------------------------------------------------------------------------
    def device_reader(self, device: str | torch.device) -> DeviceLoader:
        """See ``G3Pool.device_reader``."""
        import torch

        from .device import DeviceLoader
        cat = self.cat
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        with self._device_lock:  # one probe per device, never under the pool lock (the probe does I/O)
            if self._closed or cat.closed:
                raise RuntimeError("G3 pool is closed")
            rd = self.device_readers.get(str(dev))
            if rd is None:
                # g3.device_path is how slots reach a CUDA device: a CPU device always loads in ``host`` mode
                cfg = self.pool.cfg
                if dev.type == "cuda":  # reads in flight: kvikio's pool or the bounce path's reader threads
                    mode, threads = cfg.device_path, cfg.device_io_threads
                else:
                    mode, threads = "auto", cfg.io_threads
                rd = DeviceLoader(self, cat.layout, dev, probe_dir=cat.slabs.paths[0], mode=mode,
                                  world=cat.namespace.tp_world_size, timeout_s=cfg.load_timeout_s,
                                  threads=threads, io_bytes=max(self.pool._io_size, 16 << 20),
                                  o_direct=cfg.o_direct != "off")  # off: buffered, as the slab fds
                self.device_readers[str(dev)] = rd
                log.info("G3 %s: device loads into %s: %s (%s), %d reads in flight", cat.slabs.paths[0], dev,
                         rd.mode, rd.mode_reason, threads)
        return rd

    def layerwise_load(self, keys: Sequence[BlockKey], device: str | torch.device, *, timeout_s: float | None = None,
                       min_read: int | None = None) -> LayerwiseLoad:
        """See ``G3Pool.layerwise_load``."""
        import torch

        cat, cfg = self.cat, self.pool.cfg
        dev = torch.device(device)
        with self._device_lock:
            if self._closed or cat.closed:
                raise RuntimeError("G3 pool is closed")
            if self._layerwise is None:  # reader threads: as whole-request loads into that kind of device
                threads = cfg.device_io_threads if dev.type == "cuda" else cfg.io_threads
                self._layerwise = _LayerwiseParts(threads, cfg.o_direct != "off")  # off: buffered reads
            staging = self._layerwise.staging(dev.type == "cuda")
            executor, files = self._layerwise.executor, self._layerwise.files
        return LayerwiseLoad(self, cat.layout, keys, dev, executor=executor, files=files,
                             timeout_s=cfg.load_timeout_s if timeout_s is None else timeout_s,
                             world=cat.namespace.tp_world_size,
                             min_read=DEFAULT_MIN_READ if min_read is None else min_read, staging=staging,
                             on_finish=self.count_load).start()

    def count_load(self, hits: int, why: Sequence[str | None], nread: int, lease_timed_out: bool) -> None:
        """Count one device get's or layer-wise load's outcome (``hits`` blocks verified of ``len(why)``,
        ``nread`` bytes read from the slab files): ``stats()`` ``hits`` / ``bytes_read`` / ``device_loads`` /
        ``device_hits``, ``kvbm_onboard_blocks_d2d``, ``kvbm_backend_g3_bytes_read`` and the misses no one else
        counted. Absent keys were counted by :meth:`lease` (all of them, as timeouts, when it timed out:
        ``lease_timed_out``), slots failing a check by :meth:`drop_corrupt`. Without the pool's lock (held
        across journal I/O): a load's result never waits for it."""
        cat = self.cat
        cat.add_unlocked(hits=hits, bytes_read=nread, device_loads=len(why), device_hits=hits)
        if not lease_timed_out:
            for r in why:
                if r in ("io_error", "short", "timeout", "unverifiable"):
                    cat.miss_unlocked(r)
                elif r == "length":  # kept (report_corrupt), yet a frame that does not fit: a corrupt miss
                    cat.miss_unlocked(_MISS_REASON[r])
        cat.metrics.onboard_blocks.inc(hits)
        cat.metrics.bytes_read.inc(nread)

    def device_paths(self) -> dict[str, dict[str, str]]:
        """``{device: {"mode", "reason"}}`` of the device loaders made so far (``G3Pool.stats``)."""
        return {dev: {"mode": rd.mode, "reason": rd.mode_reason} for dev, rd in list(self.device_readers.items())}

    def _get_tensors(self, keys: list[BlockKey], out: torch.Tensor | list[torch.Tensor]) -> Future[GetResult]:
        """``get`` into torch tensors: the device reader on the device-load thread."""
        fut: Future[GetResult] = Future()
        fut.set_running_or_notify_cancel()
        try:
            rd = self.device_reader(cast("torch.Tensor", out if is_matrix(out) else out[0]).device)
        except Exception as e:  # noqa: BLE001 - no device path: every block is a miss, said once per call
            log.warning("G3: device load of %d blocks impossible: %s", len(keys), e)
            fut.set_result(GetResult(ok=[False] * len(keys)))
            return fut

        def run() -> None:
            why: list[str | None] = []
            io: dict[str, int] = {}
            try:
                ok = rd.load(keys, out, why, io)
            except (ValueError, TypeError):
                raise  # bad destination tensors or a wiring bug: the caller must see it
            except Exception as e:  # noqa: BLE001 - storage trouble: misses
                log.warning("G3: device load of %d blocks failed: %s", len(keys), e)
                ok, why = [False] * len(keys), ["io_error"] * len(keys)
            self.count_load(sum(ok), why, io.get("bytes_read", 0), bool(io.get("lease_timeouts")))
            fut.set_result(GetResult(ok=list(ok), timed_out=[r == "timeout" and not g for r, g in zip(why, ok)]))

        def guarded() -> None:
            try:
                run()
            except BaseException as e:  # noqa: BLE001 - ValueError (bad tensors) reaches the caller
                if not fut.done():
                    fut.set_exception(e)

        try:
            self._device_exec.submit(guarded)
        except RuntimeError as e:  # executor shut down: pool closing
            fut.set_result(GetResult(ok=[False] * len(keys)))
            log.warning("G3: device load refused: %s", e)
        return fut

    # ---- shutdown ------------------------------------------------------------------------------------
    def close_device(self) -> None:
        """Stop the timer, the device-load thread and every device loader (the pool calls this after its
        writer settled, before closing the engine). Idempotent."""
        with self._device_lock:
            self._closed = True
        self.deadlines.close()
        self._device_exec.shutdown(wait=True)
        with self._device_lock:
            for rd in list(self.device_readers.values()):
                rd.close()
            self.device_readers.clear()
            lw, self._layerwise = self._layerwise, None
            unpins, self._unpins = self._unpins, None
        if lw is not None:
            lw.close()
        if unpins is not None:  # deferred unpins done (the catalog is still open)
            unpins.shutdown(wait=True)

    def close_verifier(self) -> None:
        """Stop the verifier thread (after the engine: its last callbacks may still queue here)."""
        self.verifier.shutdown(wait=True)
