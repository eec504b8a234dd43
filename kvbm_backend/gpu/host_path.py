"""Host-staged device transfers: G4 loads (decrypt on the host, then one host-to-device copy) and
device saves (one device-to-host copy into pinned staging, then the pool's ``put``).

G4 blocks are sealed with AES-256-GCM (DESIGN.md invariant 5); the tag is verified on the host where
the plaintext lands, so for G4 "verified where the bytes land" means the host staging buffer. The pool's
``get`` runs on several chunks of blocks at once (threads; the AEAD work in ``cryptography`` releases
the GIL), all into one pinned staging tensor; verified rows then go to the device in a single copy.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from ..model.namespace import BlockKey


def _torch():
    import torch
    return torch


def _host_staging(n: int, nbytes: int, device):
    """uint8 ``[n, nbytes]`` host tensor, pinned when the device is CUDA (4 KiB aligned rows when
    ``nbytes`` is a 4 KiB multiple: pinned allocations are page aligned)."""
    torch = _torch()
    pin = torch.device(device).type == "cuda"
    return torch.empty((n, nbytes), dtype=torch.uint8, pin_memory=pin)


def _check_dst(dst, nbytes: int, device) -> None:
    torch = _torch()
    dev = torch.device(device)
    for i, t in enumerate(dst):
        if t.device.type != dev.type or not t.is_contiguous() or t.numel() * t.element_size() != nbytes:
            raise ValueError(f"dst[{i}]: need a contiguous {nbytes}-byte tensor on {dev}, got "
                             f"{t.numel() * t.element_size()} bytes on {t.device}")


def _u8(t):
    torch = _torch()
    return t.view(-1) if t.dtype == torch.uint8 else t.view(-1).view(torch.uint8)


def load_via_host(pool, keys: Sequence[BlockKey], dst: Sequence, *, chunk_blocks: int = 8, threads: int = 4,
                  timeout_s: float | None = None) -> list[bool]:
    """Load blocks through the host: ``pool.get`` (decrypt + verify, G4) in parallel chunks into one
    pinned staging tensor, then one host-to-device copy, then verified rows into ``dst``.

    Args:
        pool: a :class:`~kvbm_backend.pool.base.BlockPool` (G4, or G3 on a host path).
        keys: block keys.
        dst: contiguous tensors of ``pool.layout.bytes_per_block`` bytes each, all on one device.
        chunk_blocks: blocks per ``pool.get`` call; ``threads`` calls run at once.
        timeout_s: per-chunk wait (None: the pool's own timeouts bound it); a late chunk is a miss.
    Returns:
        ``ok[i]`` True only where the pool verified block i (AEAD tag / checksum) and it was copied.
    Raises:
        ValueError: length mismatch or bad ``dst`` tensors; ``chunk_blocks``/``threads`` < 1.
    """
    torch = _torch()
    if len(keys) != len(dst):
        raise ValueError(f"load_via_host: {len(keys)} keys but {len(dst)} destination tensors")
    if chunk_blocks < 1 or threads < 1:
        raise ValueError(f"chunk_blocks and threads must be >= 1, got {chunk_blocks}, {threads}")
    n = len(keys)
    if n == 0:
        return []
    bpb = pool.layout.bytes_per_block
    device = dst[0].device
    _check_dst(dst, bpb, device)
    host = _host_staging(n, bpb, device)
    host_np = host.numpy()
    ok = [False] * n
    chunks = [(s, min(n, s + chunk_blocks)) for s in range(0, n, chunk_blocks)]
    with ThreadPoolExecutor(max_workers=min(threads, len(chunks)), thread_name_prefix="kvbm-host-load") as ex:
        futs = [(a, b, ex.submit(lambda a=a, b=b: pool.get(list(keys[a:b]), [host_np[r] for r in range(a, b)])
                                 .result(timeout=timeout_s))) for a, b in chunks]
        for a, b, f in futs:
            try:
                res = f.result()
            except Exception:  # noqa: BLE001 - storage trouble or late: misses
                continue
            for r, good in zip(range(a, b), res.ok):
                ok[r] = bool(good)
    if not any(ok):
        return ok
    if device.type == "cuda":
        dev_stage = host.to(device, non_blocking=True)  # the one H2D copy
        for r in range(n):
            if ok[r]:
                _u8(dst[r]).copy_(dev_stage[r], non_blocking=True)
        torch.cuda.current_stream(device).synchronize()
    else:
        for r in range(n):
            if ok[r]:
                _u8(dst[r]).copy_(host[r])
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
    _check_dst(src, nbytes, device)
    host = _host_staging(len(src), nbytes, device)
    for r, t in enumerate(src):
        host[r].copy_(_u8(t), non_blocking=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    arr = host.numpy()
    return [arr[r] for r in range(len(src))]
