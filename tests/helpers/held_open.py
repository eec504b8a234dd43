"""Files whose ``open()`` blocks in the kernel, as on a hung NFS hard mount: this process takes a Linux
write lease (``F_SETLEASE F_WRLCK``) on each, so any other open waits for the lease to be broken (up to
``/proc/sys/fs/lease-break-time`` seconds, 45 by default) until :meth:`HeldOpen.release` gives them up.

The G4 file store opens objects ``O_NONBLOCK`` (a planted FIFO must not block it), meets EWOULDBLOCK here
and waits in a plain open of the very inode, as it would on a slow mount. SIGIO (the lease-break notice)
is ignored while held; the constructor must run on the main thread (``signal.signal``).
"""
from __future__ import annotations

import fcntl
import os
import signal


class HeldOpen:
    def __init__(self, paths):
        self._old = signal.signal(signal.SIGIO, signal.SIG_IGN)
        self.fds = []
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
            self.fds.append(fd)

    def release(self, restore_sigio: bool = True) -> None:
        """Give up the leases: the blocked opens finish now. ``restore_sigio`` False: leave SIGIO's handler as it is
        (a release from another thread than the main one, whose caller restores it itself)."""
        for fd in self.fds:
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            finally:
                os.close(fd)
        self.fds = []
        if restore_sigio:
            signal.signal(signal.SIGIO, self._old)
