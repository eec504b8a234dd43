"""G4: the persistent, shared, per-tenant encrypted tier on S3-compatible stores and shared POSIX mounts.

:class:`~kvbm_backend.pool.g4.pool.G4Pool` is the BlockPool (API in :mod:`.pool`, offloads in
:mod:`.writer`, loads and lookups in :mod:`.reader`); stores are opened by ``g4.url`` scheme in
:mod:`.factory` (:mod:`.s3_store`, :mod:`.fs_store`, :mod:`.memory_store` for tests); retention in
:mod:`.gc`; the ``gc`` and ``keys`` commands in the CLI.
"""
from .pool import G4Pool

__all__ = ["G4Pool"]
