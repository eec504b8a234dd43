"""Device primitives: what the pools' device paths are built from. This package imports nothing from
``kvbm_backend.pool`` (tests/core/test_layers.py checks it); the G3 device loader that uses these is
:class:`kvbm_backend.pool.g3.read.device.DeviceLoader` (behind ``G3Pool.get(keys, tensors)``).

* :func:`~kvbm_backend.gpu.probe.probe_device_path` -- how frames reach a device (kvikio/GDS, kvikio
  compat, pinned bounce, host), decided by a real write/read/compare.
* :func:`~kvbm_backend.gpu.checksum.device_checksum_torch` -- ``frame.device_checksum`` in torch ops
  (:mod:`.checksum_triton`: the fused kernel where Triton runs).
* :mod:`.rows` -- the destinations of a device load (:class:`~kvbm_backend.gpu.rows.BlockRows`: one
  ``[n, bytes_per_block]`` tensor, copied into by runs of rows, or a list of block tensors).
* :mod:`.staging` -- the process-wide pinned / host staging pools (:class:`~kvbm_backend.memory.BufferPool`).
* :func:`~kvbm_backend.gpu.host_path.load_via_host` -- G4 (encrypted) loads: parallel host decrypt,
  one H2D copy. The save side's staging is the connector's (:mod:`kvbm_backend.integrations.vllm.offloads`).

Importing this package does not import torch; the submodules do.
"""
from __future__ import annotations

__all__ = ["probe_device_path", "load_via_host", "device_checksum_torch", "device_checksums_torch"]


def __getattr__(name):
    if name == "probe_device_path":
        from . import probe
        return probe.probe_device_path
    if name == "load_via_host":
        from . import host_path
        return host_path.load_via_host
    if name in ("device_checksum_torch", "device_checksums_torch"):
        from . import checksum
        return getattr(checksum, name)
    raise AttributeError(name)
