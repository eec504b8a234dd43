"""Device load path: stored frames -> device staging buffer -> verified on the device -> caller's tensors.

Data path per :meth:`DeviceLoader.load` batch (invariant 1 of DESIGN.md, "never wrong KV"):

1. ``source.locate(key)`` gives each block's frame location ``(path, offset, slot_len)`` (G3 slot:
   4 KiB header + payload padded to 4 KiB). Adjacent slots of one file are merged into one read.
2. The frames are read into a device staging tensor ``[n, slot_len]`` (uint8):
   ``gds`` / ``kvikio-compat`` -- kvikio ``CuFile.pread`` straight into device memory (GDS DMA, or
   kvikio's own pinned bounce buffer in compat mode); ``pinned-bounce`` -- ``preadv`` into a pinned
   host tensor, then one host-to-device copy; ``host`` -- the device is the CPU (same code, no copy).
   Which one is decided by :func:`probe_device_path` at start-up (a real write/read/compare in the
   pool's directory) and reported in :attr:`DeviceLoader.mode` / :attr:`DeviceLoader.mode_reason`.
3. The 4 KiB headers (only) come to the host: magic, version, header check, identity (namespace,
   tenant, rank, sequence hash) and layout are checked (:class:`~kvbm_backend.model.frame.FrameHeader`).
4. Payload integrity is checked where the bytes landed: frames with ``FLAG_DEVCHECK`` are verified on
   the device with :func:`~kvbm_backend.gpu.checksum.device_checksums_torch` (one sync per batch);
   frames with only the xxh3_128 ``FLAG_CHECKSUM`` are copied to the host and checked there (counted as
   ``host_verified``); encrypted or unchecked frames are misses (``unverifiable``).
5. Only verified payloads are copied into ``dst[i]``; a failed probe, failed/short/late I/O, a bad
   header or a checksum mismatch leaves ``dst[i]`` untouched and returns ``False`` (a miss, counted;
   corrupt slots are reported to ``source.drop_corrupt(key, reason)`` where the source has it).

Source seam (the G3 pool): ``locate(key) -> (path, offset, slot_len) | None``; optionally
``release(key)`` (called after the read, for pools that pin slots while they are read) and
``drop_corrupt(key, reason)``.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from ..model.frame import FLAG_CHECKSUM, FLAG_DEVCHECK, FLAG_ENCRYPTED, HEADER_BYTES, FrameError, FrameHeader
from ..model.frame import payload_checksum
from ..model.layout import KvLayout
from ..model.namespace import BlockKey, tenant_tag
from .checksum import device_checksums_torch

log = logging.getLogger(__name__)

MODES = ("gds", "kvikio-compat", "pinned-bounce", "host")
PROBE_BYTES = 1 << 20


@dataclass(frozen=True)
class SlotLocation:
    """Where a stored frame is: ``path`` of the slab file, ``offset`` (bytes, 4 KiB multiple) of the
    frame's header, ``slot_len`` (bytes: ``frame.slot_bytes(stored_len)``)."""

    path: str
    offset: int
    slot_len: int


class SlotSource(Protocol):
    def locate(self, key: BlockKey) -> "tuple[str, int, int] | SlotLocation | None":
        """The frame location of ``key`` or None (a miss). Pools that pin slots pin here."""


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


def _as_loc(x) -> SlotLocation | None:
    if x is None:
        return None
    if isinstance(x, SlotLocation):
        return x
    p, o, n = x
    return SlotLocation(str(p), int(o), int(n))


