"""The verify side of :class:`~.device.DeviceLoader`: a read pass's 4 KiB headers
checked on the host (:func:`.stages.check_frame`), payloads checked where they landed (the
device checksum on the device, else xxh3_128 on the host), verified payloads copied into the caller's
tensors in one multi-tensor copy; corrupt slots reported to the source (invariant 1, never wrong KV).

:class:`PassVerifier` is a part the loader owns (``loader.verifier``).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Callable, Sequence

from ....model.frame import FLAG_DEVCHECK, HEADER_BYTES, FrameError, FrameHeader, payload_checksum
from ....model.layout import KvLayout
from ....model.namespace import BlockKey
from ....gpu.checksum import device_checksums_torch
from ...base import SlotLeaseSource
from .passes import _Pass
from .stages import TRANSIENT, add_seconds, check_frame, report_corrupt

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class PassVerifier:
    """Header and payload checks and the copy-out of :class:`~.device.DeviceLoader`.

    Args:
        source: the lease source corrupt slots are reported to (``drop_corrupt``).
        layout: the namespace's layout. device: where payloads landed. world: TP world size frames name.
        tenant_tag_fn: a key's expected 16-byte tenant tag. counters: the loader's Counter.
        stream: the loader's CUDA stream (None on the CPU): synchronised once a pass is copied out.
    """

    def __init__(self, source: SlotLeaseSource, layout: KvLayout, device: torch.device, world: int | None,
                 tenant_tag_fn: Callable[[BlockKey], bytes], counters: Counter[str],
                 stream: torch.cuda.Stream | None) -> None:
        self.source, self.layout, self.device, self.world = source, layout, device, world
        self.tenant_tag_fn, self.counters, self.stream = tenant_tag_fn, counters, stream

    def verify_copy(self, p: _Pass, keys: Sequence[BlockKey], dst: Sequence[torch.Tensor],
                    why: list[str | None]) -> None:
        """Check headers and payloads of a read pass; copy the verified payloads into ``dst``."""
        t_start = time.perf_counter()
        n = len(p.rows)
        bpb = self.layout.bytes_per_block
        staging = p.staging
        for r in range(n):
            why[p.rows[r]] = p.status[r]
        good = [r for r in range(n) if p.status[r] is None]
        if not good:
            return
        # headers come to the host (bounce and host paths: the reader threads copied them there)
        if p.headers is not None:
            headers = p.headers
        elif p.host is not None:
            headers = p.host[:, :HEADER_BYTES].numpy()
        elif self.device.type == "cpu":
            headers = staging[:, :HEADER_BYTES].numpy()
        else:
            headers = staging[:, :HEADER_BYTES].cpu().numpy()
        devcheck_rows: list[int] = []
        expect: list[int] = []
        host_rows: list[tuple[int, FrameHeader]] = []
        for r in good:
            i = p.rows[r]
            try:
                h = check_frame(headers[r], keys[i], self.layout, self.tenant_tag_fn(keys[i]), world=self.world,
                                slot_len=p.slot_len)
                if h.flags & FLAG_DEVCHECK:  # checked on the device, where the payload landed
                    devcheck_rows.append(r)
                    expect.append(h.dev_check)
                else:  # FLAG_CHECKSUM: xxh3_128 on the host
                    host_rows.append((r, h))
            except FrameError as e:
                p.status[r] = e.reason
        t0 = time.perf_counter()
        add_seconds(self.counters, "verify_headers_s", t0 - t_start)
        ok_rows: list[int] = []
        if devcheck_rows:
            rows_t = staging[devcheck_rows] if len(devcheck_rows) != n else staging
            got = device_checksums_torch(rows_t, HEADER_BYTES, bpb)  # one sync for the pass
            for r, g, want in zip(devcheck_rows, got, expect):
                if g == want:
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
        t1 = time.perf_counter()
        add_seconds(self.counters, "verify_payload_s", t1 - t0)
        if ok_rows:  # one multi-tensor copy for the pass (not one launch per block)
            dsts = [_bytes_view(dst[p.rows[r]]) for r in ok_rows]
            srcs = [staging[r, HEADER_BYTES:HEADER_BYTES + bpb] for r in ok_rows]
            _copy_all(dsts, srcs)
        for r in range(n):
            i = p.rows[r]
            why[i] = reason = p.status[r]
            if reason is not None and reason not in TRANSIENT:
                self.counters["unverifiable" if reason == "unverifiable" else f"corrupt_{reason}"] += 1
        report_corrupt(self.source, keys, why, p.rows)  # the pool proves them bad before dropping
        if self.stream is not None:
            self.stream.synchronize()  # dst written; staging free for the pass after next
        add_seconds(self.counters, "verify_copy_s", time.perf_counter() - t1)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of a contiguous tensor's bytes."""
    import torch
    t = t.view(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for all i on the current stream, fused where torch can
    (``torch._foreach_copy_``), else one copy per pair."""
    import torch
    fused = getattr(torch, "_foreach_copy_", None)
    if fused is not None and len(dsts) > 1:
        fused(dsts, srcs, non_blocking=True)
        return
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=True)

