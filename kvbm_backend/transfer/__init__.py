"""Transfer layer: block extents -> coalesced, aligned I/O ops for an :mod:`kvbm_backend.io` engine.

:mod:`.plan` coalesces any extents; :mod:`.slots` plans the extents of fixed-size slab slots (G3 writes and
reads) and the passes and reads of the device loader (G3 slots into HBM)."""
from .plan import IOV_MAX, Extent, coalesce
from .slots import contiguous_runs, cut_at, file_order, group_passes, plan_ops, slot_extent, staged_run_extents

__all__ = ["Extent", "coalesce", "IOV_MAX", "cut_at", "slot_extent", "staged_run_extents",
           "plan_ops", "contiguous_runs", "group_passes", "file_order"]
