"""Blocks moved between a load's staging and an engine's per-layer KV tensors with one Triton kernel launch.

vLLM keeps one KV tensor per attention layer (:mod:`kvbm_backend.integrations.vllm.kv_io`), so a scatter of
``n`` KVBM blocks in torch ops is one ``index_copy_`` per layer (a gather, one ``index_select``): 32 ops
for Llama-3.1-8B. Each torch op gives the GIL up and takes it back several times (the op, the views it
needs, the tensors it frees), about 240 ``take_gil`` per 64-block scatter on the 2-core dev VM (perf
uprobe, ``benchmarks/gil_handoffs.py``'s method). Beside an engine whose step loop runs Python each of
those waits up to the switch interval (docs/gpu.md, "Loads beside a busy engine"), and a load of a few
hundred blocks pays it once more per load. Here the whole move is one launch, whatever the layer count,
reaching each layer's tensor through a device table of base addresses (the pattern of Triton's
grouped-GEMM tutorial).

A KVBM block's layer is FullyContiguous ``[outer, page, heads, head_dim]`` (outer 2: K, V; 1 for MLA). The
engine's layer tensor is described by the strides of its ``(block, outer, token, head)`` dimensions, head_dim
contiguous (:class:`Pieces`): program ``(q, c)`` copies words ``[c * BLOCK, (c + 1) * BLOCK)`` of piece ``q``
(block ``i``, layer ``l``, outer ``o``: ``page * heads * head_dim`` elements, contiguous in the staging), word
``w`` of it (token ``w // (heads * run)``, head ``w // run % heads``, word ``w % run`` of the head) going to
``base[l] + b * block_stride + o * piece_stride + token * token_stride + head * head_stride + word``. Every
layout :mod:`~kvbm_backend.integrations.vllm.kv_io` reads is such a tensor, whatever its stride order:

* ``packed`` (vLLM 0.32's GPU caches, logical ``[num_blocks, heads, page, 2 * head_dim]`` in the stride order of
  ``KVCacheLayout``: NHD/LBNHC by default, HND, block-major BLNHC slices): K of a (token, head) is one run of
  ``head_dim`` elements with V right after it, ``piece_stride = head_dim``;
* ``kv_first`` ``[2, num_blocks, page, heads, head_dim]``, ``block_first`` ``[num_blocks, 2, page, heads,
  head_dim]``, ``mla`` ``[num_blocks, (1,) page, dim]`` and vLLM's CPU backend (``[heads, 2, page, head_dim]``
  per block; runs only under the interpreter: the kernel runs on CUDA).

Requires 4-byte words: ``head_dim * element_size`` and every stride in bytes divisible by 4, 4-byte aligned
tensors, and one stride set for all layers (else the torch ops run, :func:`plan` says why). ``heads`` and
``run`` are compile-time constants (one compile per engine geometry; the index arithmetic is then
multiply-shift, beside a copy bound by memory).

Used only after :func:`check` has compared it with the torch ops on scratch tensors of the engine's
geometry and stride order on that device (a Triton, driver or geometry problem is said once in the log and
the torch ops are used). Engine block ids are checked on the host before a launch (a kernel does not
bounds-check: an id out of range raises ``IndexError`` as ``index_copy_`` would). Runs on CUDA tensors, and on
CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``: the tests).
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

    # the sizes and strides differ between the check's scratch tensors and the engine: not specialised on
    # their values (divisibility), so the check compiles the kernel the loads and saves then use (no compile
    # in vLLM's thread); HW and RW (the geometry) are the same in both
    @triton.jit(do_not_specialize=["LO", "O", "P", "BPB", "LB", "SB", "SO", "ST", "SH", "NB"])
    def _move(staging, ptrs, idx, LO, O, P, BPB, LB, SB, SO, ST, SH, NB, TO_ENGINE: tl.constexpr,
              HW: tl.constexpr, RW: tl.constexpr, BLOCK: tl.constexpr):
        q = tl.program_id(0).to(tl.int64)
        i = q // LO  # block of the staging
        r = q % LO
        lay = r // O  # layer
        o = r % O  # outer (K / V) of the layer
        b = tl.load(idx + i)  # engine block id (int64)
        base = tl.load(ptrs + lay).to(tl.pointer_type(tl.int32))  # the layer tensor's address
        w = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # word of the piece (int32: a piece is < 8 GiB)
        lim = tl.where((b >= 0) & (b < NB), P, 0)  # an id out of range moves nothing (callers check first)
        mask = w < lim
        tok = (w // HW).to(tl.int64)
        head = (w % HW // RW).to(tl.int64)
        s = staging + i * BPB + lay * LB + o * P + w
        d = base + b * SB + o * SO + tok * ST + head * SH + w % RW
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
    """Where each layer of a staged block goes (bytes throughout). A staged layer is ``pieces`` pieces
    (outer: K, V) of ``piece`` bytes, each ``page`` tokens of ``heads`` runs of ``run`` bytes (one head's
    head_dim); byte ``x`` of head ``h`` of token ``t`` of piece ``o`` of engine block ``b`` of layer ``l`` is at
    ``address[l] + b * block_stride + o * piece_stride + t * token_stride + h * head_stride + x``.
    ``block_bytes`` / ``layer_bytes``: a KVBM block and one of its layers; ``num_blocks``: engine blocks per
    tensor."""
    pieces: int
    piece: int
    heads: int
    run: int
    block_stride: int
    piece_stride: int
    token_stride: int
    head_stride: int
    block_bytes: int
    layer_bytes: int
    num_blocks: int


def plan(views: Sequence[torch.Tensor], dims: str, block_bytes: int) -> tuple[Pieces | None, str]:
    """The :class:`Pieces` of an engine's layer tensors, or None and why the torch ops must run (a head_dim
    that is not contiguous, strides or tensors not in 4-byte words, layers with different strides, no CUDA
    device, triton absent).

    ``views``: one per layer, as moved (``uint8`` views of FP8), viewed so that ``dims`` names each dimension:
    ``b`` engine block, ``o`` outer (K/V; absent for MLA), ``t`` token of the page, ``h`` KV head (absent: 1),
    ``d`` head_dim, e.g. ``"bhtod"`` for vLLM 0.32's packed caches viewed ``[nb, heads, page, 2, head_dim]``."""
    if triton is None:
        return None, f"triton unavailable: {IMPORT_ERROR}"
    t0 = views[0]
    if t0.device.type != "cuda" and not interpreting():
        return None, f"device {t0.device}: the kernel runs on CUDA"
    if len(dims) != t0.dim() or not set("btd") <= set(dims):
        raise ValueError(f"dims {dims!r} do not name the {t0.dim()} dimensions of a layer tensor")
    size, es = dict(zip(dims, t0.shape)), t0.element_size()
    stride = {k: s * es for k, s in zip(dims, t0.stride())}  # bytes
    if stride["d"] != es:
        return None, "a layer tensor's head_dim is not contiguous"
    for t in views:
        if t.stride() != t0.stride() or tuple(t.shape) != tuple(t0.shape) or t.data_ptr() % 4:
            return None, "layer tensors differ in strides, or one is not 4-byte aligned"
    run, heads, O = size["d"] * es, size.get("h", 1), size.get("o", 1)
    layer = block_bytes // len(views)
    p = Pieces(O, size["t"] * heads * run, heads, run, stride["b"], stride.get("o", 0), stride["t"],
               stride.get("h", 0), block_bytes, layer, size["b"])
    if run % 4 or any(v % 4 for k, v in stride.items() if k != "d"):
        return None, f"head_dim of {run} bytes or strides {tuple(stride.values())} bytes are not in 4-byte words"
    if O * p.piece != layer:
        return None, f"layer of {layer} bytes is not the {tuple(t0.shape)} tensor's block ({O * p.piece} bytes)"
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
                p.block_stride // 4, p.piece_stride // 4, p.token_stride // 4, p.head_stride // 4, p.num_blocks,
                TO_ENGINE=to_engine, HW=p.heads * p.run // 4, RW=p.run // 4, BLOCK=BLOCK_WORDS)


