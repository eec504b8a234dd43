"""The verify side of :class:`~.device.DeviceLoader`: a read pass's 4 KiB headers checked on the host,
payloads checked where they landed (the device checksum on the device, else xxh3_128 on the host),
verified payloads copied into the caller's tensors by runs of rows (:class:`kvbm_backend.gpu.rows.BlockRows`); corrupt slots reported to
the source (invariant 1, never wrong KV).

A pass is verified in two steps so the loader's thread never waits for the device while reads are
still to be reaped (``docs/gpu.md``):

* :meth:`PassVerifier.launch` (as soon as the pass's reads are in): queues on the loader's stream the
  copy of the header bytes to pinned host memory (kvikio paths: the headers landed on the device) and
  the device checksum of every row, and the copy of the checksums back, then records an event;
* :meth:`PassVerifier.complete` (one pass later): waits for that event (by then long done), checks the
  headers with numpy (:meth:`~kvbm_backend.model.frame.ChecksumFrames.check_headers`; a header that
  fails is checked again by :func:`.stages.check_frame`, which names the reason), compares the
  checksums and queues the copy-out of the good rows, then records the event the staging's next user
  waits for (:attr:`~.passes._Pass.done`).

On the CPU (``host`` mode) both steps run in :meth:`~PassVerifier.complete`, in order.
:class:`PassVerifier` is a part the loader owns (``loader.verifier``).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ....model.frame import FLAG_DEVCHECK, HEADER_BYTES, FrameError, FrameHeader, \
    header_dev_checks, payload_checksum
from ....model.layout import KvLayout
from ....model.namespace import BlockKey
from ....gpu.checksum import combine_limb_sums, device_limb_sums
from ....gpu.rows import BlockRows
from ...base import SlotLeaseSource
from .passes import _Pass
from .stages import HEADER_COPY, TRANSIENT, HeaderChecks, add_seconds, check_frame, report_corrupt

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

class PassVerifier:
    """Header and payload checks and the copy-out of :class:`~.device.DeviceLoader`.

    Args:
        source: the lease source corrupt slots are reported to (``drop_corrupt``).
        layout: the namespace's layout. device: where payloads landed. world: TP world size frames name
            (None: any). tenant_tag_fn: a key's expected 16-byte tenant tag. counters: the loader's Counter.
        stream: the loader's CUDA stream (None on the CPU): checks and copy-outs are queued on it.
    """

    def __init__(self, source: SlotLeaseSource, layout: KvLayout, device: torch.device, world: int | None,
                 tenant_tag_fn: Callable[[BlockKey], bytes], counters: Counter[str],
                 stream: torch.cuda.Stream | None) -> None:
        self.source, self.layout, self.device, self.world = source, layout, device, world
        self.tenant_tag_fn, self.counters, self.stream = tenant_tag_fn, counters, stream
        self._checks = HeaderChecks(layout, world, tenant_tag_fn)  # whole passes of headers at once
        # ring slot -> pinned (headers [rows, HEADER_COPY] uint8, limb sums [rows, 4] int64): a slot's next pass
        # is launched only after its last one completed, so the queued copies never overlap
        self._pinned: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def launch(self, p: _Pass) -> None:
        """Queue the pass's header copy and device checksums on the loader's stream (CUDA; reads reaped).
        On the CPU this does nothing: :meth:`complete` checks in order."""
        if self.stream is None or not any(s is None for s in p.status):
            return
        import torch
        t0 = time.perf_counter()
        n = len(p.rows)
        hdr_all, sums_all = self._pinned.get(p.ring, (None, None))
        if hdr_all is None or sums_all is None or hdr_all.shape[0] < n:
            hdr_all = torch.empty((n, HEADER_COPY), dtype=torch.uint8, pin_memory=True)
            sums_all = torch.empty((n, 4), dtype=torch.int64, pin_memory=True)
            self._pinned[p.ring] = (hdr_all, sums_all)
        if p.headers is None:  # kvikio: the headers landed on the device with the payloads
            hdr = hdr_all[:n]
            hdr.copy_(p.staging[:, :HEADER_COPY], non_blocking=True)
            p.headers = hdr.numpy()
        # every row (cheap here); the device tensor may be freed on return: torch reuses its memory only
        # after the queued copy below (same stream)
        sums = device_limb_sums(p.staging, HEADER_BYTES, self.layout.bytes_per_block)
        sums_h = sums_all[:n]
        sums_h.copy_(sums, non_blocking=True)
        p.sums = sums_h.numpy()
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        ev.record(self.stream)
        p.checked = ev
        add_seconds(self.counters, "verify_payload_s", time.perf_counter() - t0)

    def complete(self, p: _Pass, keys: Sequence[BlockKey], dst: BlockRows, why: list[str | None]) -> None:
        """Check headers and payloads of a launched pass; queue the copy of the verified payloads into
        ``dst``; record :attr:`~.passes._Pass.done` (CUDA)."""
        t_start = time.perf_counter()
        n = len(p.rows)
        bpb = self.layout.bytes_per_block
        for r in range(n):
            why[p.rows[r]] = p.status[r]
        good = [r for r in range(n) if p.status[r] is None]
        if good:
            if p.checked is not None:
                p.checked.synchronize()  # queued a pass ago: normally done already
            headers = self._headers(p)
            dev_rows, expect, host_rows = self._check_headers(p, keys, headers, good)
            t0 = time.perf_counter()
            add_seconds(self.counters, "verify_headers_s", t0 - t_start)
            ok_rows = self._check_payloads(p, dev_rows, expect, host_rows)
            t1 = time.perf_counter()
            add_seconds(self.counters, "verify_payload_s", t1 - t0)
            # one copy per run of rows (a matrix destination) or one multi-tensor copy: never one per block
            dst.copy_in([p.rows[r] for r in ok_rows], p.staging[:, HEADER_BYTES:HEADER_BYTES + bpb], ok_rows,
                        non_blocking=True)
            for r in range(n):
                i = p.rows[r]
                why[i] = reason = p.status[r]
                if reason is not None and reason not in TRANSIENT:
                    self.counters["unverifiable" if reason == "unverifiable" else f"corrupt_{reason}"] += 1
            report_corrupt(self.source, keys, why, p.rows)  # the pool proves them bad before dropping
            add_seconds(self.counters, "verify_copy_s", time.perf_counter() - t1)
        if self.stream is not None:
            import torch
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
            ev.record(self.stream)  # after everything that reads the staging: its next pass waits for this
            p.done = ev

    # -- steps ---------------------------------------------------------------------------------
    def _headers(self, p: _Pass) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The pass's header bytes on the host, ``[n, >= HEADER_COPY]``."""
        if p.headers is not None:  # bounce/host: the reader threads copied them; kvikio: launch() did
            return p.headers
        if p.host is not None:
            return p.host[:, :HEADER_BYTES].numpy()
        return p.staging[:, :HEADER_BYTES].cpu().numpy()  # host mode without a header buffer

    def _check_headers(self, p: _Pass, keys: Sequence[BlockKey], headers: np.ndarray[Any, np.dtype[np.uint8]],
                       good: list[int]) -> tuple[list[int], list[int], list[tuple[int, FrameHeader]]]:
        """Header checks of the ``good`` rows: ``(device-checked rows, their expected checksums, host-checked
        (row, header))``; a failed row gets its reason in ``p.status``. All rows at once with numpy,
        rows of one namespace per call; any row that fails there is checked again one by one (the reason)."""
        hv = headers[:, :HEADER_COPY]
        hg = hv if len(good) == len(hv) else hv[good]
        fast_ok, fast_dev = self._checks.check(hg, [keys[p.rows[r]] for r in good])
        checks = header_dev_checks(hg).tolist()
        fast = (fast_ok & fast_dev).tolist()
        dev_rows: list[int] = []
        expect: list[int] = []
        host_rows: list[tuple[int, FrameHeader]] = []
        for j, r in enumerate(good):
            if fast[j]:
                dev_rows.append(r)
                expect.append(checks[j])
                continue
            i = p.rows[r]
            try:  # the reason of a failed row, or the xxh3 of a FLAG_CHECKSUM-only frame
                h = check_frame(headers[r], keys[i], self.layout, self.tenant_tag_fn(keys[i]), world=self.world,
                                slot_len=p.slot_len)
                if h.flags & FLAG_DEVCHECK:
                    dev_rows.append(r)
                    expect.append(h.dev_check)
                else:  # FLAG_CHECKSUM: xxh3_128 on the host
                    host_rows.append((r, h))
            except FrameError as e:
                p.status[r] = e.reason
        return dev_rows, expect, host_rows

    def _check_payloads(self, p: _Pass, dev_rows: list[int], expect: list[int],
                        host_rows: list[tuple[int, FrameHeader]]) -> list[int]:
        """Rows whose payload matched its checksum (the others get ``devcheck`` / ``integrity``)."""
        bpb = self.layout.bytes_per_block
        ok_rows: list[int] = []
        if dev_rows:
            if p.sums is not None:  # launched on the device a pass ago
                got = combine_limb_sums(p.sums[dev_rows])
            else:  # CPU: computed here, rows that need it only
                rows_t = p.staging[dev_rows] if len(dev_rows) != len(p.rows) else p.staging
                got = combine_limb_sums(device_limb_sums(rows_t, HEADER_BYTES, bpb).numpy())
            for r, g, want in zip(dev_rows, got.tolist(), expect):
                if g == want:
                    ok_rows.append(r)
                else:
                    p.status[r] = "devcheck"
        rows_h = None  # the pass's host rows as one numpy array: a tensor object per block costs GIL hand-offs
        if host_rows:
            src = p.host if p.host is not None else p.staging
            rows_h = src.numpy() if src.device.type == "cpu" else None
        for r, h in host_rows:
            pay_h = rows_h[r, HEADER_BYTES:HEADER_BYTES + bpb] if rows_h is not None else \
                p.staging[r, HEADER_BYTES:HEADER_BYTES + bpb].cpu().numpy()
            if payload_checksum(pay_h) == h.integrity:
                ok_rows.append(r)
                self.counters["host_verified"] += 1
            else:
                p.status[r] = "integrity"
        ok_rows.sort()
        return ok_rows
