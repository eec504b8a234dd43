"""Host-staged device loads: G4 blocks decrypted on the host, then one host-to-device copy. (Device saves stage
into pinned memory in the connector: :mod:`kvbm_backend.integrations.vllm.offloads`.)

G4 blocks are sealed with AES-256-GCM (docs/invariants.md #5); the tag is verified on the host where
the plaintext lands, so for G4 "verified where the bytes land" means the host staging buffer. The pool
works on many blocks at once (the AEAD work in ``cryptography`` and xxh3 release the GIL), each straight
into its row of a pinned staging buffer (a few buffers of :data:`CHUNK_BYTES` per load, reused: the pinned
memory a load holds is bounded by the pool's read threads, not by its length); verified rows go to the
device in batches of half a chunk as they verify, overlapping the reads and decryption of the others. ``G4Pool.get`` runs this for torch-tensor
destinations; ``python -m kvbm_backend.apps.bench.g4_load`` measures the host side.
"""
from __future__ import annotations

import queue
import time
from typing import Any, Sequence

import numpy as np

from ..model.namespace import BlockKey
from .rows import BlockRows
from .staging import host_staging_pool, take_rows


def _torch():
    import torch
    return torch


def _host_staging(n: int, nbytes: int, device):
    """``(buf, rows)``: uint8 ``[n, nbytes]`` host rows from the staging pool (:mod:`.staging`),
    pinned when the device is CUDA (4 KiB aligned rows when ``nbytes`` is a 4 KiB multiple); ``buf``
    goes back with :func:`_give_staging` once nothing reads or writes the rows any more."""
    return take_rows(host_staging_pool(_torch().device(device).type == "cuda"), n, nbytes)


def _give_staging(buf: np.ndarray, device) -> None:
    host_staging_pool(_torch().device(device).type == "cuda").give(buf)


def check_dst(dst, nbytes: int, device) -> None:
    """Raise ValueError naming the first tensor of ``dst`` (a list of tensors, or one ``[n, nbytes]``
    matrix) that is not a contiguous ``nbytes``-byte tensor on ``device``'s type."""
    BlockRows(dst, nbytes, _torch().device(device).type)  # the type only: cuda matches any CUDA index


CHUNK_BYTES = 32 << 20  # host staging per chunk of a host-staged load, bytes (pinned on CUDA)


def window(nbytes: int, read_threads: int, chunk_bytes: int = CHUNK_BYTES) -> tuple[int, int]:
    """``(rows_per_buffer, buffers_in_flight)`` of a host-staged load of blocks of ``nbytes``: staging buffers of
    ``chunk_bytes`` (at least one row), and enough of them in flight that each of the pool's ``read_threads``
    has a row to fill while the chunk before is copied out (at least 2). The staging a load holds is at most
    their product (a load of fewer blocks fills fewer): bounded by the pool's parallelism, not by the load's
    length. Before, a load staged all its blocks at once: a 128K-token G4 hit of Llama-3.1-8B (16 GiB) took
    16 GiB of pinned memory, which torch's caching host allocator keeps for the life of the process once the
    staging pool drops it (past :data:`~.staging.KEEP_BYTES`); on a CPU engine every such load faulted its
    staging in anew. Every buffer has the same size, so the staging pool reuses them across loads of any
    length."""
    rows = max(1, chunk_bytes // max(1, nbytes))
    return rows, max(2, -(-max(0, read_threads) // rows) + 1)


def load_via_host(pool, keys: Sequence[BlockKey], dst: Sequence, *, timeout_s: float | None = None,
                  chunk_bytes: int = CHUNK_BYTES, timed_out: list[bool] | None = None) -> list[bool]:
    """Load blocks through the host into device (or CPU) tensors, in chunks through a bounded staging window.

    The load is cut into chunks of ``chunk_bytes`` (:func:`window`); a few are in flight at once, each in
    its own host staging buffer from the process-wide staging pool (pinned when the device is CUDA), reused
    chunk after chunk once its copies are done. With a pool that stages (G4: ``pool.get_staged``) each block
    is read straight into its staging row and decrypted / checked there on the pool's I/O threads
    (``g4.max_inflight`` at once; AES-GCM and xxh3 release the GIL), and the rows that verified are copied to
    their ``dst`` rows every half chunk and when the chunk answers (``non_blocking`` on a side stream, issued
    from this thread, one copy per run of rows: :class:`_Window`), so the
    host-to-device copies run while later blocks are still being read and opened. Other pools: one
    ``pool.get`` per chunk, then its verified rows. Either way only verified rows are ever copied.

    Args:
        pool: a :class:`~kvbm_backend.pool.base.BlockPool` taking numpy buffers (G4; G3 on a host path);
            its ``read_threads`` (if it has one) sizes the window.
        keys: block keys.
        dst: one ``[n, pool.layout.bytes_per_block]``-byte tensor (row i: block i), or contiguous tensors of
            that many bytes each, all on one device (:class:`~.rows.BlockRows`).
        timeout_s: wait for the pool's answers (None: the pool's own timeouts bound each chunk); blocks not
            verified and copied by then are misses.
        chunk_bytes: staging bytes per chunk (see :func:`window`).
        timed_out: if given, a list that receives one flag per key: True where the block missed because
            time ran out (``timeout_s``, or the pool's own bound: ``GetResult.timed_out``), not because the
            pool proved it absent or bad.
    Returns:
        ``ok[i]`` True only where the pool verified block i (AEAD tag / checksum) and it was copied;
        ``dst[i]`` is untouched where False.
    Raises:
        ValueError: length mismatch or bad ``dst`` tensors.
    """
    if len(keys) != len(dst):
        raise ValueError(f"load_via_host: {len(keys)} keys but {len(dst)} destination tensors")
    if not keys:
        return []
    bpb = pool.layout.bytes_per_block
    rows_dst = dst if isinstance(dst, BlockRows) else BlockRows(dst, bpb)
    rows, depth = window(bpb, int(getattr(pool, "read_threads", 0) or 0), chunk_bytes)
    w = _Window(pool, list(keys), rows_dst, rows, depth, timeout_s)
    ok = w.run()
    if timed_out is not None:
        timed_out.extend(w.timed_out)
    return ok


class _Copier:
    """Copies verified staging rows to their ``dst`` rows (:class:`~.rows.BlockRows`): on a side CUDA stream,
    ``non_blocking`` (from pinned rows), one copy per run of consecutive rows; plain copies on the CPU.
    :meth:`finish` waits for them."""

    def __init__(self, dst: BlockRows, device):
        self.dst, self.cuda = dst, device.type == "cuda"
        if self.cuda:
            torch = _torch()
            self.stream = torch.cuda.Stream(device)
            self.stream.wait_stream(torch.cuda.current_stream(device))  # dst may be in use on the compute stream

    def copy_rows(self, host, src_rows: Sequence[int], dst0: int) -> None:
        """Copy rows ``src_rows`` of ``host`` (``[m, nbytes]`` uint8) to ``dst`` rows ``dst0 + r``, under one
        stream context."""
        src_rows = sorted(src_rows)
        dst_rows = [dst0 + r for r in src_rows]
        if self.cuda:
            with _torch().cuda.stream(self.stream):
                self.dst.copy_in(dst_rows, host, src_rows, non_blocking=True)
        else:
            self.dst.copy_in(dst_rows, host, src_rows)

    def mark(self):
        """An event after the copies issued so far (None on the CPU, where copies are done when issued)."""
        if not self.cuda:
            return None
        ev = _torch().cuda.Event()
        ev.record(self.stream)
        return ev

    def finish(self) -> None:
        if self.cuda:
            self.stream.synchronize()


class _Chunk:
    """Blocks ``[start, start + n)`` of a load in flight, staged in the first ``n`` rows of ``buf`` (``host``: its
    ``[rows, nbytes]`` torch view)."""

    def __init__(self, start: int, n: int, buf: np.ndarray, host):
        self.start, self.n, self.buf, self.host = start, n, buf, host
        self.copied = [False] * n
        self.hits: list[int] = []  # rows verified, in order (appended on the pool's I/O threads)
        self.seen = 0  # hits taken for copying so far
        self.batch: Any = None  # staged pools: the GetBatch
        self.future: Any = None  # the pool's answer (GetBatch.future, or pool.get's future)
        self.finished = False

    def idle(self) -> bool:
        """No I/O thread of the pool writes into ``buf`` any more."""
        if self.batch is not None:
            return self.batch.idle.is_set()
        return self.future is not None and self.future.done() and self.future.exception() is None


class _Window:
    """One :func:`load_via_host` call: chunks submitted ``depth`` at a time, woken by the pool's hits and
    answers (one queue), buffers reused once idle and copied out.

    A staged chunk wakes this thread every :attr:`wake_every` verified rows (half a chunk) and when it answers,
    not once per row: each wake-up retakes the GIL and issues a copy (a few GIL-releasing torch calls), and
    with 16 I/O threads these per-row hand-offs queued behind theirs (connector into HBM 5.3 GB/s against the
    pool's own 8.4, H200 / H100, 2026-11-26). The rows of a wake-up go out as one copy per run."""

    def __init__(self, pool, keys: list[BlockKey], dst: BlockRows, rows: int, depth: int,
                 timeout_s: float | None):
        self.pool, self.keys, self.dst, self.rows, self.depth = pool, keys, dst, rows, depth
        self.device = dst.device
        self.bpb = pool.layout.bytes_per_block
        self.staged = getattr(pool, "get_staged", None) is not None
        self.end = None if timeout_s is None else time.monotonic() + timeout_s
        self.ok = [False] * len(keys)
        self.timed_out = [False] * len(keys)  # missed because time ran out (ours or the pool's)
        self.wake: queue.SimpleQueue = queue.SimpleQueue()  # (chunk, False) hits to copy, (chunk, True) answers
        self.wake_every = max(1, rows // 2)
        self.spare: list[tuple[np.ndarray, object, object]] = []  # (buf, host, event of its last copies)
        self.held: list[_Chunk] = []  # finished chunks whose buffer the pool may still write (not reused)
        self.copier = _Copier(dst, self.device)

    def _buffer(self):
        """A staging buffer of ``rows`` rows: a spare one (its copies waited for) or one from the staging pool."""
        if self.spare:
            buf, host, ev = self.spare.pop()
            if ev is not None:
                ev.synchronize()  # its rows' copies to the device are done before they are overwritten
            return buf, host
        return _host_staging(self.rows, self.bpb, self.device)

    def _submit(self, start: int) -> _Chunk:
        n = min(self.rows, len(self.keys) - start)
        buf, host = self._buffer()
        c = _Chunk(start, n, buf, host)
        host_np = host.numpy()
        rows = [host_np[r] for r in range(n)]
        keys = self.keys[start:start + n]
        if self.staged:
            c.batch = self.pool.get_staged(keys, rows, on_hit=lambda i, c=c: self._hit(c, i))
            c.future = c.batch.future
        else:
            c.future = self.pool.get(keys, rows)
        c.future.add_done_callback(lambda _f, c=c: self.wake.put((c, True)))
        return c

    def _hit(self, c: _Chunk, i: int) -> None:
        """Row ``i`` of ``c`` verified (on an I/O thread): noted; this thread is woken every ``wake_every`` rows."""
        c.hits.append(i)  # one list operation: atomic under the GIL
        if len(c.hits) % self.wake_every == 0:
            self.wake.put((c, False))

    def _late(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end

    def run(self) -> list[bool]:
        n = len(self.keys)
        live: list[_Chunk] = []
        nxt = 0
        while nxt < n or live:
            while nxt < n and len(live) < self.depth and not self._late():
                live.append(self._submit(nxt))
                nxt += live[-1].n
            if not live:
                break
            try:
                item = self.wake.get(timeout=None if self.end is None else max(0.0, self.end - time.monotonic()))
            except queue.Empty:
                break  # late: what verified and was copied counts
            # and everything that came meanwhile: one wake-up and stream context for all
            self._handle([item] + self._drain())
            for c in [c for c in live if c.finished]:
                live.remove(c)
                self._retire(c)
            if self._late():
                break
        self._handle(self._drain())  # hits that came with the end
        for c in live:  # late chunks: their rows that verified (copied now if not yet) count
            self._copy_hits(c)
            for i in range(c.n):
                self.ok[c.start + i] = c.copied[i]
                self.timed_out[c.start + i] = not c.copied[i]
            self.held.append(c)
        for i in range(nxt, n):  # never asked for: time ran out first
            self.timed_out[i] = True
        self.copier.finish()
        for buf, _host, _ev in self.spare:
            _give_staging(buf, self.device)
        for c in self.held:
            if c.idle():  # no I/O thread writes its rows any more: the staging can be reused
                _give_staging(c.buf, self.device)
        return self.ok

    def _drain(self) -> list:
        """Everything queued on :attr:`wake` now, without waiting."""
        items = []
        while True:
            try:
                items.append(self.wake.get_nowait())
            except queue.Empty:
                return items

    def _handle(self, items) -> None:
        """Copy the rows that verified (one copy per chunk), then settle the chunks that answered."""
        for c in dict.fromkeys(c for c, _ in items):  # each chunk once, in order
            if not c.finished:
                self._copy_hits(c)
        for c, answered in items:
            if answered:
                self._settle(c)

    def _copy_hits(self, c: _Chunk) -> None:
        """Copy the rows of ``c`` that verified since the last call and are not copied yet."""
        n = len(c.hits)
        rs = [i for i in c.hits[c.seen:n] if not c.copied[i]]
        c.seen = n
        if rs:
            self.copier.copy_rows(c.host, rs, c.start)
            for i in rs:
                c.copied[i] = True

    def _settle(self, c: _Chunk) -> None:
        """The pool answered chunk ``c``: its ``ok`` rows (staged: those also copied; else copied now)."""
        try:
            res = c.future.result(timeout=0)
            got = [bool(x) for x in res.ok] + [False] * (c.n - len(res.ok))
            late = [res.timed_out_at(i) for i in range(c.n)]
        except Exception:  # noqa: BLE001 - storage trouble: misses (the pool logged and counted)
            got, late = [False] * c.n, [False] * c.n
        if not self.staged:
            self.copier.copy_rows(c.host, [i for i in range(c.n) if got[i]], c.start)
            c.copied = got
        else:  # verified in time but their on_hit is still to come (the batch expired between the pool's ok and it):
            # copied now (before 2026-12-02 a plain miss, neither ok nor timed out: the block cooled for 30 s)
            rs = [i for i in range(c.n) if got[i] and not c.copied[i]]
            if rs:
                self.copier.copy_rows(c.host, rs, c.start)
                for i in rs:
                    c.copied[i] = True
        for i in range(c.n):
            self.ok[c.start + i] = got[i] and c.copied[i]
            self.timed_out[c.start + i] = late[i] and not self.ok[c.start + i]
        c.finished = True

    def _retire(self, c: _Chunk) -> None:
        """A settled chunk: its buffer becomes a spare (after its copies) once no I/O thread writes it."""
        if c.idle():
            self.spare.append((c.buf, c.host, self.copier.mark()))
        else:
            self.held.append(c)
