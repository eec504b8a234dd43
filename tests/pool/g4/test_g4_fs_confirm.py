"""``FsStore.stored_matches``: the re-read that confirms corruption before a reader deletes an object bypasses
the page cache (``pool/g4/fs_confirm.py``).

Review of 2026-11-30: the confirming re-read was a buffered ``pread`` through the same (NFS) client page cache
as the read it confirms, so a page gone bad in the client's cache could "confirm" corruption the server does not
hold and the reader deleted a good object. Now it reads O_DIRECT where the filesystem takes it, else drops the
range's cached pages (``POSIX_FADV_DONTNEED``) first. A page cache that disagrees with the disk cannot be made in
a test, so these check the path the re-read takes on real files: the fd of every read it makes (O_DIRECT or
not), and the fadvise call, observed at the OS boundary; a filesystem refusing O_DIRECT is real (ramfs, in a
private mount namespace) or injected as EINVAL at the read.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import sys

import pytest

from kvbm_backend.pool.g4.fs_store import FsStore

HANG_S = 600.0  # a hang guard, not a bound
DATA = bytes(range(256)) * 40  # 10240 bytes: not whole 4 KiB blocks (the O_DIRECT read is rounded up)


def _direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _spy_reads(monkeypatch, refuse_direct=False):
    """Record ``(O_DIRECT?, offset)`` of each os.preadv/os.pread and each posix_fadvise ``(offset, len, advice)``;
    ``refuse_direct``: a read on an O_DIRECT fd fails EINVAL (a filesystem refusing O_DIRECT reads)."""
    seen = {"reads": [], "fadvise": []}
    real_preadv, real_pread, real_fadvise = os.preadv, os.pread, os.posix_fadvise

    def preadv(fd, bufs, off, *a):
        seen["reads"].append((_direct(fd), off))
        if refuse_direct and _direct(fd):
            raise OSError(errno.EINVAL, "injected: O_DIRECT read refused")
        return real_preadv(fd, bufs, off, *a)

    def pread(fd, n, off, *a):
        seen["reads"].append((_direct(fd), off))
        if refuse_direct and _direct(fd):
            raise OSError(errno.EINVAL, "injected: O_DIRECT read refused")
        return real_pread(fd, n, off, *a)

    def fadvise(fd, off, n, advice):
        seen["fadvise"].append((off, n, advice))
        return real_fadvise(fd, off, n, advice)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    return seen


def _takes_o_direct(d) -> bool:
    probe = os.path.join(d, "probe")
    with open(probe, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        os.unlink(probe)


def test_the_confirming_reread_is_o_direct_where_the_filesystem_takes_it(tmp_path, monkeypatch):
    """Before the fix every confirming read was buffered (``[(False, 0)]``). Now, on a filesystem that takes
    O_DIRECT (tmp_path here: ext4/xfs/tmpfs on recent kernels), every read it makes is on an O_DIRECT fd, the
    object having just been read buffered (its pages cached), and the answer is still right."""
    if not _takes_o_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT (the fallback tests below cover it)")
    st = FsStore(tmp_path / "s", fsync=False)
    assert st.put_if_absent("a/b", DATA)
    with open(tmp_path / "s" / "a" / "b", "rb") as f:
        assert f.read() == DATA  # cached
    seen = _spy_reads(monkeypatch)
    assert st.stored_matches("a/b", DATA, len(DATA)) is True
    assert st.stored_matches("a/b", DATA[:100], len(DATA)) is True  # a bounce buffer's prefix
    assert st.stored_matches("a/b", DATA[:-1] + b"\x00", len(DATA)) is False  # read != stored
    assert seen["reads"] and all(d for d, _ in seen["reads"]), seen
    assert seen["fadvise"] == [], seen


def test_an_o_direct_read_refused_drops_the_cached_range_then_reads_buffered(tmp_path, monkeypatch):
    """A filesystem that takes O_DIRECT at open but refuses the read (EINVAL, injected at os.preadv/os.pread):
    the re-read is retried buffered after POSIX_FADV_DONTNEED on the compared range. Before the fix: a buffered
    read with no fadvise."""
    st = FsStore(tmp_path / "s", fsync=False)
    assert st.put_if_absent("a/b", DATA)
    seen = _spy_reads(monkeypatch, refuse_direct=True)
    assert st.stored_matches("a/b", DATA, len(DATA)) is True
    assert seen["fadvise"] == [(0, len(DATA), os.POSIX_FADV_DONTNEED)], seen
    assert seen["reads"][-1] == (False, 0), seen  # the read after the fadvise: buffered
    assert st.stored_matches("a/b", DATA[:-1] + b"\x00", len(DATA)) is False
    assert not st.stored_matches("a/missing", b"x", 1)


_RAMFS = r'''
import os, sys
from kvbm_backend.pool.g4.fs_store import FsStore
data = bytes(range(256)) * 40
st = FsStore(sys.argv[1], fsync=False)
assert st.put_if_absent("a/b", data)
calls, real = [], os.posix_fadvise
os.posix_fadvise = lambda fd, off, n, adv: (calls.append((off, n, adv)), real(fd, off, n, adv))[1]
assert st.stored_matches("a/b", data, len(data)) is True
assert st.stored_matches("a/b", data[:-1] + b"\x00", len(data)) is False
assert calls == [(0, len(data), os.POSIX_FADV_DONTNEED)] * 2, calls
print("ok")
'''


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) to mount a private ramfs")
def test_on_a_filesystem_refusing_o_direct_the_cached_range_is_dropped_first(tmp_path):
    """ramfs refuses O_DIRECT at open: the confirming re-read falls back to POSIX_FADV_DONTNEED on the range,
    then a buffered read (answers right). Before the fix: no fadvise. Run in a private mount namespace."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           'mount -t ramfs none "$1" && exec "$2" -c "$3" "$1"', "sh", str(mnt), sys.executable, _RAMFS]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    if r.returncode != 0 and "mount" in r.stderr and "ok" not in r.stdout:
        pytest.skip(f"cannot mount ramfs in a private namespace here: {r.stderr.strip()[:200]}")
    assert r.stdout.strip() == "ok", r.stderr
