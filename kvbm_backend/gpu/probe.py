"""Device path selection: how frames reach a device (:data:`MODES`), decided by a real probe at start-up
(:func:`probe_device_path`: a write, a kvikio read into the device and a compare), never guessed.

``gds`` -- kvikio ``CuFile.pread`` with GPUDirect Storage (DMA from storage into HBM); ``kvikio-compat``
-- kvikio reads through its own pinned bounce buffer; ``pinned-bounce`` -- ``preadv`` into pinned host
memory, then a host-to-device copy (where kvikio is absent or its probe failed: the reason is kept);
``host`` -- the device is the CPU. Used by :class:`~kvbm_backend.pool.g3.read.device.DeviceLoader` and ``doctor``.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

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
    # the pid in its name: a G3 pool's open removes the file a killed probe left (pool.g3.dirs, PROBE_STALE_S)
    fd_tmp, path = tempfile.mkstemp(prefix=f".kvbm-gpu-probe-{os.getpid()}-", dir=directory)
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
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # removed meanwhile (as stale, by a G3 pool's open): nothing left to remove
    if info.get("io") == "gds":
        return ProbeResult("gds", "kvikio probe read verified; cuFile reports GDS available", info)
    return ProbeResult("kvikio-compat", f"kvikio probe read verified; {info.get('reason', 'compat mode')}", info)