def check_ids(ids: Sequence[int], num_blocks: int) -> None:
    """Raise IndexError for an engine block id outside ``[0, num_blocks)`` (the kernel does not check)."""
    if ids and (min(ids) < 0 or max(ids) >= num_blocks):
        bad = next(b for b in ids if not 0 <= b < num_blocks)
        raise IndexError(f"engine block id {bad} out of range [0, {num_blocks})")


def check(dims: str, block_bytes: int, scratch: Callable[[int], list[torch.Tensor]],
          views: Callable[[list[torch.Tensor]], list[torch.Tensor]],
          reference: Callable[[list[torch.Tensor], torch.Tensor, list[int], bool], None]) -> tuple[bool, str]:
    """Compare the kernel with the torch ops on scratch layer tensors of the engine's geometry.

    ``scratch(num_blocks)`` makes zeroed layer tensors (as moved) like the engine's, in its stride order, with
    ``num_blocks`` blocks; ``views(tensors)`` views them as :func:`plan` takes them (``dims``);
    ``reference(tensors, staging, ids, to_engine)`` moves with the torch ops. Both directions run on random
    bytes with ids out of order; returns ``(usable, reason)``. Synchronises the device (once per engine:
    :class:`~kvbm_backend.integrations.vllm.kv_io.EngineKv` keeps the answer)."""
    import torch
    from .rows import device_index
    try:
        nb, ids = 4, [3, 0, 2]
        a, b = scratch(nb), scratch(nb)
        sp, why = plan(views(b), dims, block_bytes)
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
