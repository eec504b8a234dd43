"""Destination rows of device loads: the torch form of ``get(keys, out)`` (:mod:`kvbm_backend.pool.base`).

``out`` is either a list of block tensors, or **one** tensor ``[n, bytes_per_block]`` (any dtype, rows
contiguous, e.g. a slice of rows of the connector's load staging) whose row ``i`` is block ``i``'s
destination. Loads should pass the matrix: verified rows are then copied by runs of consecutive rows, one
``copy_`` per run, and no per-block tensor object is ever made.

Why it matters: every torch op called from Python gives the GIL up while it runs, and every tensor view
made or freed takes it back (torch 2.13 on the CPU: a ``view`` is three GIL hand-offs, freeing a view one;
counted with a ``perf`` uprobe on CPython's ``take_gil``). With the engine's step loop running Python in
the same process, each hand-off waits up to the interpreter's switch interval
(``load_gil_switch_ms``, docs/gpu.md "Loads beside a busy engine"), so per-block tensor objects, not bytes,
set a busy worker's load rate. Connector G3 loads on the 2-core dev VM (host mode, 2 MiB blocks,
``python benchmarks/gil_handoffs.py``): 16.3 hand-offs per block with a list of rows and reads in key order,
3.7 with the matrix and reads in file order (:func:`kvbm_backend.transfer.file_order`); what is left is
each block's xxh3 and its share of the reads (``benchmarks/results/gil_handoffs-cpu-2026-11-26.json``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:
    import torch


def is_matrix(out: object) -> bool:
    """True when ``out`` is one torch tensor (the ``[n, bytes_per_block]`` form), without importing torch."""
    return type(out).__module__.startswith("torch") and hasattr(out, "dim")


#: a matrix copy-out of more runs than this is one ``index_copy_`` instead of a copy per run
MAX_RUN_COPIES = 4


def runs(dst_rows: Sequence[int], src_rows: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(dst0, src0, length)`` for each maximal run where both ``dst_rows`` and ``src_rows`` go up by one,
    in order (``dst_rows[i]`` receives ``src_rows[i]``)."""
    n = len(dst_rows)
    i = 0
    while i < n:
        j = i + 1
        while j < n and dst_rows[j] == dst_rows[j - 1] + 1 and src_rows[j] == src_rows[j - 1] + 1:
            j += 1
        yield dst_rows[i], src_rows[i], j - i
        i = j


