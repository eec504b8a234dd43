"""GPU data path: storage -> HBM reads verified on the device, host-staged G4 loads, device saves.

* :class:`~kvbm_backend.gpu.loader.DeviceLoader` -- ``load(keys, dst_tensors) -> list[bool]`` over a
  :class:`~kvbm_backend.pool.base.SlotLeaseSource`: what ``G3Pool.get(keys, tensors)`` runs (kvikio/GDS
  or pinned bounce into HBM, or host mode on the CPU; probed and reported). Callers go through the pool.
* :func:`~kvbm_backend.gpu.host_path.load_via_host` -- G4 (encrypted) loads: parallel host decrypt,
  one H2D copy. :func:`~kvbm_backend.gpu.host_path.device_blocks_to_host` -- save side staging.
* :func:`~kvbm_backend.gpu.checksum.device_checksum_torch` -- ``frame.device_checksum`` in torch ops.

Importing this package does not import torch; the submodules do.
"""
from __future__ import annotations

__all__ = ["DeviceLoader", "probe_device_path", "load_via_host", "device_blocks_to_host",
           "device_checksum_torch", "device_checksums_torch"]


def __getattr__(name):
    if name in ("DeviceLoader", "probe_device_path"):
        from . import loader
        return getattr(loader, name)
    if name in ("load_via_host", "device_blocks_to_host"):
        from . import host_path
        return getattr(host_path, name)
    if name in ("device_checksum_torch", "device_checksums_torch"):
        from . import checksum
        return getattr(checksum, name)
    raise AttributeError(name)
