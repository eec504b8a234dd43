"""NIXL GDS_MT engine (optional): cuFile through NIXL's multi-threaded GDS plugin, beside kvikio.

Selected only where the ``GDS_MT`` plugin loads and a CUDA device is present
(:func:`gds_mt_available`); on other machines the plugin's shared library does not even load
(NIXL 1.5.1's ``libplugin_GDS_MT.so`` links ``libcudart.so.12`` and ``libcufile.so.0``), and
:func:`gds_mt_available` says so.

Same :class:`~kvbm_backend.io.base.IoOp` interface for host buffers (``DRAM_SEG``), plus
:meth:`NixlGdsEngine.read_to_device` / :meth:`NixlGdsEngine.write_from_device` for CUDA tensors
(``VRAM_SEG``). Every call registers its buffers and file descriptors, runs one NIXL transfer
(local memory <-> ``FILE_SEG``, loopback to the agent itself, as in NIXL's ``nixl_gds_example.py``)
and deregisters. The ``backend`` argument exists so the descriptor logic is exercised on machines
without a GPU with NIXL's ``POSIX`` backend, which takes the same ``DRAM_SEG``/``FILE_SEG`` pairs.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import itertools
import os
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Sequence

from .base import IoOp, check_bufs, submit_each
from ..threads import executor, start_thread

if TYPE_CHECKING:
    import torch

_ids = itertools.count()


def _plugin_files(name: str) -> list[str]:
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return []
    base = os.path.dirname(os.path.dirname(nixl_cu12.__file__))
    found = []
    for pat in (".*nixl*libs*", "*nixl*libs*"):  # glob's * skips dot-directories: ask for them too
        found += glob.glob(os.path.join(base, pat, "**", f"libplugin_{name}.so"), recursive=True)
    cands = sorted(set(found), key=lambda p: ("mesonpy" not in p, p))  # copy whose $ORIGIN/.. has NIXL's libs  # the copy whose $ORIGIN/.. holds NIXL's own libs first
    if os.environ.get("NIXL_PLUGIN_DIR"):
        cands = glob.glob(os.path.join(os.environ["NIXL_PLUGIN_DIR"], f"libplugin_{name}.so")) + cands
    return cands


def plugin_load_error(name: str) -> str | None:
    """None if NIXL plugin ``name``'s shared library loads (``dlopen``), else why not: the missing
    libraries as ``ldd`` lists them (e.g. ``missing libcudart.so.12, libcufile.so.0``) or the loader's
    message; ``nixl not installed`` / ``libplugin_X.so not found`` otherwise."""
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return "nixl not installed"
    cands = _plugin_files(name)
    if not cands:
        return f"libplugin_{name}.so not found"
    try:
        ctypes.CDLL(cands[0], mode=ctypes.RTLD_LOCAL)
    except OSError as e:
        missing = []
        try:
            import subprocess
            out = subprocess.run(["ldd", cands[0]], capture_output=True, text=True, timeout=10).stdout
            missing = [ln.split("=>")[0].strip() for ln in out.splitlines() if "not found" in ln]
        except (OSError, subprocess.SubprocessError):
            pass
        return f"missing {', '.join(missing)}" if missing else str(e)
    return None


def _cuda_present() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    return True, ""


def gds_mt_available() -> tuple[bool, str]:
    """(True, detail) only if NIXL's GDS_MT backend starts here and a CUDA device is present, else
    (False, reason): nixl missing, plugin library not loadable (with the loader's message), backend
    creation failed, or no GPU."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as e:  # noqa: BLE001
        return False, f"cannot import nixl ({type(e).__name__}: {e})"
    err = plugin_load_error("GDS_MT")
    if err is not None:
        return False, f"NIXL GDS_MT plugin does not load: {err}"
    ok, why = _cuda_present()
    if not ok:
        return False, why
    try:
        from .nixl_engine import quiet_nixl_logging
        quiet_nixl_logging()
        agent = nixl_agent(f"kvbm-gdsmt-probe-{os.getpid()}-{next(_ids)}",
                           nixl_agent_config(enable_prog_thread=False, backends=[]))
        agent.create_backend("GDS_MT", {})
    except Exception as e:  # noqa: BLE001
        return False, f"NIXL GDS_MT backend failed to start ({type(e).__name__}: {e})"
    return True, "NIXL GDS_MT backend started"


class NixlGdsEngine:
    """NIXL storage engine on ``backend`` (default ``GDS_MT``).

    Args:
        threads: calls run at once (each is one NIXL transfer).
        backend: NIXL backend name; ``GDS_MT`` (GPU), ``GDS``, or ``POSIX`` (host memory only).
        poll_s: sleep between ``check_xfer_state`` polls.
    Raises:
        RuntimeError: NIXL or the backend cannot start here (message says why).
        ValueError: ``threads < 1``.
    """

    name = "nixl-gds"

    def __init__(self, threads: int = 4, backend: str = "GDS_MT", poll_s: float = 0.0001):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"nixl-gds engine unavailable: cannot import nixl ({e})") from e
        if backend.startswith("GDS"):
            err = plugin_load_error(backend)
            if err is not None:
                raise RuntimeError(f"nixl-gds engine unavailable: NIXL {backend} plugin does not load: {err}")
        self.backend = backend
        self.poll_s = poll_s
        self._agent_name = f"kvbm-{backend.lower()}-{os.getpid()}-{next(_ids)}"
        try:
            from .nixl_engine import quiet_nixl_logging
            quiet_nixl_logging()
            self._agent = nixl_agent(self._agent_name, nixl_agent_config(enable_prog_thread=False, backends=[]))
            self._agent.create_backend(backend, {})
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"nixl-gds engine unavailable: {backend} backend failed to start "
                               f"({type(e).__name__}: {e})") from e
        self._lock = threading.Lock()  # one NIXL call sequence at a time per agent
        self._pool = executor(threads, "kvbm-nixl-gds")
        self._closed = False

    def _xfer(self, op: str, mem: list[tuple[int, int, int]], mem_type: str, fd: int, offset: int) -> int:
        """One transfer: ``mem`` [(addr, len, dev_id)] in order <-> the file at ``offset``."""
        a = self._agent
        total = sum(n for _, n, _ in mem)
        files, pos = [], offset
        for _, n, _ in mem:
            files.append((pos, n, fd, ""))
            pos += n
        with self._lock:
            h = mreg = freg = None
            try:
                mreg = a.register_memory([(x, n, d, "") for x, n, d in mem], mem_type)
                freg = a.register_memory(files, "FILE")
                local = a.get_xfer_descs(mem, mem_type)
                h = a.initialize_xfer(op, local, freg.trim(), self._agent_name)
                st = a.transfer(h)
                while st not in ("DONE", "ERR"):
                    time.sleep(self.poll_s)
                    st = a.check_xfer_state(h)
                if st == "ERR":
                    raise OSError(errno.EIO, f"NIXL {self.backend} {op} failed at offset {offset} of fd {fd}")
            except OSError:
                raise
            except Exception as e:  # noqa: BLE001 - NIXL errors carry no errno
                raise OSError(errno.EIO, f"NIXL {self.backend} {op}: {type(e).__name__}: {e}") from e
            finally:
                if h is not None:
                    a.release_xfer_handle(h)
                if freg is not None:
                    a.deregister_memory(freg)
                if mreg is not None:  # also when the file registration failed
                    a.deregister_memory(mreg)
        return total

    def _run_op(self, op: IoOp) -> int:
        check_bufs(op, 0)
        mem = [(b.ctypes.data, b.nbytes, 0) for b in op.bufs if b.nbytes]
        if not mem:
            return 0
        if not op.write:
            size = os.fstat(op.fd).st_size
            if op.offset + sum(n for _, n, _ in mem) > size:  # NIXL fails reads past EOF: do them short
                from .posix import run_op
                return run_op(op)
        return self._xfer("WRITE" if op.write else "READ", mem, "DRAM", op.fd, op.offset)

    def submit(self, ops: Sequence[IoOp]) -> Future[list[int]]:
        """Run host-buffer ops; Future of bytes per op (reads past end of file are short), or the
        first OSError (``EIO`` naming the NIXL failure) after all ops finished."""
        ops = list(ops)
        out: Future[list[int]] = Future()
        out.set_running_or_notify_cancel()
        if self._closed:  # as the other engines: a failed Future, never a raise
            out.set_exception(OSError(errno.EBADF, "NixlGdsEngine is closed"))
            return out
        futs = submit_each(self._pool, self._run_op, ops, "NixlGdsEngine")

        def finish() -> None:
            res: list[int] = []
            err: BaseException | None = None
            for f in futs:
                try:
                    res.append(f.result())
                except BaseException as e:  # noqa: BLE001
                    err = err or e
            if err is not None:
                out.set_exception(err)
            else:
                out.set_result(res)
        start_thread(finish, name="kvbm-nixl-gds-finish") if futs else out.set_result([])
        return out

    def read_to_device(self, fd: int, dev_buf: torch.Tensor, size: int, file_offset: int) -> int:
        """Read ``size`` bytes at ``file_offset`` into a contiguous CUDA tensor (``VRAM_SEG``).
        Raises OSError (EIO) on failure, ValueError on a too-small or non-CUDA buffer."""
        return self._dev(dev_buf, size, fd, file_offset, "READ")

    def write_from_device(self, fd: int, dev_buf: torch.Tensor, size: int, file_offset: int) -> int:
        """Write ``size`` bytes of a CUDA tensor to ``fd`` at ``file_offset`` (no fsync)."""
        return self._dev(dev_buf, size, fd, file_offset, "WRITE")

    def _dev(self, t: torch.Tensor, size: int, fd: int, off: int, op: str) -> int:
        if getattr(t, "device", None) is None or t.device.type != "cuda":
            raise ValueError("device buffer must be a CUDA tensor")
        if t.numel() * t.element_size() < size or not t.is_contiguous():
            raise ValueError(f"device buffer: need {size} contiguous bytes")
        return self._xfer(op, [(t.data_ptr(), size, t.device.index or 0)], "VRAM", fd, off)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
