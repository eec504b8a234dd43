"""Blocks moved between a load's staging and an engine's per-layer KV tensors with one Triton kernel launch.

vLLM keeps one KV tensor per attention layer (:mod:`kvbm_backend.integrations.vllm.kv_io`), so a scatter of
``n`` KVBM blocks in torch ops is one ``index_copy_`` per layer (a gather, one ``index_select``): 32 ops
for Llama-3.1-8B. Each torch op gives the GIL up and takes it back several times (the op, the views it
needs, the tensors it frees), about 240 ``take_gil`` per 64-block scatter on the 2-core dev VM (perf
uprobe, ``benchmarks/gil_handoffs.py``'s method). Beside an engine whose step loop runs Python each of
those waits up to the switch interval (docs/gpu.md, "Loads beside a busy engine"), and a load of a few
hundred blocks pays it once more per load. Here the whole move is one launch, whatever the layer count:
program ``(q, c)`` copies words ``[c * BLOCK, (c + 1) * BLOCK)`` of piece ``q`` (block ``i``, layer ``l``,
piece ``o``), the layer's tensor reached through a device table of base addresses (the pattern of
Triton's grouped-GEMM tutorial).

Where a KVBM block's layer (FullyContiguous ``[outer, page, inner]``) lies in the engine (contiguous
tensors only; anything else uses the torch ops):

* ``kv_first`` ``[2, num_blocks, page, heads, head_dim]``: two pieces of ``page * inner`` elements, K at
  ``base + b * P`` and V at ``base + (num_blocks + b) * P``;
* ``block_first`` ``[num_blocks, 2, page, heads, head_dim]`` and ``mla`` ``[num_blocks, (1,) page, dim]``:
  one piece, the whole layer, at ``base + b * layer_bytes``;
* ``cpu`` (vLLM's CPU backend interleaves K and V per head): never; the torch ops run.

Used only after :func:`check` has compared it with the torch ops on scratch tensors of the engine's
geometry on that device (a Triton, driver or geometry problem is said once in the log and the torch
ops are used). Engine block ids are checked on the host before a launch (a kernel does not bounds-check:
an id out of range raises ``IndexError`` as ``index_copy_`` would). Runs on CUDA tensors, and on CPU
tensors under Triton's interpreter (``TRITON_INTERPRET=1``: the tests).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

BLOCK_WORDS = 1024  # 4-byte words per program (4 KiB)

try:  # optional: torch's CUDA wheels bring triton; without it the torch ops are used
    import triton
    import triton.language as tl

    # the sizes differ between the check's scratch tensors and the engine: not specialised on their values
    # (divisibility), so the check compiles the kernel the loads and saves then use (no compile in vLLM's thread)
    @triton.jit(do_not_specialize=["LO", "O", "P", "BPB", "LB", "BSTRIDE", "OSTRIDE", "NB"])
    def _move(staging, ptrs, idx, LO, O, P, BPB, LB, BSTRIDE, OSTRIDE, NB, TO_ENGINE: tl.constexpr,
              BLOCK: tl.constexpr):
        q = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64)
        i = q // LO  # block of the staging
        r = q % LO
        lay = r // O  # layer
        o = r % O  # piece of the layer (K / V)
        b = tl.load(idx + i)  # engine block id (int64)
        base = tl.load(ptrs + lay).to(tl.pointer_type(tl.int32))  # the layer tensor's address
        offs = c * BLOCK + tl.arange(0, BLOCK)
        lim = tl.where((b >= 0) & (b < NB), P, 0)  # an id out of range moves nothing (callers check first)
        mask = offs < lim
        s = staging + i * BPB + lay * LB + o * P + offs
        d = base + b * BSTRIDE + o * OSTRIDE + offs
        if TO_ENGINE:
            tl.store(d, tl.load(s, mask=mask), mask=mask)
        else:
            tl.store(s, tl.load(d, mask=mask), mask=mask)

    IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - no triton, or a broken one
    triton = None
    IMPORT_ERROR = f"{type(e).__name__}: {e}"


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class Pieces:
    """Where each layer of a staged block goes: ``pieces`` pieces of ``piece`` bytes per layer, piece ``o``
    of engine block ``b`` of layer ``l`` at ``address[l] + b * block_stride + o * piece_stride`` (bytes).
    ``block_bytes`` / ``layer_bytes``: a KVBM block and one of its layers (bytes); ``num_blocks``: engine
    blocks per tensor."""
    pieces: int
    piece: int
    block_stride: int
    piece_stride: int
    block_bytes: int
    layer_bytes: int
    num_blocks: int


def plan(tensors: Sequence[torch.Tensor], engine_layout: str, block_bytes: int) -> tuple[Pieces | None, str]:
    """The :class:`Pieces` of ``tensors`` (one per layer, as moved: uint8 views of FP8), or None and why the
    torch ops must run (the CPU backend's layout, a non-contiguous or misaligned tensor, triton absent)."""
    if triton is None:
        return None, f"triton unavailable: {IMPORT_ERROR}"
    if engine_layout not in ("kv_first", "block_first", "mla"):
        return None, f"engine layout {engine_layout}: K and V interleave inside a block"
    t0 = tensors[0]
    if t0.device.type != "cuda" and not interpreting():
        return None, f"device {t0.device}: the kernel runs on CUDA"
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() % 4:
            return None, "a layer tensor is not contiguous or not 4-byte aligned"
    L = len(tensors)
    layer = block_bytes // L
    nb = t0.shape[1] if engine_layout == "kv_first" else t0.shape[0]
    if engine_layout == "kv_first":
        p = Pieces(2, layer // 2, layer // 2, nb * (layer // 2), block_bytes, layer, nb)
    else:
        p = Pieces(1, layer, layer, 0, block_bytes, layer, nb)
    if p.piece % 4 or t0.numel() * t0.element_size() != nb * layer:
        return None, f"layer of {layer} bytes does not tile the {tuple(t0.shape)} tensor in 4-byte words"
    return p, "triton kernel"


def move(p: Pieces, ptrs: torch.Tensor, staging: torch.Tensor, idx: torch.Tensor, to_engine: bool,
         row_bytes: int | None = None) -> None:
    """One launch on the current stream: ``len(idx)`` blocks of ``staging`` (uint8, 4-byte aligned, on the
    tensors' device; block ``i`` at ``i * row_bytes`` bytes, default ``p.block_bytes``) into engine blocks
    ``idx`` (``to_engine``), or the reverse. ``ptrs``: int64 ``[layers]`` base addresses on the device (one
    layer's: ``staging`` rows hold that layer only). An id outside ``[0, num_blocks)`` moves nothing: callers
    check ids first (:func:`check_ids`), the mask only keeps memory safe."""
    import torch
    n, L = int(idx.shape[0]), int(ptrs.shape[0])
    if n == 0:
        return
    words = staging.view(torch.int32)
    rb = p.block_bytes if row_bytes is None else row_bytes
    grid = (n * L * p.pieces, triton.cdiv(p.piece // 4, BLOCK_WORDS))
    _move[grid](words, ptrs, idx, L * p.pieces, p.pieces, p.piece // 4, rb // 4, p.layer_bytes // 4,
                p.block_stride // 4, p.piece_stride // 4, p.num_blocks, TO_ENGINE=to_engine, BLOCK=BLOCK_WORDS)


def check_ids(ids: Sequence[int], num_blocks: int) -> None:
    """Raise IndexError for an engine block id outside ``[0, num_blocks)`` (the kernel does not check)."""
    if ids and (min(ids) < 0 or max(ids) >= num_blocks):
        bad = next(b for b in ids if not 0 <= b < num_blocks)
        raise IndexError(f"engine block id {bad} out of range [0, {num_blocks})")


def check(engine_layout: str, block_bytes: int, scratch: Callable[[int], list[torch.Tensor]],
          reference: Callable[[list[torch.Tensor], torch.Tensor, list[int], bool], None]) -> tuple[bool, str]:
    """Compare the kernel with the torch ops on scratch layer tensors of the engine's geometry.

    ``scratch(num_blocks)`` makes zeroed layer tensors (as moved) like the engine's with ``num_blocks``
    blocks; ``reference(tensors, staging, ids, to_engine)`` moves with the torch ops. Both directions run on
    random bytes with ids out of order; returns ``(usable, reason)``. Synchronises the device (once per
    engine: :class:`~kvbm_backend.integrations.vllm.kv_io.EngineKv` keeps the answer)."""
    import torch
    from .rows import device_index
    try:
        nb, ids = 4, [3, 0, 2]
        a, b = scratch(nb), scratch(nb)
        sp, why = plan(b, engine_layout, block_bytes)
        if sp is None:
            return False, why
        dev = a[0].device
        g = torch.Generator(device="cpu").manual_seed(5)
        src = torch.randint(0, 256, (len(ids) * block_bytes,), dtype=torch.uint8, generator=g).to(dev)
        reference(a, src, ids, True)
        move(sp, device_index([t.data_ptr() for t in b], dev), src, device_index(ids, dev), True)
        if not all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b)):  # bytes: NaNs
            return False, "triton kernel wrote engine blocks that differ from the torch ops"
        got, want = torch.zeros_like(src), torch.zeros_like(src)
        reference(a, want, ids[::-1], False)
        move(sp, device_index([t.data_ptr() for t in a], dev), got, device_index(ids[::-1], dev), False)
        if not torch.equal(got, want):
            return False, "triton kernel gathered bytes that differ from the torch ops"
        return True, "triton kernel verified"
    except Exception as e:  # noqa: BLE001 - any failure: the torch ops run
        return False, f"triton kernel failed: {type(e).__name__}: {e}"
