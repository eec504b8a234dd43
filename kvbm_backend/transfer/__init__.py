"""Transfer layer: block extents -> coalesced, aligned I/O ops for an :mod:`kvbm_backend.io` engine."""
from .plan import IOV_MAX, Extent, coalesce

__all__ = ["Extent", "coalesce", "IOV_MAX"]
