"""Layer-ordered reads of G3 frames (the plan of a layer-wise load, no I/O).

A stored block is FullyContiguous ``[layer, outer, page, inner]`` (docs/format.md) behind its 4 KiB
frame header, so layer ``l`` of a block is one contiguous file range
``frame_offset + HEADER_BYTES + l * layer_bytes`` of ``layer_bytes`` bytes. A layer-wise load reads
every block's first layers before any block's later ones, so the engine can compute layer ``l - 1``
while layer ``l`` is still on the wire.

Layers are read in groups of consecutive layers per block (one read per block and group); group 0's read
starts with the frame header. A layer is ready when its group's reads are in, so the groups grow: layer 0
alone (the engine starts computing after the reads of one layer, not of a whole group), then 1, 2, 4, ...
layers up to ``g`` (about ``min_read`` bytes per read, so small layers do not cost one system call each). Where ``layer_bytes`` is not a multiple of
4 KiB (O_DIRECT needs 4 KiB-aligned offsets, lengths and buffers) the plan is one group holding every
layer: whole-block reads, still correct, no overlap (:func:`layer_aligned` says which).
"""
from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence

from ..model.frame import HEADER_BYTES

ALIGN = 4096
DEFAULT_MIN_READ = 256 << 10  # bytes per read at least (where the block's layers allow)
MIN_GROUPS = 4  # a block's layers are cut into at least this many groups (where it has that many layers)


def layer_aligned(layer_bytes: int) -> bool:
    """True when every layer range of a frame is 4 KiB-aligned in offset and length (O_DIRECT)."""
    return layer_bytes > 0 and layer_bytes % ALIGN == 0


def layer_groups(layer_bytes: int, num_layers: int, min_read: int = DEFAULT_MIN_READ) -> list[tuple[int, int]]:
    """``[(first_layer, count), ...]`` covering ``range(num_layers)`` in order. The first group is layer 0
    alone, then groups of 1, 2, 4, ... layers (doubling: each read takes about as long as the layers loaded
    before it take to compute, when loading a layer takes what computing it does) up to ``g`` layers:
    ``ceil(min_read / layer_bytes)``, but at most ``num_layers // MIN_GROUPS`` (small blocks still overlap)
    and at least 1; the last group may be shorter. One group of every layer when the layers are not 4
    KiB-aligned (:func:`layer_aligned`). Raises ValueError for non-positive sizes."""
    if layer_bytes <= 0 or num_layers <= 0 or min_read <= 0:
        raise ValueError(f"layer_groups: layer_bytes {layer_bytes}, num_layers {num_layers}, min_read {min_read}: "
                         "all must be > 0")
    if not layer_aligned(layer_bytes):
        return [(0, num_layers)]
    g = max(1, min(-(-min_read // layer_bytes), num_layers // MIN_GROUPS))
    out: list[tuple[int, int]] = []
    l0, size = 0, 1
    while l0 < num_layers:
        cnt = min(size, num_layers - l0)
        out.append((l0, cnt))
        l0 += cnt
        if len(out) > 1:  # 1, 1, 2, 4, ...: the second group is as long as the first
            size = min(2 * size, g)
    return out


class GroupReads(NamedTuple):
    """The reads of one layer group: one per leased frame, layers ``[first_layer, first_layer + n_layers)``
    of the frame in load row ``rows[j]``, ``n_layers * layer_bytes`` bytes at file offset ``offsets[j]``
    (plus the 4 KiB header before them when ``header``: then ``offsets[j]`` is the frame's own offset). One
    object per group, plain int lists inside: a load of ``n`` blocks in ``G`` groups builds ``G`` of these,
    not ``n * G`` read objects (each Python object on the path to the first layer costs the GIL)."""

    group: int
    first_layer: int
    n_layers: int
    header: bool
    rows: list[int]
    offsets: list[int]

    def nbytes(self, layer_bytes: int) -> int:
        """Bytes of each read of this group."""
        return self.n_layers * layer_bytes + (HEADER_BYTES if self.header else 0)


def plan_layer_reads(frames: Sequence[tuple[int, int]], layer_bytes: int,
                     groups: Sequence[tuple[int, int]]) -> Iterator[GroupReads]:
    """The reads of each group, group by group (a generator: a loader submits group 0's reads before it
    builds the later groups'; rows and offsets in ``frames`` order).

    Args:
        frames: ``(row, frame_offset)`` of each leased block (offset of its 4 KiB header in its file).
        layer_bytes: bytes of one layer of one block.
        groups: :func:`layer_groups`.
    """
    rows = [r for r, _ in frames]
    base = [off for _, off in frames]
    for gi, (l0, cnt) in enumerate(groups):
        if gi == 0:
            yield GroupReads(0, l0, cnt, True, rows, base)
        else:
            d = HEADER_BYTES + l0 * layer_bytes
            yield GroupReads(gi, l0, cnt, False, rows, [off + d for off in base])
