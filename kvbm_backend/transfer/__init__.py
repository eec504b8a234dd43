"""Transfer layer: block extents -> coalesced, aligned I/O ops for an :mod:`kvbm_backend.io` engine.

:mod:`.plan` coalesces any extents; :mod:`.slots` plans the extents of fixed-size slab slots (G3)."""
from .plan import IOV_MAX, Extent, coalesce
from .slots import cut_at, header_extents, plan_ops, slot_extent, staged_run_extents

__all__ = ["Extent", "coalesce", "IOV_MAX", "cut_at", "slot_extent", "staged_run_extents", "header_extents",
           "plan_ops"]