class BlockRows:
    """The destinations of one device load: a ``[n, nbytes]`` matrix or a list of ``n`` tensors.

    Args:
        out: the matrix (any dtype whose rows are ``nbytes`` bytes, each row contiguous) or a sequence of
            contiguous ``nbytes``-byte tensors, all on one device.
        nbytes: bytes per block (``layout.bytes_per_block``).
        device: the device every destination must be on (None: the first one's); ``cuda`` without an
            index matches any CUDA device's tensors.
    Raises:
        ValueError: a destination of the wrong size, device or layout, named by its index.
    """

    def __init__(self, out: Any, nbytes: int, device: Any = None) -> None:
        import torch
        self.nbytes = nbytes
        self.mat: torch.Tensor | None = None
        self.items: list[torch.Tensor] | None = None
        if is_matrix(out):
            t = out
            if t.dim() != 2 or t.shape[1] * t.element_size() != nbytes or t.stride(1) != 1:
                raise ValueError(f"out: need a [n, {nbytes}-byte rows] tensor with contiguous rows, got shape "
                                 f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")
            self.mat = t if t.dtype == torch.uint8 else t.view(torch.uint8)
            self.device = t.device
        else:
            self.items = list(out)
            self.device = self.items[0].device if self.items else torch.device("cpu")
        want = torch.device(device) if device is not None else self.device
        self._check(want)

    def __len__(self) -> int:
        return self.mat.shape[0] if self.mat is not None else len(self.items or ())

    def _check(self, want: torch.device) -> None:
        def same(d: torch.device) -> bool:
            return d == want or (d.type == want.type == "cuda" and (want.index is None or d.index is None))
        if self.mat is not None:
            if not same(self.mat.device):
                raise ValueError(f"out: on {self.mat.device}, loader stages on {want}")
            return
        for i, t in enumerate(self.items or ()):
            if not same(t.device):
                raise ValueError(f"dst[{i}]: on {t.device}, loader stages on {want}")
            if not t.is_contiguous() or t.numel() * t.element_size() != self.nbytes:
                raise ValueError(f"dst[{i}]: need a contiguous tensor of {self.nbytes} bytes, got "
                                 f"{t.numel() * t.element_size()} bytes contiguous={t.is_contiguous()}")

    def _index_copy(self, dst_rows: Sequence[int], src: torch.Tensor, src_rows: Sequence[int]) -> None:
        """Scattered rows in a few ops: ``index_copy_`` of the source rows (a slice where they are consecutive,
        else gathered once) into ``dst_rows``."""
        assert self.mat is not None
        s0 = src_rows[0]
        if list(src_rows) == list(range(s0, s0 + len(src_rows))):
            part = src[s0:s0 + len(src_rows)]
        else:
            part = src.index_select(0, device_index(src_rows, src.device))
        dst, wpart = _words(self.mat), _words(part)
        if dst.dtype != wpart.dtype:  # one of them cannot be seen as words: copy bytes
            dst, wpart = self.mat, part
        dst.index_copy_(0, device_index(dst_rows, self.mat.device), wpart)

    def copy_in(self, dst_rows: Sequence[int], src: torch.Tensor, src_rows: Sequence[int],
                non_blocking: bool = False) -> None:
        """``dst[dst_rows[k]] = src[src_rows[k]]`` for every k, on the current stream. ``src``: ``[m, nbytes]``
        uint8 (a strided view is fine, e.g. the payload columns of a staging pass). Matrix: one copy per run
        of consecutive rows; list: one fused multi-tensor copy (``torch._foreach_copy_``) where torch has it."""
        if not dst_rows:
            return
        if self.mat is not None:
            spans = list(runs(dst_rows, src_rows))
            # index_copy_ needs both sides on one device: host rows into a device matrix go by runs (one DMA each)
            if len(spans) <= MAX_RUN_COPIES or src.device != self.mat.device:
                for d0, s0, n in spans:
                    self.mat[d0:d0 + n].copy_(src[s0:s0 + n], non_blocking=non_blocking)
            else:
                self._index_copy(dst_rows, src, src_rows)  # queued: asynchronous on CUDA
            return
        import torch
        assert self.items is not None
        dsts = [bytes_view(self.items[d]) for d in dst_rows]
        srcs = [src[s] for s in src_rows]
        fused = getattr(torch, "_foreach_copy_", None)
        if fused is not None and len(dsts) > 1:
            fused(dsts, srcs, non_blocking=non_blocking)
            return
        for d, s in zip(dsts, srcs):
            d.copy_(s, non_blocking=non_blocking)


def device_index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """``rows`` (ints) as an int64 index tensor on ``device``; on CUDA through pinned memory and one
    ``non_blocking`` copy on the current stream, so nothing waits for the kernels queued there (a copy from
    pageable memory, as ``torch.as_tensor(rows, device="cuda")`` makes, synchronises the stream). The caching
    host allocator keeps the pinned block until the copy is done (an event it records)."""
    import torch
    idx = torch.tensor(rows, dtype=torch.int64)
    if device.type != "cuda":
        return idx
    return idx.pin_memory().to(device, non_blocking=True)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` (uint8 ``[m, nbytes]``, rows contiguous) as int64 words where its layout allows (fewer, wider
    elements for the copy kernel), else itself."""
    import torch
    if t.shape[1] % 8 == 0 and t.storage_offset() % 8 == 0 and t.stride(0) % 8 == 0:
        return t.view(torch.int64)
    return t


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """1-D uint8 view of a contiguous tensor's bytes."""
    import torch
    t = t.view(-1)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)
