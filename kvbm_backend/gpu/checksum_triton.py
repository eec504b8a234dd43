"""The device checksum (``frame.device_checksum``) as one fused Triton kernel for CUDA tensors.

:func:`kvbm_backend.gpu.checksum.device_checksums_torch` in torch ops reads each payload word about
ten times through int64 temporaries (about 40 GB/s of payload on an H100, measured by
``benchmarks/gpu_bench.py``); this kernel reads each word once. Same arithmetic, never overflowing:
a program sums ``lo16(w[i]) * (i + 1)`` and ``hi16(w[i]) * (i + 1)`` over :data:`BLOCK_WORDS` words
(each product < 2**47, each sum < 2**59 in int64); the per-program sums are reduced into 32-bit
limbs by torch exactly as in the torch version.

Used only after :func:`usable` has compared it with the torch version on the device (a Triton or
driver problem makes it unusable, said once in the log, and the torch version is used).
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

BLOCK_WORDS = 4096  # words per program: 4096 * 2**47 < 2**59, no int64 overflow
_state: dict = {}  # device str -> (usable, reason)
_lock = threading.Lock()

try:  # optional: torch's CUDA wheels bring triton; without it the torch ops are used
    import triton
    import triton.language as tl

    @triton.jit
    def _partial_sums(src, out, row_stride, nw, chunks, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < nw
        x = tl.load(src + row.to(tl.int64) * row_stride + offs, mask=mask, other=0)  # int32 words
        idx = (offs + 1).to(tl.int64)
        lo = (x & 0xFFFF).to(tl.int64)  # unsigned 16-bit halves of the little-endian u32 word
        hi = ((x >> 16) & 0xFFFF).to(tl.int64)
        slo = tl.sum(lo * idx, axis=0)  # < 2**59: non-negative, so >> and & split it into exact 32-bit limbs
        shi = tl.sum(hi * idx, axis=0)
        base = (row.to(tl.int64) * chunks + c) * 4
        tl.store(out + base, slo & 0xFFFFFFFF)
        tl.store(out + base + 1, slo >> 32)
        tl.store(out + base + 2, shi & 0xFFFFFFFF)
        tl.store(out + base + 3, shi >> 32)

    IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - no triton, or a broken one
    triton = None
    IMPORT_ERROR = f"{type(e).__name__}: {e}"


def limb_sums(words):
    """int64 ``[n, 4]`` limb sums (lo low/high 32 bits, hi low/high 32 bits) of the payload words
    ``words`` (int32 ``[n, nw]``, last dim contiguous, on a CUDA device or, under
    ``TRITON_INTERPRET=1``, the CPU). Raises RuntimeError without triton."""
    import torch
    if triton is None:
        raise RuntimeError(f"triton unavailable: {IMPORT_ERROR}")
    n, nw = words.shape
    if words.stride(1) != 1:
        raise ValueError("limb_sums: words must be contiguous along the last dimension")
    chunks = triton.cdiv(nw, BLOCK_WORDS)
    # each program stores its sums already split into 32-bit limbs, so one sum over the chunks finishes them
    # (three launches: empty, the kernel, the sum; it was the kernel plus eight elementwise/sum ops and a stack,
    # ~0.2 ms of the loader's thread per pass on an H200 host, benchmarks/loader_profile.py 2026-12-04)
    part = torch.empty((n, chunks, 4), dtype=torch.int64, device=words.device)
    _partial_sums[(n, chunks)](words, part, words.stride(0), nw, chunks, BLOCK=BLOCK_WORDS)
    return part.sum(1)  # each limb < 2**32, at most 2**19 chunks (8 GiB payloads): no int64 overflow


def usable(device, reference) -> tuple[bool, str]:
    """Whether the kernel gives the reference checksums on ``device`` (checked once per device).

    ``reference(blocks, payload_offset, payload_len)`` is the torch-ops version; the check runs both on
    random rows whose payload is not a multiple of :data:`BLOCK_WORDS` words, at a 4-byte offset.
    """
    key = str(device)
    with _lock:
        if key in _state:
            return _state[key]
        if triton is None:
            _state[key] = (False, f"triton unavailable: {IMPORT_ERROR}")
        else:
            import torch
            try:
                g = torch.Generator(device=device).manual_seed(7)
                t = torch.randint(0, 256, (3, 4 + 3 * BLOCK_WORDS * 4 + 12), dtype=torch.uint8, device=device,
                                  generator=g)
                plen = 3 * BLOCK_WORDS * 4 + 8
                words = t[:, 4:4 + plen].view(torch.int32)
                got = limb_sums(words).cpu().tolist()
                from .checksum import _combine
                got = [_combine(*s) for s in got]
                want = reference(t, 4, plen)
                _state[key] = (True, "triton kernel verified") if got == want else \
                    (False, "triton kernel gave checksums that differ from the torch version")
            except Exception as e:  # noqa: BLE001 - any failure: use the torch version
                _state[key] = (False, f"triton kernel failed: {type(e).__name__}: {e}")
        ok, why = _state[key]
        (log.info if ok else log.warning)("device checksum on %s: %s", key,
                                          "fused triton kernel" if ok else f"torch ops ({why})")
        return _state[key]