class DeviceLoader:
    """Loads stored frames into device tensors, verifying them on the device first.

    Args:
        source: the pool's slot locator (see module docstring).
        layout: the namespace's :class:`KvLayout`; ``dst`` tensors hold ``layout.bytes_per_block`` bytes.
        device: torch device for staging (``cuda:N``; ``cpu`` runs the same path on the host).
        probe_dir: directory for the start-up probe (a pool directory); default: none, which on CUDA
            means ``pinned-bounce`` unless ``mode`` forces otherwise.
        mode: ``auto`` (probe) or one of :data:`MODES`.
        tenant_tag_fn: expected 16-byte frame tenant tag of a key (default: G3's
            :func:`~kvbm_backend.model.namespace.tenant_tag` of ``key.tenant``).
        staging_bytes: most device staging bytes per pass (bounds extra HBM; default 256 MiB).
        timeout_s: a batch's reads not done by then are misses (their staging is kept until the I/O
            finishes, never reused early).
        threads: reads in flight (bounce path) / kvikio pool size.
    Raises:
        ValueError: bad arguments.
    """

    def __init__(self, source: SlotSource, layout: KvLayout, device="cuda", *, probe_dir: str | None = None,
                 mode: str = "auto", tenant_tag_fn: Callable[[BlockKey], bytes] | None = None,
                 staging_bytes: int = 256 << 20, timeout_s: float = 5.0, threads: int = 8):
        torch = _torch()
        if mode not in ("auto",) + MODES:
            raise ValueError(f"mode: expected auto or one of {MODES}, got {mode!r}")
        if staging_bytes < 4096:
            raise ValueError(f"staging_bytes: at least 4096 bytes, got {staging_bytes}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0 seconds, got {timeout_s}")
        self.source = source
        self.layout = layout
        self.device = torch.device(device)
        self.tenant_tag_fn = tenant_tag_fn or (lambda k: tenant_tag(k.tenant))
        self.staging_bytes = staging_bytes
        self.timeout_s = timeout_s
        self.threads = threads
        self.counters: Counter = Counter()
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._abandoned: list = []  # (futures, tensors) of timed-out reads, kept alive until done
        self._engine = None
        self._pool = None
        self._pinned = None  # reusable pinned bounce buffer (pinned-bounce mode)
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
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvbm-dev-bounce")
        log.info("device load path: %s (%s)", self.mode, self.mode_reason)

    # -- files -------------------------------------------------------------------------------
    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                self._fds[path] = fd
            return fd

    # -- public ------------------------------------------------------------------------------
    def load(self, keys: Sequence[BlockKey], dst: Sequence) -> list[bool]:
        """Load ``keys[i]`` into ``dst[i]``.

        Args:
            keys: block keys of this rank.
            dst: one contiguous tensor per key on :attr:`device`, ``layout.bytes_per_block`` bytes each
                (any dtype; its bytes are overwritten with the FullyContiguous block
                ``[layer, outer, page, inner]``), e.g. rows of a staging tensor that the connector then
                scatters into the engine's paged KV.
        Returns:
            ``ok[i]``: True only if the frame was found, read in full, its header identity matched and
            its payload checksum verified on :attr:`device`; only then was ``dst[i]`` written.
        Raises:
            ValueError: ``len(keys) != len(dst)``, or a ``dst`` tensor of the wrong size, device or
            layout (programming errors, not storage trouble).
        """
        torch = _torch()
        if len(keys) != len(dst):
            raise ValueError(f"load: {len(keys)} keys but {len(dst)} destination tensors")
        bpb = self.layout.bytes_per_block
        for i, t in enumerate(dst):
            if t.device != self.device and not (t.device.type == self.device.type == "cuda"
                                                and self.device.index is None):
                raise ValueError(f"dst[{i}]: on {t.device}, loader stages on {self.device}")
            if not t.is_contiguous() or t.numel() * t.element_size() != bpb:
                raise ValueError(f"dst[{i}]: need a contiguous tensor of {bpb} bytes, got "
                                 f"{t.numel() * t.element_size()} bytes contiguous={t.is_contiguous()}")
        ok = [False] * len(keys)
        locs: list[SlotLocation | None] = []
        for k in keys:
            try:
                locs.append(_as_loc(self.source.locate(k)))
            except Exception as e:  # noqa: BLE001 - a source failure is a miss
                log.warning("locate failed for %s: %s", k, e)
                locs.append(None)
        for i, l in enumerate(locs):
            if l is None:
                self.counters["not_found"] += 1
        todo = [i for i, l in enumerate(locs) if l is not None]
        try:
            # batches of rows with one slot_len, bounded by staging_bytes
            while todo:
                slot_len = locs[todo[0]].slot_len
                per = max(1, self.staging_bytes // slot_len)
                batch = [i for i in todo if locs[i].slot_len == slot_len][:per]
                bset = set(batch)
                todo = [i for i in todo if i not in bset]
                for i, good in zip(batch, self._load_batch([keys[i] for i in batch], [locs[i] for i in batch],
                                                           [dst[i] for i in batch], slot_len)):
                    ok[i] = good
        finally:
            rel = getattr(self.source, "release", None)
            if rel is not None:
                for k, l in zip(keys, locs):
                    if l is not None:
                        try:
                            rel(k)
                        except Exception as e:  # noqa: BLE001
                            log.warning("release failed for %s: %s", k, e)
        self.counters["loaded"] += sum(ok)
        self.counters["missed"] += len(ok) - sum(ok)
        return ok

    def stats(self) -> dict:
        """Counters: ``loaded``, ``missed``, ``not_found``, ``io_error``, ``short``, ``timeout``,
        ``corrupt_<reason>`` (FrameError reasons, ``devcheck``), ``unverifiable``, ``host_verified``,
        ``bytes_read``; plus ``mode`` and ``mode_reason``."""
        d = dict(self.counters)
        d.update(mode=self.mode, mode_reason=self.mode_reason)
        return d

    def close(self) -> None:
        if self._engine is not None:
            for fd in list(self._fds.values()):
                self._engine.forget_fd(fd)
            self._engine.close()
            self._engine = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

    # -- internals ---------------------------------------------------------------------------
    @staticmethod
    def _runs(locs: list[SlotLocation]) -> list[tuple[int, int]]:
        """[(first row, row count)] of rows whose slots are adjacent in one file."""
        runs = []
        s = 0
        for r in range(1, len(locs) + 1):
            if (r == len(locs) or locs[r].path != locs[r - 1].path
                    or locs[r].offset != locs[r - 1].offset + locs[r - 1].slot_len):
                runs.append((s, r - s))
                s = r
        return runs

    def _read(self, locs, staging, slot_len) -> list[str | None]:
        """Read every frame into ``staging`` rows; per row None (read in full) or the failure reason."""
        torch = _torch()
        runs = self._runs(locs)
        status: list[str | None] = ["io_error"] * len(locs)
        deadline = time.monotonic() + self.timeout_s
        host = None
        if self.mode in ("pinned-bounce", "host"):
            if self.mode == "host":
                host = staging
            else:
                host = self._pinned
                if host is None or host.numel() < staging.numel():
                    host = torch.empty(staging.numel(), dtype=torch.uint8, pin_memory=True)
                    self._pinned = host
                host = host[:staging.numel()].view(staging.shape)
            host_np = host.numpy()
            from ..io.base import IoOp
            from ..io.posix import run_op

            def one(r0, n):
                fd = self._fd(locs[r0].path)
                return run_op(IoOp(fd, locs[r0].offset, [host_np[r0:r0 + n].reshape(-1)], write=False))
            futs = [(r0, n, self._pool.submit(one, r0, n)) for r0, n in runs]
        else:
            futs = []
            for r0, n in runs:
                try:
                    f = self._engine.read_to_device_async(self._fd(locs[r0].path), staging[r0:r0 + n].reshape(-1),
                                                          n * slot_len, locs[r0].offset)
                    futs.append((r0, n, f))
                except Exception as e:  # noqa: BLE001
                    log.warning("kvikio read submit failed: %s", e)
                    self.counters["io_error"] += n
        pending = []
        for r0, n, f in futs:
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
                self.counters["timeout"] += n
                for r in range(r0, r0 + n):
                    status[r] = "timeout"
                pending.append(f)
                continue
            except Exception as e:  # noqa: BLE001 - I/O failure: a miss
                log.warning("frame read failed (%s rows at %s:%d): %s", n, locs[r0].path, locs[r0].offset, e)
                self.counters["io_error"] += n
                continue
            self.counters["bytes_read"] += got
            full = got // slot_len
            for r in range(r0, r0 + n):
                status[r] = None if r - r0 < full else "short"
            if full < n:
                self.counters["short"] += n - full
        if pending:  # keep buffers alive until the I/O ends; never hand them out again
            self._abandoned.append((pending, staging, host))
            self._pinned = None
        self._abandoned = [a for a in self._abandoned if not all(
            (x.done() if hasattr(x, "done") else True) for x in a[0])]
        if host is not None and self.mode == "pinned-bounce" and not pending:
            staging.copy_(host, non_blocking=True)
        elif host is not None and self.mode == "pinned-bounce":
            rows = [r for r, s in enumerate(status) if s is None]
            for r in rows:
                staging[r].copy_(host[r], non_blocking=True)
        return status

    def _load_batch(self, keys, locs, dst, slot_len) -> list[bool]:
        torch = _torch()
        n = len(keys)
        bpb = self.layout.bytes_per_block
        if slot_len < HEADER_BYTES + bpb or slot_len % 4096:
            for _ in keys:
                self.counters["corrupt_length"] += 1
            return [False] * n
        if self.mode == "host":
            staging = torch.empty((n, slot_len), dtype=torch.uint8)
        else:
            staging = torch.empty((n, slot_len), dtype=torch.uint8, device=self.device)
        status = self._read(locs, staging, slot_len)
        good_rows = [r for r in range(n) if status[r] is None]
        if not good_rows:
            return [False] * n
        headers = staging[:, :HEADER_BYTES].cpu().numpy() if self.device.type != "cpu" else staging[:, :HEADER_BYTES].numpy()
        devcheck_rows, expect, host_rows = [], [], []
        for r in good_rows:
            try:
                h = FrameHeader.unpack(headers[r])
                h.check_identity(keys[r], self.layout, self.tenant_tag_fn(keys[r]))
                if h.flags & FLAG_ENCRYPTED:
                    raise FrameError("unverifiable", "encrypted frame on the device path (G4: use load_via_host)")
                if h.flags & FLAG_DEVCHECK:
                    devcheck_rows.append(r)
                    expect.append(h.dev_check)
                elif h.flags & FLAG_CHECKSUM:
                    host_rows.append((r, h))
                else:
                    raise FrameError("unverifiable", "frame carries no checksum")
            except FrameError as e:
                status[r] = e.reason
        ok = [False] * n
        if devcheck_rows:
            rows_t = staging[devcheck_rows] if len(devcheck_rows) != n else staging
            got = device_checksums_torch(rows_t, HEADER_BYTES, bpb)
            for r, g, e in zip(devcheck_rows, got, expect):
                if g == e:
                    ok[r] = True
                else:
                    status[r] = "devcheck"
        for r, h in host_rows:
            pay = staging[r, HEADER_BYTES:HEADER_BYTES + bpb]
            pay_h = pay.cpu().numpy() if self.device.type != "cpu" else pay.numpy()
            if payload_checksum(pay_h) == h.integrity:
                ok[r] = True
                self.counters["host_verified"] += 1
            else:
                status[r] = "integrity"
        for r in range(n):
            if ok[r]:
                d = dst[r].view(-1).view(torch.uint8) if dst[r].dtype != torch.uint8 else dst[r].view(-1)
                d.copy_(staging[r, HEADER_BYTES:HEADER_BYTES + bpb], non_blocking=True)
            elif status[r] not in (None, "io_error", "short", "timeout"):
                reason = status[r]
                self.counters["unverifiable" if reason == "unverifiable" else f"corrupt_{reason}"] += 1
                drop = getattr(self.source, "drop_corrupt", None)
                if drop is not None and reason != "unverifiable":
                    try:
                        drop(keys[r], reason)
                    except Exception as e:  # noqa: BLE001
                        log.warning("drop_corrupt failed for %s: %s", keys[r], e)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return ok
