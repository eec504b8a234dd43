""":func:`kvbm_backend.model.frame.device_checksum` re-implemented with torch integer ops, so a block
read straight into HBM is verified where it landed (the payload never comes back to the host).

The checksum (format in ``docs/format.md``, reference implementation in ``model/frame.py``) is
``sum((i + 1) * w[i]) mod 2**64`` over the payload's little-endian u32 words ``w`` (a trailing
partial word zero-padded). A straight int64 product would overflow, and signed overflow is not a
defined result in torch's C++ kernels, so this version never overflows: each word is split into
16-bit halves, products ``half * (i + 1)`` (< 2**47) are summed in chunks of :data:`CHUNK_WORDS`
words (< 2**62 per chunk), chunk sums are split into 32-bit limbs and summed again (exact while
there are fewer than 2**31 chunks). Four int64 numbers per block come back to the host and are
combined there mod 2**64. Exact for payloads below 8 GiB (indices below 2**31).
"""
from __future__ import annotations

import sys
from typing import Sequence

import numpy as np
import numpy.typing as npt

CHUNK_WORDS = 1 << 15  # 2**15 words * 2**47 < 2**62: a chunk sum fits int64 exactly
_MAX_WORDS = (1 << 31) - 1
_MASK64 = (1 << 64) - 1


def _torch():
    import torch
    return torch


def _words_u32_as_i64(t):
    """1-D int64 tensor of the payload's little-endian u32 words (zero-padded trailing word)."""
    torch = _torch()
    if sys.byteorder != "little":
        raise RuntimeError("device_checksum_torch: big-endian hosts are not supported")
    b = t.reshape(-1)
    if b.dtype != torch.uint8:
        b = b.contiguous().view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
    b = b.contiguous()
    if b.data_ptr() % 4:
        b = b.clone()  # .view(int32) needs 4-byte alignment
    return b.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _combine(l0: int, l1: int, h0: int, h1: int) -> int:
    """One payload's checksum from its four limb sums (:func:`combine_limb_sums` for one row)."""
    return int(combine_limb_sums(np.array([[l0, l1, h0, h1]], dtype=np.int64))[0])


def device_checksum_torch(tensor) -> int:
    """``frame.device_checksum`` of the bytes of ``tensor``, computed where the tensor lives.

    Args:
        tensor: any contiguous torch tensor (CPU or CUDA); its raw bytes are the payload
            (``numel * element_size`` bytes, in memory order).
    Returns:
        The checksum, an int in ``[0, 2**64)``, equal to ``frame.device_checksum(bytes)``.
    Raises:
        ValueError: payload of 8 GiB or more. RuntimeError: big-endian host.
    """
    if not tensor.is_contiguous():
        raise ValueError("device_checksum_torch: tensor must be contiguous (its bytes are the payload)")
    if tensor.numel() == 0:
        return 0
    words = _words_u32_as_i64(tensor)
    if words.numel() > _MAX_WORDS:
        raise ValueError(f"device_checksum_torch: payload of {words.numel() * 4} bytes is over the 8 GiB limit")
    return int(combine_limb_sums(limb_sums_torch(words.view(1, -1)).cpu().numpy())[0])


def device_checksums_torch(blocks, payload_offset: int, payload_len: int,
                           max_words_per_pass: int = 1 << 24, fused: bool = True) -> list[int]:
    """Checksums of ``payload_len`` bytes at ``payload_offset`` in each row of a 2-D uint8 tensor.

    Used to verify a batch of frames read into one device staging buffer with a single device-to-host
    sync for the whole batch (4 int64 per row come back), however many slices bound the temporaries.
    :func:`device_limb_sums` is the same without the sync (the caller fetches the sums when it wants).

    Args:
        blocks: uint8 tensor ``[n, row_bytes]`` (CPU or CUDA), contiguous.
        payload_offset: bytes into each row where the payload starts (multiple of 4).
        payload_len: payload bytes per row (multiple of 4).
        max_words_per_pass: bounds the int64 temporaries (about 48 bytes of device memory per word).
        fused: on CUDA, use the one-pass Triton kernel (:mod:`kvbm_backend.gpu.checksum_triton`) once it
            has been checked against these torch ops on the device; False: always the torch ops.
    Returns:
        one checksum per row.
    Raises:
        ValueError: bad shape, dtype, or offsets not multiples of 4.
    """
    sums = device_limb_sums(blocks, payload_offset, payload_len, max_words_per_pass, fused)
    return [int(x) for x in combine_limb_sums(sums.cpu().numpy())]  # the one device-to-host sync


def combine_limb_sums(sums: "npt.NDArray[np.int64] | npt.NDArray[np.uint64]") -> "npt.NDArray[np.uint64]":
    """The checksums (``uint64 [n]``) of :func:`device_limb_sums`'s ``int64 [n, 4]`` limb sums, brought
    to the host: ``(l0 + l1 * 2**32 + (h0 + h1 * 2**32) * 2**16) mod 2**64``, in wrapping uint64
    arithmetic (the same numbers as the per-row ``_combine``)."""
    u = np.ascontiguousarray(sums).astype(np.uint64).reshape(-1, 4)
    with np.errstate(over="ignore"):
        out: npt.NDArray[np.uint64] = (u[:, 0] + (u[:, 1] << np.uint64(32)) + (u[:, 2] << np.uint64(16))
                                       + (u[:, 3] << np.uint64(48)))
    return out


def device_limb_sums(blocks, payload_offset: int, payload_len: int,
                     max_words_per_pass: int = 1 << 24, fused: bool = True):
    """The checksums of :func:`device_checksums_torch` as ``int64 [n, 4]`` limb sums on ``blocks``'s
    device, queued on the current stream without waiting for them (the one exception: the first use
    of the fused kernel on a device checks it against the torch ops once). Fetch them with a
    non-blocking copy to pinned memory and :func:`combine_limb_sums` once an event says they are done.
    Arguments and errors as :func:`device_checksums_torch`."""
    torch = _torch()
    if blocks.dim() != 2 or blocks.dtype != torch.uint8:
        raise ValueError(f"device_checksums_torch: need a 2-D uint8 tensor, got {tuple(blocks.shape)} {blocks.dtype}")
    if payload_offset % 4 or payload_len % 4:
        raise ValueError(f"device_checksums_torch: payload_offset {payload_offset} and payload_len {payload_len} "
                         "must be multiples of 4 bytes")
    n, row = blocks.shape
    if payload_offset + payload_len > row:
        raise ValueError(f"device_checksums_torch: payload [{payload_offset}, {payload_offset + payload_len}) "
                         f"exceeds row of {row} bytes")
    nw = payload_len // 4
    if nw > _MAX_WORDS:
        raise ValueError("device_checksums_torch: payload of 8 GiB or more")
    if n == 0 or nw == 0:
        return torch.zeros((n, 4), dtype=torch.int64, device=blocks.device)
    if sys.byteorder != "little":
        raise RuntimeError("device_checksums_torch: big-endian hosts are not supported")
    pay = blocks[:, payload_offset:payload_offset + payload_len]
    if pay.data_ptr() % 4 or (row % 4):
        pay = pay.contiguous().clone()
    if pay.device.type == "cuda" and fused:
        from . import checksum_triton
        ok, _ = checksum_triton.usable(pay.device, lambda b, o, n_: device_checksums_torch(b, o, n_, fused=False))
        if ok:
            return checksum_triton.limb_sums(pay.view(torch.int32))
    parts = []
    rows_per_pass = max(1, max_words_per_pass // nw)
    for r0 in range(0, n, rows_per_pass):
        # [r, nw] int64 words (last dim contiguous: no copy before)
        parts.append(limb_sums_torch(pay[r0:r0 + rows_per_pass].view(torch.int32).to(torch.int64) & 0xFFFFFFFF))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def limb_sums_torch(w):
    """int64 ``[r, 4]`` limb sums of ``sum((j + 1) * w[:, j])`` for int64 words ``w`` ``[r, nw]`` (values in
    ``[0, 2**32)``), in torch ops on ``w``'s device: chunks of :data:`CHUNK_WORDS` words (the last one shorter),
    each chunk sum below 2**62, split into 32-bit limbs and summed again (the never-overflowing scheme of the
    module doc).

    The tail is its own shorter chunk: padding it to a whole chunk (before 2026-12-04) made a row of 512 words
    (a 2 KiB payload) cost 32,768, and the CPU check of a 2,048-block load of such blocks took 1.09 s of
    1.24 (2-core VM, ``benchmarks/loader_profile.py``)."""
    torch = _torch()
    m = 0xFFFFFFFF
    r, nw = w.shape
    idx = torch.arange(1, nw + 1, dtype=torch.int64, device=w.device)
    full = nw - nw % CHUNK_WORDS
    los, his = [], []
    if full:
        wf = w[:, :full].reshape(r, -1, CHUNK_WORDS)
        i = idx[:full].view(1, -1, CHUNK_WORDS)
        los.append(((wf & 0xFFFF) * i).sum(dim=2))  # [r, chunks]
        his.append(((wf >> 16) * i).sum(dim=2))
    if full < nw:  # the tail: fewer than CHUNK_WORDS words, so its sums stay below 2**62 as well
        wt, it = w[:, full:], idx[full:]
        los.append(((wt & 0xFFFF) * it).sum(dim=1, keepdim=True))
        his.append(((wt >> 16) * it).sum(dim=1, keepdim=True))
    lo = los[0] if len(los) == 1 else torch.cat(los, dim=1)
    hi = his[0] if len(his) == 1 else torch.cat(his, dim=1)
    return torch.stack([(lo & m).sum(1), (lo >> 32).sum(1), (hi & m).sum(1), (hi >> 32).sum(1)], dim=1)


def checksums_match(blocks, payload_offset: int, payload_len: int, expected: Sequence[int]) -> list[bool]:
    """``device_checksums_torch(...)[i] == expected[i]`` for each row."""
    got = device_checksums_torch(blocks, payload_offset, payload_len)
    if len(got) != len(expected):
        raise ValueError(f"checksums_match: {len(got)} rows, {len(expected)} expected values")
    return [g == (e & _MASK64) for g, e in zip(got, expected)]
