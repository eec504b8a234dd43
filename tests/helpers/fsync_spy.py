"""Which files and directories a test's code ``fsync``\\ s: the real ``os.fsync`` wrapped (monkeypatch) to record
each fd's path (``/proc/self/fd``) before it runs. Used where power loss cannot be simulated: the durability order
is what can be checked."""
from __future__ import annotations

import os


def record_fsyncs(monkeypatch) -> list[str]:
    """Wrap ``os.fsync`` for the test; returns the list the paths of the synced fds are appended to."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced
