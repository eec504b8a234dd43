"""The G3 pool's one reader: lease -> plan -> read -> verify -> deliver, for every destination.

* lease -- slots are pinned in the catalog while read (:meth:`.reader.G3Reader.lease` / ``release``; host
  gets pin in :class:`.host.HostGet`); a slot is dropped only once its stored bytes are proven bad
  (:meth:`.reader.G3Reader.prove_bad`, :meth:`~.reader.G3Reader.drop_corrupt`), or once it stayed unreadable over
  several failed loads (:meth:`~.reader.G3Reader.drop_unreadable`, :mod:`.unreadable`).
* plan -- :mod:`kvbm_backend.transfer`: chunks of staged slot runs (host), passes of contiguous runs
  (device), reads ordered by layer group (layer-wise, :mod:`kvbm_backend.transfer.layers`).
* read -- :mod:`kvbm_backend.io`: the pool's engine (posix / nixl) for host gets; kvikio
  (:mod:`kvbm_backend.io.kvikio_engine`) or ``preadv`` through :class:`kvbm_backend.io.files.ReadFiles`
  (the one O_DIRECT open / fallback rule) for device and layer-wise loads.
* verify -- :mod:`.verify`: the 4 KiB header (:func:`~kvbm_backend.model.frame.accept`, one check for
  every path, :func:`.verify.check_frame`), then the payload where it landed: xxh3_128 on the host or the
  device checksum (:mod:`kvbm_backend.gpu.checksum`) on the device.
* deliver -- numpy buffers (:mod:`.host`), torch tensors (:mod:`.device`, :mod:`.passes`), or one layer at
  a time (:mod:`.layerwise`); a miss never writes the caller's buffer.

:class:`.reader.G3Reader` is the part ``G3Pool`` delegates ``get`` / ``lease`` / ``release`` /
``drop_corrupt`` / ``device_reader`` to. Device primitives (checksum kernels, path probe, pinned staging)
come from :mod:`kvbm_backend.gpu`, which imports nothing from ``pool``.
"""
from __future__ import annotations

from .host import HostGet, valid_key
from .reader import G3Reader

__all__ = ["G3Reader", "HostGet", "valid_key"]
