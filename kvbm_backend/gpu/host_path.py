"""Host-staged device transfers: G4 loads (decrypt on the host, then one host-to-device copy) and
device saves (one device-to-host copy into pinned staging, then the pool's ``put``).

G4 blocks are sealed with AES-256-GCM (DESIGN.md invariant 5); the tag is verified on the host where
the plaintext lands, so for G4 "verified where the bytes land" means the host staging buffer. The pool's
``get`` works on many blocks at once (the AEAD work in ``cryptography`` releases the GIL), all into one
pinned staging tensor; verified rows then go to the device in a single copy. ``G4Pool.get`` runs this
for torch-tensor destinations.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..model.namespace import BlockKey
from .staging import host_staging_pool, take_rows


def _torch():
    import torch
    return torch


def _host_staging(n: int, nbytes: int, device):
    """``(buf, rows)``: uint8 ``[n, nbytes]`` host rows from the staging pool (:mod:`.staging`),
    pinned when the device is CUDA (4 KiB aligned rows when ``nbytes`` is a 4 KiB multiple); ``buf``
    goes back with :func:`_give_staging` once nothing reads or writes the rows any more."""
    return take_rows(host_staging_pool(_torch().device(device).type == "cuda"), n, nbytes)


def _give_staging(buf: np.ndarray, device) -> None:
    host_staging_pool(_torch().device(device).type == "cuda").give(buf)


def check_dst(dst, nbytes: int, device) -> None:
    """Raise ValueError naming the first tensor of ``dst`` that is not a contiguous ``nbytes``-byte
    tensor on ``device``'s type."""
    torch = _torch()
    dev = torch.device(device)
    for i, t in enumerate(dst):
        if t.device.type != dev.type or not t.is_contiguous() or t.numel() * t.element_size() != nbytes:
            raise ValueError(f"dst[{i}]: need a contiguous {nbytes}-byte tensor on {dev}, got "
                             f"{t.numel() * t.element_size()} bytes on {t.device}")


def _u8(t):
    torch = _torch()
    return t.view(-1) if t.dtype == torch.uint8 else t.view(-1).view(torch.uint8)


def load_via_host(pool, keys: Sequence[BlockKey], dst: Sequence, *, timeout_s: float | None = None) -> list[bool]:
    """Load blocks through the host: one ``pool.get`` into a pinned staging tensor (the pool decrypts
    and verifies each block where it lands, many at once: G4 runs ``g4.max_inflight`` blocks in
    parallel, AES-GCM releases the GIL), then one host-to-device copy of the batch on a side stream,
    then the verified rows into ``dst``.

    Args:
        pool: a :class:`~kvbm_backend.pool.base.BlockPool` taking numpy buffers (G4; G3 on a host path).
        keys: block keys.
        dst: contiguous tensors of ``pool.layout.bytes_per_block`` bytes each, all on one device.
        timeout_s: wait for the pool's answer (None: the pool's own timeouts bound it); late = misses.
    Returns:
        ``ok[i]`` True only where the pool verified block i (AEAD tag / checksum) and it was copied;
        ``dst[i]`` is untouched where False.
    Raises:
        ValueError: length mismatch or bad ``dst`` tensors.
    """
    torch = _torch()
    if len(keys) != len(dst):
        raise ValueError(f"load_via_host: {len(keys)} keys but {len(dst)} destination tensors")
    n = len(keys)
    if n == 0:
        return []
    bpb = pool.layout.bytes_per_block
    device = dst[0].device
    check_dst(dst, bpb, device)
    buf, host = _host_staging(n, bpb, device)
    host_np = host.numpy()
    try:
        res = pool.get(list(keys), [host_np[r] for r in range(n)]).result(timeout=timeout_s)
        ok = [bool(x) for x in res.ok] + [False] * (n - len(res.ok))
    except Exception:  # noqa: BLE001 - storage trouble or late: misses (the pool logged and counted)
        return [False] * n  # the staging is not given back: a late read may still write into it
    if any(ok):
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                dev_stage = host.to(device, non_blocking=True)  # the one H2D copy
                for r in range(n):
                    if ok[r]:
                        _u8(dst[r]).copy_(dev_stage[r], non_blocking=True)
            stream.synchronize()
        else:
            for r in range(n):
                if ok[r]:
                    _u8(dst[r]).copy_(host[r])
    _give_staging(buf, device)  # the pool's get is done and the copies are synchronised
    return ok


def device_blocks_to_host(src: Sequence, nbytes: int) -> list[np.ndarray]:
    """Save side: gather device block tensors into one pinned host staging tensor (one D2H copy per
    block on one stream, one sync) and return 1-D uint8 numpy views (``nbytes`` each) for
    ``pool.put``. The views stay valid as long as the returned list is referenced.

    Args:
        src: contiguous tensors (CUDA or CPU) of ``nbytes`` bytes each (FullyContiguous blocks).
    Raises:
        ValueError: a tensor of the wrong size.
    """
    torch = _torch()
    if not src:
        return []
    device = src[0].device
    check_dst(src, nbytes, device)
    _, host = _host_staging(len(src), nbytes, device)  # the caller keeps the views: never given back
    for r, t in enumerate(src):
        host[r].copy_(_u8(t), non_blocking=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    arr = host.numpy()
    return [arr[r] for r in range(len(src))]
