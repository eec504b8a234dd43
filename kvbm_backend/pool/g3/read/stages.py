"""The reader's stages shared by the loaders that read leased slots themselves (device loads,
:mod:`.device`; layer-wise loads, :mod:`.layerwise`): lease with a type check, the frame header check,
and reporting slots whose stored bytes failed a check (the pool proves them bad before dropping).

A frame is trusted only after :func:`check_frame` (header: magic, version, header check, identity,
layout, lengths) and a payload check where it landed (the device checksum for ``FLAG_DEVCHECK`` frames
on a device, else xxh3_128 for ``FLAG_CHECKSUM``); an encrypted or unchecked frame is ``unverifiable``.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Sequence

import numpy as np

from ....model.frame import FLAG_CHECKSUM, FLAG_DEVCHECK, FLAG_ENCRYPTED, ChecksumFrames, FrameError, FrameHeader, \
    accept, key_digests
from ....model.layout import KvLayout
from ....model.namespace import BlockKey
from ...base import BlockBuffer, SlotLease, SlotLeaseSource

log = logging.getLogger(__name__)

#: header bytes the checks read per row (the 144-byte fixed part and its check fit; the rest is zeros): what
#: device loads bring to the host, what the layer-wise loads compare
HEADER_COPY = 256
#: reasons that are not the stored bytes' fault: the slot stays (a miss)
TRANSIENT = ("not_found", "io_error", "short", "timeout")
#: reasons that never drop a slot (:func:`report_corrupt`)
KEEP = TRANSIENT + ("unverifiable", "length")


def add_seconds(counters: Counter[str], name: str, seconds: float) -> None:
    """``counters[name] += seconds``: the loaders' Counters hold float seconds (``*_s`` names) beside their
    int counts, which typeshed's int-valued ``Counter`` does not express (the one place that says so)."""
    counters[name] += seconds  # type: ignore[assignment]  # a float value in a Counter: see the docstring


def lease_all(source: SlotLeaseSource, keys: Sequence[BlockKey], who: str,
              timeout_s: float | None = None) -> list[SlotLease | None]:
    """``source.lease(keys, timeout_s)``, checked: one ``SlotLease`` (for that key) or None per key.

    Raises:
        TypeError: the source returned another count, a non-SlotLease or a lease of another key (a
            wiring bug, never a silent miss); every typed lease is released first.
        TimeoutError: the source could not lease within ``timeout_s`` seconds (nothing leased).
    """
    leases = source.lease(list(keys), timeout_s=timeout_s)
    typed = [x for x in leases if isinstance(x, SlotLease)]
    problem = None
    if len(leases) != len(keys):
        problem = f"source.lease returned {len(leases)} leases for {len(keys)} keys"
    else:
        for i, ls in enumerate(leases):
            if ls is None:
                continue
            if not isinstance(ls, SlotLease):
                problem = f"source.lease returned {type(ls).__name__} for key {i}; expected SlotLease or None"
                break
            if ls.key != keys[i]:
                problem = f"lease {i} is for {ls.key}, not {keys[i]}"
                break
    if problem is not None:
        source.release(typed)  # a wiring bug must not leak pins
        raise TypeError(f"{who}: {problem}")
    return leases


def release_quietly(source: SlotLeaseSource, leases: Sequence[SlotLease]) -> None:
    """``source.release(leases)``; a failure is logged, never raised (it must not mask a load's result)."""
    try:
        source.release(list(leases))
    except Exception as e:  # noqa: BLE001
        log.warning("releasing %d slot leases failed: %s", len(leases), e)


