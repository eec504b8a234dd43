"""kvikio engine: cuFile (GPUDirect Storage) I/O through NVIDIA kvikio.

The same :class:`~kvbm_backend.io.base.IoOp` interface as the posix engine for host buffers, plus
:meth:`KvikioEngine.read_to_device` / :meth:`KvikioEngine.write_from_device` for device buffers
(torch CUDA tensors or anything with ``__cuda_array_interface__``), which is what makes
storage -> HBM reads possible without a host copy.

kvikio decides per file how the bytes move (kvikio ``compat_mode``, env ``KVIKIO_COMPAT_MODE``):
GDS (cuFile DMA straight into device memory; needs the ``nvidia-fs`` kernel module or a cuFile
that supports the filesystem, O_DIRECT, and 4 KiB-aligned offsets/sizes/buffers) or compat mode
(POSIX reads into kvikio's own pinned bounce buffer, then a host-to-device copy). Both need the
NVIDIA driver library ``libcuda.so.1``, even for host buffers: on a machine without it every
``CuFile`` read or write fails, so :func:`kvikio_available` reports False with that reason.

Source of the facts above: kvikio 26.10 documentation ("Runtime Settings", "Compatibility mode")
and its behaviour on a machine without the driver (``RuntimeError ... libcuda.so.1: cannot open
shared object file`` at the first ``pread``).
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import threading
from concurrent.futures import Future
from typing import Any, Protocol, Sequence

from .base import IoOp, gather, submit_each
from ..threads import executor

NO_DRIVER_REASON = "libcuda.so.1 not loadable: kvikio needs the NVIDIA driver for file I/O"


class IOFuture(Protocol):
    """What kvikio's ``CuFile.pread`` / ``pwrite`` return (kvikio ``IOFuture``)."""

    def get(self) -> int:
        """Wait; bytes transferred. Raises kvikio's error (a RuntimeError) on failure."""
        ...

    def done(self) -> bool: ...


class _CuFile(Protocol):
    """The part of kvikio's ``CuFile`` this engine uses. ``buf``: a host array or a device buffer (a CUDA
    tensor, anything with ``__cuda_array_interface__``); kvikio takes any such object."""

    def pread(self, buf: object, size: int, file_offset: int) -> IOFuture: ...

    def pwrite(self, buf: object, size: int, file_offset: int) -> IOFuture: ...

    def close(self) -> None: ...


@functools.lru_cache(maxsize=1)
def _libcuda_status() -> tuple[bool, str]:
    """(True, "") if ``libcuda.so.1`` loads and ``cuInit(0)`` succeeds, else (False, why)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return False, f"{NO_DRIVER_REASON} ({e})"
    try:
        rc = lib.cuInit(0)
    except AttributeError:
        return False, "libcuda.so.1 loaded but has no cuInit: not an NVIDIA driver library"
    if rc != 0:
        return False, f"cuInit(0) returned CUDA error {rc} (100 = no CUDA-capable device): no usable GPU"
    return True, ""


def kvikio_available() -> tuple[bool, str]:
    """Can kvikio do file I/O on this machine?

    Returns:
        ``(True, "kvikio <version>, compat_mode=<ON|OFF|AUTO>")`` or ``(False, reason)`` where reason
        names what is missing: the ``kvikio`` package (``pip install kvikio-cu12``, extra ``gpu``), or
        the NVIDIA driver (``libcuda.so.1 not loadable: kvikio needs the NVIDIA driver for file I/O``),
        or a usable GPU (``cuInit`` error).
    """
    try:
        import kvikio
        import kvikio.defaults
    except ImportError as e:
        return False, f"kvikio not installed ({e}); pip install kvikio-cu12 (extra 'gpu')"
    ok, why = _libcuda_status()
    if not ok:
        return False, why
    return True, f"kvikio {kvikio.__version__}, compat_mode={compat_mode_name()}"


def compat_mode_name() -> str:
    """kvikio's configured compat mode: ``ON`` (always POSIX + bounce), ``OFF`` (GDS or fail) or
    ``AUTO`` (GDS where cuFile can, else POSIX + bounce). ``unknown`` if kvikio is missing."""
    try:
        import kvikio
        import kvikio.defaults
        m = kvikio.defaults.get("compat_mode")
        return str(kvikio.CompatMode(m).name if not isinstance(m, kvikio.CompatMode) else m.name)
    except Exception:  # noqa: BLE001 - a report, never fatal
        return "unknown"


def kvikio_mode() -> dict[str, Any]:
    """What kvikio will do, without touching the GPU beyond ``cuInit``: a dict with ``installed``,
    ``version``, ``compat_mode`` (setting), ``compat_preferred`` (kvikio decided POSIX+bounce, e.g.
    no cuFile), ``libcufile_version`` (``major.minor``), ``gds_available`` (cuFile driver says GDS
    works; None where it cannot be asked) and ``io`` (``gds``, ``compat (pinned bounce buffer)`` or
    ``unavailable``) with ``reason``."""
    out: dict[str, Any] = {"installed": False}
    try:
        import kvikio
        import kvikio.defaults
    except ImportError as e:
        out["reason"] = f"kvikio not installed ({e})"
        out["io"] = "unavailable"
        return out
    out.update(installed=True, version=kvikio.__version__, compat_mode=compat_mode_name(),
               env_KVIKIO_COMPAT_MODE=os.environ.get("KVIKIO_COMPAT_MODE"))
    try:
        out["compat_preferred"] = bool(kvikio.defaults.is_compat_mode_preferred())
    except Exception as e:  # noqa: BLE001
        out["compat_preferred"] = None
        out["compat_preferred_error"] = str(e)
    try:
        import kvikio.cufile_driver as cfd
        maj, mnr = cfd.libcufile_version()
        out["libcufile_version"] = f"{maj}.{mnr}" if (maj, mnr) != (0, 0) else None
    except Exception as e:  # noqa: BLE001
        out["libcufile_version"] = None
        out["libcufile_error"] = str(e)
    ok, why = _libcuda_status()
    out["gds_available"] = None
    if ok:
        try:
            import kvikio.cufile_driver as cfd
            out["gds_available"] = bool(cfd.get("is_gds_available"))
        except Exception as e:  # noqa: BLE001
            out["gds_error"] = str(e)
    if not ok:
        out["io"], out["reason"] = "unavailable", why
    elif out.get("compat_mode") == "ON" or out.get("compat_preferred") or not out.get("gds_available"):
        out["io"] = "compat (pinned bounce buffer)"
        out["reason"] = ("compat_mode=ON" if out.get("compat_mode") == "ON"
                         else "cuFile/GDS not usable here (no nvidia-fs or unsupported filesystem)")
    else:
        out["io"], out["reason"] = "gds", "cuFile driver reports GDS available"
    return out


def _as_oserror(e: Exception, what: str) -> OSError:
    if isinstance(e, OSError):
        return e
    return OSError(errno.EIO, f"kvikio {what}: {e}")


class KvikioEngine:
    """IoEngine on kvikio ``CuFile``.

    Args:
        threads: kvikio's thread-pool size (``kvikio.defaults`` ``num_threads``, a process-wide
            setting) and the number of ops issued at once.
    Raises:
        RuntimeError: kvikio cannot do I/O here; the message is :func:`kvikio_available`'s reason.
        ValueError: ``threads < 1``.

    Compat-mode (POSIX) reads use O_DIRECT for page-aligned pieces where kvikio supports it
    (``auto_direct_io_read``, process-wide; :attr:`direct_reads` says whether it is on).

    File descriptors in :class:`IoOp` are reopened by kvikio through ``/proc/self/fd/N`` (cuFile
    opens files by path; the reopened handle names the same inode, so the caller's ``fdatasync``
    on its own fd covers bytes written here). Handles are cached per (fd, device, inode).
    """

    name = "kvikio"

    def __init__(self, threads: int = 8):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        ok, why = kvikio_available()
        if not ok:
            raise RuntimeError(why)
        import kvikio
        import kvikio.defaults
        self._kvikio = kvikio
        self.threads = threads
        try:
            kvikio.defaults.set("num_threads", threads)
        except Exception:  # noqa: BLE001 - older kvikio: keep its default pool
            pass
        # POSIX (compat-mode) reads through O_DIRECT where offsets/sizes are page aligned (G3 slots
        # are): the storage's own rate, no page-cache copy. kvikio >= 25.08 ("auto_direct_io_read");
        # older versions read buffered.
        try:
            kvikio.defaults.set("auto_direct_io_read", True)
            self.direct_reads = bool(kvikio.defaults.get("auto_direct_io_read"))
        except Exception:  # noqa: BLE001
            self.direct_reads = False
        self._handles: dict[int, tuple[int, int, _CuFile]] = {}
        self._lock = threading.Lock()
        self._dispatch = executor(threads, "kvbm-kvikio")
        self._closed = False

    def resize(self, threads: int) -> None:
        """Set kvikio's thread-pool size (``kvikio.defaults`` ``num_threads``: process-wide; kvikio
        rebuilds its pool) between loads, e.g. ``benchmarks/gpu_bench.py --sweep``. Raises ValueError:
        ``threads < 1``."""
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if threads == self.threads:
            return
        try:
            self._kvikio.defaults.set("num_threads", threads)
        except Exception:  # noqa: BLE001 - older kvikio: keep its pool
            return
        self.threads = threads

    # -- handles -------------------------------------------------------------------------------
    def _handle(self, fd: int) -> _CuFile:
        st = os.fstat(fd)
        with self._lock:
            h = self._handles.get(fd)
            if h is not None and h[0] == st.st_dev and h[1] == st.st_ino:
                return h[2]
            if h is not None:
                h[2].close()
            cf: _CuFile = self._kvikio.CuFile(f"/proc/self/fd/{fd}", "r+")
            self._handles[fd] = (st.st_dev, st.st_ino, cf)
            return cf

    def forget_fd(self, fd: int) -> None:
        """Drop the cached handle of ``fd`` (call before closing ``fd``)."""
        with self._lock:
            h = self._handles.pop(fd, None)
        if h is not None:
            h[2].close()

    # -- host IoOps ----------------------------------------------------------------------------
    def _run_op(self, op: IoOp) -> int:
        cf = self._handle(op.fd)
        size = os.fstat(op.fd).st_size
        pos = op.offset
        futs: list[IOFuture] = []
        for b in op.bufs:
            n = b.nbytes
            if not n:
                continue
            if not op.write:
                n = max(0, min(n, size - pos))  # short read at end of file, as posix
                if n == 0:
                    break
            futs.append(cf.pwrite(b, n, pos) if op.write else cf.pread(b, n, pos))
            pos += n
        done = 0
        err: Exception | None = None
        for f in futs:  # wait for all before returning: the caller may reuse buffers afterwards
            try:
                done += f.get()
            except Exception as e:  # noqa: BLE001
                err = err or e
        if err is not None:
            raise _as_oserror(err, "pwrite" if op.write else "pread")
        return done

    def submit(self, ops: Sequence[IoOp]) -> Future[list[int]]:
        """Run ``ops`` (host buffers); returns at once. The Future resolves to bytes per op in order
        (reads at end of file are short, not an error) after every op finished, or raises the
        OSError (``EIO`` wrapping kvikio's RuntimeError) of the lowest-index failed op."""
        if self._closed:
            raise RuntimeError("KvikioEngine is closed")
        return gather(submit_each(self._dispatch, self._run_op, ops, "KvikioEngine"))

    # -- device buffers ------------------------------------------------------------------------
    def read_to_device(self, fd: int, dev_buf: object, size: int, file_offset: int) -> int:
        """Read ``size`` bytes at ``file_offset`` of ``fd`` into device memory (blocking).

        Args:
            dev_buf: a contiguous CUDA tensor (or ``__cuda_array_interface__`` object) of at least
                ``size`` bytes; a slice of a staging tensor is fine.
        Returns:
            bytes read (short only at end of file).
        Raises:
            OSError: EIO wrapping kvikio's error (the caller counts the blocks as misses).
        """
        cf = self._handle(fd)
        try:
            return cf.pread(dev_buf, size, file_offset).get()
        except Exception as e:  # noqa: BLE001
            raise _as_oserror(e, "device pread") from e

    def read_to_device_async(self, fd: int, dev_buf: object, size: int, file_offset: int) -> IOFuture:
        """Like :meth:`read_to_device` but returns kvikio's ``IOFuture`` (``.get()`` -> bytes,
        ``.done()``); the buffer must stay alive until it is done."""
        return self._handle(fd).pread(dev_buf, size, file_offset)

    def write_from_device(self, fd: int, dev_buf: object, size: int, file_offset: int) -> int:
        """Write ``size`` bytes of device memory to ``fd`` at ``file_offset`` (blocking). Durability
        is the caller's (``fdatasync`` on its fd). Raises OSError like :meth:`read_to_device`."""
        cf = self._handle(fd)
        try:
            return cf.pwrite(dev_buf, size, file_offset).get()
        except Exception as e:  # noqa: BLE001
            raise _as_oserror(e, "device pwrite") from e

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._dispatch.shutdown(wait=True)
        with self._lock:
            hs, self._handles = list(self._handles.values()), {}
        for h in hs:
            try:
                h[2].close()
            except Exception:  # noqa: BLE001
                pass
