"""The device checksum (``frame.device_checksum``) of a payload from sums over its byte ranges, so a payload
that lands in pieces (a layer-wise load: one group of layers at a time) is verified as the pieces land and
only a few numbers per piece are combined at the end.

The checksum is ``sum((i + 1) * w[i]) mod 2**64`` over the payload's little-endian u32 words ``w``. For a
range of words starting at word ``b``, ``sum_j (b + j + 1) * w[b + j] = S1 + b * S0`` with ``S1`` the
range's own checksum (``sum_j (j + 1) * w[b + j]``) and ``S0`` its plain word sum, so the payload's
checksum is the sum over its ranges of ``S1 + b * S0`` (mod 2**64).

:func:`range_sums` computes, where the words live (CUDA or CPU; no device-to-host sync), five int64 numbers
per range: ``S1`` as the 32-bit limbs of :mod:`kvbm_backend.gpu.checksum` (never overflowing; the fused
Triton kernel on CUDA once :func:`~kvbm_backend.gpu.checksum_triton.usable` said so) and ``S0`` (below
2**63 for ranges below 8 GiB). :func:`combine` folds them into checksums on the host in uint64 numpy
(wrapping mod 2**64 by definition).
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np
import numpy.typing as npt

from .checksum import combine_limb_sums, limb_sums_torch

_MAX_WORDS = (1 << 31) - 1


def range_sums(rows: Any, *, fused: bool = True, max_words_per_pass: int = 1 << 24) -> Any:
    """Per row of ``rows`` (a uint8 torch tensor ``[r, nbytes]``, last dim contiguous, ``nbytes`` a multiple
    of 4, 4-byte aligned rows; CPU or CUDA), the int64 ``[r, 5]`` sums ``(S1 limbs x 4, S0)`` of its words,
    on ``rows``' device, enqueued on the current stream (no sync).

    Raises:
        ValueError: bad dtype / shape, a row not a multiple of 4 bytes, misaligned or over 8 GiB.
        RuntimeError: big-endian host.
    """
    import torch
    if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.stride(1) != 1:
        raise ValueError(f"range_sums: need a 2-D uint8 tensor with a contiguous last dim, got {tuple(rows.shape)} "
                         f"{rows.dtype}")
    r, nbytes = rows.shape
    if nbytes % 4 or rows.data_ptr() % 4 or (r > 1 and rows.stride(0) % 4):
        raise ValueError(f"range_sums: rows of {nbytes} bytes (stride {rows.stride(0)}) are not whole aligned u32 words")
    if nbytes // 4 > _MAX_WORDS:
        raise ValueError("range_sums: a range of 8 GiB or more")
    if sys.byteorder != "little":
        raise RuntimeError("range_sums: big-endian hosts are not supported")
    if r == 0 or nbytes == 0:
        return torch.zeros((r, 5), dtype=torch.int64, device=rows.device)
    words = rows.view(torch.int32)  # [r, nw]
    m = 0xFFFFFFFF
    if words.device.type == "cuda" and fused:
        from . import checksum_triton
        from .checksum import device_checksums_torch
        ok, _ = checksum_triton.usable(words.device, lambda b, o, n_: device_checksums_torch(b, o, n_, fused=False))
        if ok:
            s0 = (words.to(torch.int64) & m).sum(1)
            return torch.cat([checksum_triton.limb_sums(words), s0[:, None]], dim=1)
    parts = []
    step = max(1, max_words_per_pass // words.shape[1])
    for r0 in range(0, r, step):
        w = words[r0:r0 + step].to(torch.int64) & m
        parts.append(torch.cat([limb_sums_torch(w), w.sum(1)[:, None]], dim=1))
        del w
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def combine(sums: npt.NDArray[np.int64], base_words: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """The checksums of payloads cut into ranges: ``sums`` ``[k, ..., 5]`` (:func:`range_sums` of range ``i``
    of each payload along the first axis), ``base_words`` ``[k]`` (the word index where range ``i`` starts in
    its payload). Returns uint64 ``[...]``: ``sum_i (S1_i + base_i * S0_i) mod 2**64``, equal to
    ``frame.device_checksum`` of each payload when the ranges cover it."""
    u = np.ascontiguousarray(sums).view(np.uint64)  # every sum is >= 0 and < 2**63: exact
    s1 = combine_limb_sums(u[..., :4]).reshape(u.shape[:-1])
    with np.errstate(over="ignore"):
        b = np.asarray(base_words, dtype=np.uint64).reshape((-1,) + (1,) * (s1.ndim - 1))
        out: npt.NDArray[np.uint64] = (s1 + b * u[..., 4]).sum(axis=0, dtype=np.uint64)
    return out