def check_frame(header: BlockBuffer, key: BlockKey, layout: KvLayout, tag: bytes, *, world: int | None,
                slot_len: int) -> FrameHeader:
    """The header check of every loader: :func:`~kvbm_backend.model.frame.accept` of the 4 KiB ``header``
    for ``key`` (``tag``: its 16-byte tenant tag) in ``layout``, a frame of ``slot_len`` bytes, and a payload
    check it can be verified with (``FLAG_DEVCHECK`` or ``FLAG_CHECKSUM``, not encrypted).

    Raises:
        FrameError: its reason (``magic``, ``version``, ``header_check``, ``identity``, ``layout``,
            ``length``, ``token_digest``; ``unverifiable`` for an encrypted or unchecked frame).
    """
    h = accept(header, key, layout, tag, world=world, stored_len=layout.bytes_per_block, frame_bytes=slot_len)
    if h.flags & FLAG_ENCRYPTED:
        raise FrameError("unverifiable", "encrypted frame on a G3 load path (G4 loads go through the host)")
    if not h.flags & (FLAG_CHECKSUM | FLAG_DEVCHECK):
        raise FrameError("unverifiable", "frame carries no checksum")
    return h


class HeaderChecks:
    """Many frame headers of one layout checked at once (numpy compares, one xxh3_64 per header:
    :meth:`~kvbm_backend.model.frame.ChecksumFrames.check_headers`, per namespace), for the loaders that
    check a pass or a group of headers together. A header refused here is not yet proven bad: callers
    check it again with :func:`check_frame`, which names the reason (or accepts a frame whose writer made
    other bytes than ``ChecksumFrames``, e.g. another format minor).

    Args:
        layout: the namespace's layout. world: the TP world size frames must name (None: not checked).
        tenant_tag_fn: the 16-byte tenant tag a key's frames carry.
    """

    def __init__(self, layout: KvLayout, world: int | None, tenant_tag_fn: Callable[[BlockKey], bytes]) -> None:
        self.layout, self.world, self.tenant_tag_fn = layout, world, tenant_tag_fn
        self._frames: dict[str, ChecksumFrames] = {}  # namespace (hex) -> its header checker

    def check(self, headers: np.ndarray[Any, np.dtype[np.uint8]], keys: Sequence[BlockKey],
              ) -> tuple[np.ndarray[Any, np.dtype[np.bool_]], np.ndarray[Any, np.dtype[np.bool_]]]:
        """``(ok, devcheck)`` bool ``[m]`` for headers ``[m, >= 168]`` (row ``j``: the frame read for
        ``keys[j]``): ``ok`` where the header is exactly what the writer makes for that key; ``devcheck``
        where it carries ``FLAG_DEVCHECK``."""
        m = len(keys)
        ok = np.zeros(m, bool)
        dev = np.zeros(m, bool)
        by_ns: dict[str, list[int]] = {}
        for j, k in enumerate(keys):
            by_ns.setdefault(k.namespace, []).append(j)
        for ns, js in by_ns.items():
            frames = self._frames.get(ns)
            if frames is None:
                frames = self._frames[ns] = ChecksumFrames(bytes.fromhex(ns), self.layout, self.world or 0)
            one = len(js) == m
            kk = keys if one else [keys[j] for j in js]
            o, d = frames.check_headers(headers[:m] if one else headers[js], [self.tenant_tag_fn(k) for k in kk],
                                        [k.rank for k in kk], [k.seq_hash for k in kk],
                                        check_world=self.world is not None, digests=key_digests(kk))
            ok[js], dev[js] = o, d
        return ok, dev


def report_corrupt(source: SlotLeaseSource, keys: Sequence[BlockKey], why: Sequence[str | None],
                   rows: Sequence[int] | None = None) -> None:
    """``source.drop_corrupt(keys[i], why[i])`` for each row (``rows``, default all) whose reason says
    the stored bytes failed a check (not None and not in :data:`KEEP`); the source drops the slot only
    once a re-read proves it bad. Failures are logged, never raised."""
    for i in (range(len(why)) if rows is None else rows):
        r = why[i]
        if r is None or r in KEEP:
            continue
        try:
            source.drop_corrupt(keys[i], r)
        except Exception as e:  # noqa: BLE001
            log.warning("drop_corrupt failed for %s: %s", keys[i], e)
