"""G3 slot metadata: the index, the slab files and the journal, changed together under the pool's one
lock, and the pool's counters. Mixed into :class:`~kvbm_backend.pool.g3.pool.G3Pool`.

Every method here expects the caller to hold ``self._lock`` unless its docstring says otherwise.
"""
from __future__ import annotations

import errno
import logging
import time

from ...model import frame
from ...model.namespace import tenant_tag

log = logging.getLogger(__name__)

HDR = frame.HEADER_BYTES
_NOSPACE = (errno.ENOSPC, errno.EDQUOT)
# FrameError.reason -> miss reason
_MISS_REASON = {"magic": "corrupt", "version": "corrupt", "header_check": "corrupt", "integrity": "corrupt",
                "length": "corrupt", "identity": "identity", "layout": "identity"}


class SlotsMixin:
    """Index + slabs + journal of :class:`~kvbm_backend.pool.g3.pool.G3Pool`, and its accounting."""

    # ---- internals: counting ------------------------------------------------------------------
    def _drop(self, reason: str, n: int) -> None:
        self._c["offloads_dropped"] += n
        self._c["dropped:" + reason] += n
        self.metrics.offloads_dropped.labels(reason).inc(n)

    def _miss(self, reason: str, n: int = 1) -> None:
        self._c["misses"] += n
        self._c["miss:" + reason] += n
        self.metrics.misses.labels(reason).inc(n)

    def _update_gauges(self) -> None:
        m = self.metrics
        m.blocks.set(len(self.index))
        m.used_bytes.set(len(self.index) * self.slot_bytes)
        m.capacity_bytes.set(self.slabs.capacity_slots * self.slot_bytes)

    def _journal_append(self, recs: list[bytes]) -> bool:
        """Journal ``recs`` (the caller holds the lock). Never raises: a failed append or rewrite (ENOSPC,
        EIO, anything) goes to :meth:`_journal_failed` (tier degraded, journal marked for repair) and
        False is returned (``recs`` not journaled). A journal marked for repair (or one that could not be
        opened) is first rewritten from the index, with any namespace file still unwritten: records lost
        earlier (DELs) are repaired there."""
        if not recs:
            return True
        try:
            if self._journal_dirty or self.journal.broken or self.journal.fd is None:
                self.slabs.write_pending_namespaces()
                self.journal.rewrite(self.index.items())
                self._journal_dirty = False
                log.warning("G3: journal %s rewritten from the index (repaired)", self.journal.path)
            self.journal.append(recs)
        except Exception as e:  # noqa: BLE001 - storage trouble (or a bug) must not hang callers
            self._journal_failed(e)
            return False
        if self.journal.records > max(65536, 4 * len(self.index)):
            try:
                self.journal.rewrite(self.index.items())
            except Exception as e:  # noqa: BLE001 - compaction failed: the appended journal stays valid
                self._journal_failed(e, dirty=False)
        return True

    def _journal_failed(self, e: BaseException, dirty: bool = True) -> None:
        """The metadata path failed (caller holds the lock): degrade like slab ENOSPC (no admission for
        :attr:`degrade_s`, then statvfs is re-read) and, when ``dirty``, rewrite the journal before the
        next append."""
        nospace = getattr(e, "errno", None) in _NOSPACE
        self._journal_reason = "enospc" if nospace else "journal_error"
        self._journal_dirty = self._journal_dirty or dirty
        self._c["journal_errors"] += 1
        self._c["enospc" if nospace else "write_errors"] += 1
        first = not self._degraded_until
        self._degraded_until = time.monotonic() + self.degrade_s
        self.metrics.degraded.set(1)
        if first or not isinstance(e, OSError):
            log.warning("G3: journal %s: %s; tier degraded for %.1f s (no admission), the journal is rewritten "
                        "once it can be", self.journal.path, e, self.degrade_s, exc_info=not isinstance(e, OSError))

    def _tag(self, tenant: str) -> bytes:
        """``tenant_tag(tenant)``, cached per pool (at most 4097 ids of at most 256 chars)."""
        t = self._ttags.get(tenant)
        if t is None:
            t = tenant_tag(tenant)
            if len(tenant) <= 256:
                if len(self._ttags) > 4096:
                    self._ttags.clear()
                self._ttags[tenant] = t
        return t

    def stats(self) -> dict:
        """Counters and gauges. Sizes in bytes; ``*_blocks``/counts in blocks."""
        with self._lock:
            c = dict(self._c)
            d = {
                "tier": self.tier,
                "namespace": self.fp,
                "paths": list(self.slabs.paths),
                "files": len(self.slabs.files),
                "o_direct": dict(self.slabs.o_direct),
                "engine": getattr(self.engine, "name", type(self.engine).__name__),
                "block_bytes": self.block_bytes,
                "slot_bytes": self.slot_bytes,
                "io_size_bytes": self._io_size,
                "blocks": len(self.index),
                "used_bytes": len(self.index) * self.slot_bytes,
                "capacity_blocks": self.slabs.capacity_slots,
                "capacity_bytes": self.slabs.capacity_slots * self.slot_bytes,
                "configured_capacity_blocks": self.slabs.max_capacity_slots,
                "free_slots": self.slabs.free_slots(),
                "reserved_slots": self._reserved,
                "pinned_slots": self.index.pinned,
                "deferred_free_slots": self.index.deferred,
                "pending_blocks": self._pending,
                "degraded": bool(self._degraded_until),
                "admission": self.admission.policy,
                "foreign_files": list(self.slabs.foreign_files),
                "journal_records": self.journal.records,
            }
        for name in ("offloads_written", "offloads_skipped_present", "offloads_skipped_admission", "offloads_dropped",
                     "hits", "misses", "corrupt", "evictions", "bytes_written", "bytes_read", "enospc", "write_errors",
                     "restored_blocks", "restore_dropped", "lookup_blocks", "lookup_hits", "deleted", "late_reads",
                     "device_loads", "device_hits", "sync_groups"):
            d[name] = c.get(name, 0)
        # the names every pool reports (pool.base.STATS_CONTRACT)
        d["written"], d["dropped"] = d["offloads_written"], d["offloads_dropped"]
        d["skipped"] = d["offloads_skipped_present"] + d["offloads_skipped_admission"]
        d["dropped_by_reason"] = {k[8:]: v for k, v in c.items() if k.startswith("dropped:")}
        d["misses_by_reason"] = {k[5:]: v for k, v in c.items() if k.startswith("miss:")}
        d["corrupt_by_reason"] = {k[8:]: v for k, v in c.items() if k.startswith("corrupt:")}
        d["restore_dropped_by_reason"] = {k[8:]: v for k, v in c.items() if k.startswith("restore:")}
        d["hit_rate"] = d["lookup_hits"] / d["lookup_blocks"] if d["lookup_blocks"] else 0.0
        d["device_paths"] = self.reader.device_paths()
        return d

    def slot_accounting(self) -> dict:
        """Every slot below each file's cap is exactly one of: published, pinned-deferred, reserved,
        free. ``leaked`` must be 0 (tests assert it)."""
        with self._lock:
            cap = self.slabs.capacity_slots
            free = self.slabs.free_slots()
            used = sum(1 for _, (fi, si) in self.index.items() if si < self.slabs.by_index[fi].cap_slots)
            return {"capacity": cap, "used": used, "free": free, "reserved": self._reserved,
                    "deferred": self.index.deferred,
                    "leaked": cap - used - free - self._reserved - self.index.deferred}

    def _fd_of(self, file_index: int) -> int:
        """The open descriptor of slab file ``file_index`` (KeyError: no such file)."""
        return self.slabs.by_index[file_index].fd
