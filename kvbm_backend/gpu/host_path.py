"""Host-staged device loads: G4 blocks decrypted on the host, then one host-to-device copy. (Device saves stage
into pinned memory in the connector: :mod:`kvbm_backend.integrations.vllm.offloads`.)

G4 blocks are sealed with AES-256-GCM (docs/invariants.md #5); the tag is verified on the host where
the plaintext lands, so for G4 "verified where the bytes land" means the host staging buffer. The pool
works on many blocks at once (the AEAD work in ``cryptography`` and xxh3 release the GIL), each straight
into its row of one pinned staging tensor; each verified row goes to the device as soon as it verified,
overlapping the reads and decryption of the others. ``G4Pool.get`` runs this for torch-tensor
destinations; ``python -m kvbm_backend.apps.bench.g4_load`` measures the host side.
"""
from __future__ import annotations

import queue
import time
from typing import Sequence

import numpy as np

from ..model.namespace import BlockKey
from .rows import BlockRows
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
    """Raise ValueError naming the first tensor of ``dst`` (a list of tensors, or one ``[n, nbytes]``
    matrix) that is not a contiguous ``nbytes``-byte tensor on ``device``'s type."""
    BlockRows(dst, nbytes, _torch().device(device).type)  # the type only: cuda matches any CUDA index


def load_via_host(pool, keys: Sequence[BlockKey], dst: Sequence, *, timeout_s: float | None = None) -> list[bool]:
    """Load blocks through the host into device (or CPU) tensors.

    With a pool that stages (G4: ``pool.get_staged``), each block is read straight into its row of one
    pinned staging buffer and decrypted / checked there on the pool's I/O threads (``g4.max_inflight`` at
    once; AES-GCM and xxh3 release the GIL), and each row that verified is copied to its ``dst`` tensor at
    once (``non_blocking`` on a side stream, issued from this thread), so the host-to-device copies run
    while later blocks are still being read and opened. Other pools: one ``pool.get`` into the staging,
    then the verified rows. Either way only verified rows are ever copied.

    Args:
        pool: a :class:`~kvbm_backend.pool.base.BlockPool` taking numpy buffers (G4; G3 on a host path).
        keys: block keys.
        dst: one ``[n, pool.layout.bytes_per_block]``-byte tensor (row i: block i), or contiguous tensors of
            that many bytes each, all on one device (:class:`~.rows.BlockRows`).
        timeout_s: wait for the pool's answer (None: the pool's own timeouts bound it); late = misses.
    Returns:
        ``ok[i]`` True only where the pool verified block i (AEAD tag / checksum) and it was copied;
        ``dst[i]`` is untouched where False.
    Raises:
        ValueError: length mismatch or bad ``dst`` tensors.
    """
    if len(keys) != len(dst):
        raise ValueError(f"load_via_host: {len(keys)} keys but {len(dst)} destination tensors")
    n = len(keys)
    if n == 0:
        return []
    bpb = pool.layout.bytes_per_block
    rows_dst = dst if isinstance(dst, BlockRows) else BlockRows(dst, bpb)
    device = rows_dst.device
    buf, host = _host_staging(n, bpb, device)
    host_np = host.numpy()
    rows = [host_np[r] for r in range(n)]
    if getattr(pool, "get_staged", None) is not None:
        return _load_staged(pool, keys, rows_dst, buf, host, rows, device, timeout_s)
    try:
        res = pool.get(list(keys), rows).result(timeout=timeout_s)
        ok = [bool(x) for x in res.ok] + [False] * (n - len(res.ok))
    except Exception:  # noqa: BLE001 - storage trouble or late: misses (the pool logged and counted)
        return [False] * n  # the staging is not given back: a late read may still write into it
    copier = _Copier(host, rows_dst, device)
    copier.copy_rows([r for r in range(n) if ok[r]])
    copier.finish()
    _give_staging(buf, device)  # the pool's get is done and the copies are synchronised
    return ok


class _Copier:
    """Copies verified staging rows to their ``dst`` rows (:class:`~.rows.BlockRows`): on a side CUDA stream,
    ``non_blocking`` (from pinned rows), one copy per run of consecutive rows; plain copies on the CPU.
    :meth:`finish` waits for them."""

    def __init__(self, host, dst: BlockRows, device):
        self.host, self.dst, self.cuda = host, dst, device.type == "cuda"
        if self.cuda:
            torch = _torch()
            self.stream = torch.cuda.Stream(device)
            self.stream.wait_stream(torch.cuda.current_stream(device))  # dst may be in use on the compute stream

    def copy(self, r: int) -> None:
        self.copy_rows((r,))

    def copy_rows(self, rows: Sequence[int]) -> None:
        """Copy staging rows ``rows`` to the same ``dst`` rows, all under one stream context."""
        rows = sorted(rows)
        if self.cuda:
            with _torch().cuda.stream(self.stream):
                self.dst.copy_in(rows, self.host, rows, non_blocking=True)
        else:
            self.dst.copy_in(rows, self.host, rows)

    def finish(self) -> None:
        if self.cuda:
            self.stream.synchronize()


def _load_staged(pool, keys, dst, buf, host, rows, device, timeout_s) -> list[bool]:
    """:func:`load_via_host` over ``pool.get_staged``: rows copied as their blocks verify."""
    n = len(keys)
    hits: queue.SimpleQueue = queue.SimpleQueue()
    batch = pool.get_staged(list(keys), rows, on_hit=hits.put)
    copier = _Copier(host, dst, device)
    copied = [False] * n
    end = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not batch.future.done():
            try:
                r = hits.get(timeout=0.05 if end is None else max(0.0, min(0.05, end - time.monotonic())))
            except queue.Empty:
                if end is not None and time.monotonic() >= end:
                    break
                continue
            rows_now = [r]  # and every row that verified meanwhile: one wake-up and stream context for all
            while True:
                try:
                    rows_now.append(hits.get_nowait())
                except queue.Empty:
                    break
            copier.copy_rows(rows_now)
            for r in rows_now:
                copied[r] = True
        res = batch.future.result(timeout=0 if end is None else max(0.0, end - time.monotonic()))
        ok = [bool(x) for x in res.ok] + [False] * (n - len(res.ok))
    except Exception:  # noqa: BLE001 - late or storage trouble: what verified in time and was copied counts
        ok = list(copied)
    while True:  # hits that came with the batch's end
        try:
            r = hits.get_nowait()
        except queue.Empty:
            break
        if ok[r] and not copied[r]:
            copier.copy(r)
            copied[r] = True
    ok = [a and c for a, c in zip(ok, copied)]
    copier.finish()
    if batch.idle.is_set():  # no I/O thread writes a row any more: the staging can be reused
        _give_staging(buf, device)
    return ok
