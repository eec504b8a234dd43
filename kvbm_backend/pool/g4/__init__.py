"""G4: the persistent, shared, per-tenant encrypted tier on S3-compatible stores and shared POSIX mounts.

:class:`~kvbm_backend.pool.g4.pool.G4Pool` is the BlockPool; stores live in :mod:`.s3_store` and
:mod:`.fs_store`; retention in :mod:`.gc`; the ``gc`` and ``keys`` commands in :mod:`.cli`.
"""
from .pool import G4Pool

__all__ = ["G4Pool"]
