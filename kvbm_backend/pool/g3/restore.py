"""G3 warm restart (invariant 6): replay the journal, re-read and check every referenced slot header,
rebuild the index and the slab free lists. Mixed into :class:`~kvbm_backend.pool.g3.pool.G3Pool`."""
from __future__ import annotations

import collections
import logging
import os

from ...memory import aligned_empty
from ...model import frame
from ...model.frame import FrameError
from ...model.namespace import tenant_tag
from ...transfer import header_extents, plan_ops
from .index import TagKey
from .slots import HDR

log = logging.getLogger(__name__)


class RestoreMixin:
    """Warm restart of :class:`~kvbm_backend.pool.g3.pool.G3Pool` (run once, from ``__init__``)."""

    # ---- internals: restore -------------------------------------------------------------------
    def _restore(self) -> None:
        entries, info = self.journal.load()
        if info["bad_header"]:
            log.warning("G3: journal %s is not this namespace's; ignored", self.journal.path)
        if info["torn_bytes"]:
            log.warning("G3: journal %s: %d torn bytes at the tail ignored", self.journal.path, info["torn_bytes"])
        if info["version"] == 1:
            log.info("G3: journal %s is format version 1 (tenant ids in clear); rewritten as version 2",
                     self.journal.path)
        cand = []
        for key, (fi, si) in entries.items():
            f = self.slabs.by_index.get(fi)
            if f is None or si >= f.max_slots:
                self._c["restore:capacity"] += 1
            elif (si + 1) * self.slot_bytes > f.size_slots * self.slot_bytes:
                self._c["restore:short"] += 1
            else:
                cand.append((key, (fi, si)))
        good = []
        chunk = 4096
        for c0 in range(0, len(cand), chunk):
            part = cand[c0:c0 + chunk]
            hdrs = aligned_empty(len(part) * HDR)
            exts = header_extents([slot for _, slot in part], hdrs, self.slot_bytes, HDR, self._fd_of)
            readable = None
            try:
                self.engine.submit(plan_ops(exts, self._io_size, write=False)).result()
            except OSError as e:  # one bad read must not cost the chunk: read the headers one by one
                log.warning("G3 restore: header reads failed (%s); reading %d headers one by one", e, len(part))
                readable = self._read_headers_one_by_one(part, hdrs)
            for j, (key, slot) in enumerate(part):
                if readable is not None and not readable[j]:
                    self._c["restore:io_error"] += 1
                    continue
                try:
                    h = frame.accept(hdrs[j * HDR:(j + 1) * HDR], key, self._layout,
                                     key.tag if type(key) is TagKey else tenant_tag(key.tenant),
                                     world=self.namespace.tp_world_size, stored_len=self.block_bytes)
                    if not h.flags & frame.FLAG_CHECKSUM:
                        raise FrameError("length", "frame carries no checksum")
                except FrameError as e:
                    self._c["restore:" + e.reason] += 1
                    continue
                good.append((key, slot))
        used: dict[int, set[int]] = collections.defaultdict(set)
        self.index.restore_many(good)  # one vectorised build, oldest first
        for _key, slot in good:
            used[slot[0]].add(slot[1])
        self.slabs.restore(used)
        self._c["restored_blocks"] = len(good)
        self._c["restore_dropped"] = len(entries) - len(good)
        try:
            self.journal.rewrite(self.index.items())
        except OSError as e:  # full disk at open: serve what is here, admit nothing until it can be written
            self._journal_failed(e)

    def _read_headers_one_by_one(self, part: list, hdrs) -> list[bool]:
        """Read the header of each ``(key, slot)`` of ``part`` into ``hdrs[j * HDR:]`` with its own
        ``preadv``; returns which reads returned the whole header."""
        out = []
        for j, (_, (fi, si)) in enumerate(part):
            try:
                out.append(os.preadv(self._fd_of(fi), [hdrs[j * HDR:(j + 1) * HDR]], si * self.slot_bytes) == HDR)
            except (OSError, KeyError):
                out.append(False)
        return out
