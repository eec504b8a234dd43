"""file:// store read path: ``FsStore.get_into`` (O_DIRECT into aligned buffers, buffered otherwise) and
the huge-page bounce buffers G4Pool reads through. Real files in tmp_path."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvbm_backend.memory import hugepage_empty
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.reader import bounce_buffers, bounce_slot_bytes
from kvbm_backend.pool.g4.store import ObjectStore
from kvbm_backend.memory import aligned_empty
from tests.helpers.pools import G4_TIMEOUT_S, tiny_ns

HANG_S = 600.0  # a hang guard, not a bound: waits for a process that must end; returns as soon as it does


def _data(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 4096, (2 << 20) + 4096])
def test_get_into_aligned_and_unaligned_buffers_read_the_same_bytes(tmp_path, size):
    st = FsStore(tmp_path / "s")
    data = _data(size, seed=size)
    assert st.put_if_absent("a/b/obj", data)
    cap = -(-max(size, 1) // 4096) * 4096
    aligned = aligned_empty(cap)
    aligned[:] = 0xEE
    assert st.get_into("a/b/obj", aligned) == size
    assert aligned[:size].tobytes() == data
    unaligned = bytearray(size + 3)  # odd length: never O_DIRECT
    assert st.get_into("a/b/obj", unaligned) == size
    assert bytes(unaligned[:size]) == data
    assert bytes(st.get("a/b/obj")) == data


def test_get_into_object_longer_than_buffer_reports_true_size(tmp_path):
    st = FsStore(tmp_path / "s")
    data = _data(5 * 4096 + 7, seed=1)
    st.put("x", data)
    buf = aligned_empty(2 * 4096)
    assert st.get_into("x", buf) == len(data)  # caller sees the object is longer than expected
    assert buf.tobytes() == data[:2 * 4096]
    small = bytearray(10)
    assert st.get_into("x", small) == len(data)
    assert bytes(small) == data[:10]


def test_get_into_absent_is_none_and_bad_names_raise(tmp_path):
    st = FsStore(tmp_path / "s")
    assert st.get_into("nope/x", aligned_empty(4096)) is None
    with pytest.raises(ValueError, match="'..'"):
        st.get_into("../escape", aligned_empty(4096))


def test_default_get_into_copies_through_get(tmp_path):
    """Stores without their own get_into (S3) get the base class's get-and-copy."""
    st = FsStore(tmp_path / "s")
    st.put("o", b"0123456789")
    buf = bytearray(4)
    assert ObjectStore.get_into(st, "o", buf) == 10 and bytes(buf) == b"0123"
    assert ObjectStore.get_into(st, "missing", buf) is None


def test_hugepage_buffers_are_aligned_writable_and_thp_advised(tmp_path):
    a = hugepage_empty(3 << 20)
    assert a.nbytes == 3 << 20 and a.ctypes.data % (2 << 20) == 0
    a[:] = 7
    assert int(a.sum()) == 7 * (3 << 20)
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists(thp) or "[never]" in open(thp).read():
        pytest.skip("transparent huge pages are off on this kernel: buffers stay 4 KiB pages")
    smaps = open("/proc/self/smaps").read().split("\n")
    addr = a.ctypes.data
    for i, line in enumerate(smaps):
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= addr < hi:
                block = []
                for ln in smaps[i + 1:]:
                    h = ln.split(" ", 1)[0]
                    if "-" in h and all(c in "0123456789abcdef-" for c in h):
                        break
                    block.append(ln)
                elig = [ln for ln in block if ln.startswith("THPeligible:")]
                assert elig and elig[0].split()[1] == "1", f"mapping not THP-eligible: {block}"
                return
    pytest.fail("buffer's mapping not found in /proc/self/smaps")


def test_bounce_pool_lends_distinct_slots_and_overflows_without_waiting():
    bp = bounce_buffers(5000, 2)
    slot_bytes = bounce_slot_bytes(5000)
    assert slot_bytes == 8192
    with bp.lend(slot_bytes) as a, bp.lend(slot_bytes) as b:
        assert a.ctypes.data != b.ctypes.data and a.nbytes == b.nbytes == 8192
        with bp.lend(slot_bytes) as c:  # all lent: a fresh buffer, no blocking
            assert c.nbytes == 8192 and bp.stats()["allocated"] == 1
    seen = set()
    mu = threading.Lock()

    def use():
        with bp.lend(slot_bytes) as s:
            with mu:
                seen.add(s.ctypes.data)
    ts = [threading.Thread(target=use) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    before = bp.stats()["allocated"]
    with bp.lend(slot_bytes) as a, bp.lend(slot_bytes) as b:  # both arena slots came back: no overflow now
        assert bp.stats()["allocated"] == before
        arena = {bp._arena[:slot_bytes].ctypes.data, bp._arena[slot_bytes:].ctypes.data}
        assert {a.ctypes.data, b.ctypes.data} == arena
    with pytest.raises(ValueError, match="slots"):
        bounce_buffers(4096, 0)


def test_g4_pool_reads_file_objects_through_its_bounce_buffers_and_reports_overflow(tmp_path):
    from kvbm_backend.config import G4Config
    from kvbm_backend.pool.g4.pool import G4Pool

    ns = tiny_ns("bounce/model")
    layout = ns.layout
    keys = ns.keys(list(range(1, 4)))
    data = [np.full(layout.bytes_per_block, i + 1, np.uint8) for i in range(3)]
    cfg = G4Config(url=f"file://{tmp_path / 'g4'}", encrypt=False, max_inflight=2, timeout_s=G4_TIMEOUT_S)
    with G4Pool(cfg, ns) as p:
        assert p.put(keys, data).result(HANG_S).written == 3
        out = [np.zeros(layout.bytes_per_block, np.uint8) for _ in range(3)]
        assert p.get(keys, out).result(HANG_S).ok == [True] * 3
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
        st = p.stats()
        assert st["bounce_overflow"] == p.reader.bounce.stats()["allocated"] >= 0
        # one buffer per I/O thread: a frame and the 16-byte GCM tag after it (staged opens), page-rounded
        assert p.reader.bounce.stats()["arena_bytes"] == 2 * bounce_slot_bytes(4096 + layout.bytes_per_block + 16)


def test_aligned_frames_are_written_with_o_direct_and_read_back_equal(tmp_path):
    """Issue 25 item 1: a file:// offload's frame (4 KiB aligned, from the pool's buffers) is written with
    O_DIRECT (no page-cache copy: ~0.3 CPU-s/GB less on ext4); unaligned data is written buffered; both
    read back byte for byte, and a filesystem that refuses O_DIRECT gets buffered writes."""
    from kvbm_backend.memory import aligned_empty
    from kvbm_backend.pool.g4.fs_store import FsStore
    st = FsStore(str(tmp_path / "s"))
    frame = aligned_empty(3 * 4096)
    frame[:] = np.arange(frame.nbytes, dtype=np.uint64).astype(np.uint8)
    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")
    assert st.put_if_absent("a/b", memoryview(frame)) is True and st._direct_write is True
    assert bytes(st.get("a/b")) == frame.tobytes()
    odd = b"x" * 5000  # not aligned: buffered, and O_DIRECT stays on for frames
    assert st.put_if_absent("a/c", odd) is True and st._direct_write is True and bytes(st.get("a/c")) == odd
    assert st.put_if_absent("a/b", memoryview(frame)) is False  # create-exclusive as before
    assert [o.name for o in st.list_temps("")] == []  # no temp file left behind


_RAMFS_READS = r'''
import sys
import numpy as np
from kvbm_backend.memory import aligned_empty
from kvbm_backend.pool.g4.fs_store import FsStore
st = FsStore(sys.argv[1])
frame = aligned_empty(3 * 4096)
frame[:] = np.arange(frame.nbytes, dtype=np.uint64).astype(np.uint8)
want = frame.tobytes()
assert st.put_if_absent("a/b", memoryview(frame)) is True and st._direct_write is False  # refused: buffered
assert bytes(st.get("a/b")) == want and st._direct is False  # O_DIRECT refused at open: read buffered
st._direct = None  # probe again: a scatter read into aligned buffers, refused at open, read buffered
head, row = aligned_empty(4096), aligned_empty(2 * 4096)
assert st.get_into("a/b", [head, row]) == len(want) and head.tobytes() + row.tobytes() == want
assert st._direct is False
assert bytes(st.get("a/b", 4096, 100)) == want[4096:4196] and st.get("a/none") is None
print("ok")
'''


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) to mount a private ramfs")
def test_a_filesystem_refusing_o_direct_is_read_and_written_buffered(tmp_path):
    """ramfs refuses O_DIRECT at open: FsStore's reads open through the project's one O_DIRECT rule
    (io.files.open_for_read) and read buffered, writes fall back to buffered, the bytes are the same and
    the store remembers it (``_direct`` False). Run in a private mount namespace (the host's mount table
    is untouched)."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           'mount -t ramfs none "$1" && exec "$2" -c "$3" "$1"', "sh", str(mnt), sys.executable, _RAMFS_READS]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if r.returncode != 0 and "mount" in r.stderr and "ok" not in r.stdout:
        pytest.skip(f"cannot mount ramfs in a private namespace here: {r.stderr.strip()[:200]}")
    assert r.stdout.strip() == "ok", r.stderr


def _os_calls(fn) -> int:
    """System calls that ``fn()`` makes through Python's ``os`` and ``fcntl`` modules on this thread (not
    ``os.fspath``, no call): each releases the GIL and takes it back, with many I/O threads a wait for its turn."""
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        if event == "c_call" and getattr(arg, "__module__", None) in ("posix", "fcntl") and arg.__name__ != "fspath":
            n += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def test_reading_an_object_deep_in_the_tree_retakes_the_gil_a_few_times_not_per_path_component(tmp_path):
    """Issue 24 item 4: a read opened the object by walking root/a/b/c/d one O_NOFOLLOW directory fd at a
    time (17 GIL-retaking calls for this name: 6 opens, 6 closes, 2 fstat, 2 fcntl, the read), which on a
    16-core host kept 16 I/O threads to ~3 busy cores. Now one openat2 refusing links (a ctypes call), then
    fstat, preadv and close (O_NONBLOCK, which does nothing to a regular file's reads, is left set unless a
    read says EAGAIN). Failed before: 17 calls."""
    from kvbm_backend.io import openat2
    if not openat2.available():
        pytest.skip("no openat2 here (kernel < 5.6 or a seccomp filter): the component walk is all there is")
    st = FsStore(tmp_path / "s")
    data = _data(4096 + 8192, seed=3)
    assert st.put_if_absent("a/b/c/d/obj", data)
    head, row = aligned_empty(4096), aligned_empty(8192)
    assert _os_calls(lambda: st.get_into("a/b/c/d/obj", [head, row])) <= 3
    assert head.tobytes() + row.tobytes() == data
    assert _os_calls(lambda: st.get_into("a/b/c/d/obj", bytearray(len(data)))) <= 3


def _store_maybe_via_link(tmp_path, via_link: bool) -> tuple:
    """``(real root directory, FsStore)``: the store's root is that directory, or (``via_link``) a symbolic link
    to it, which makes the store open objects by the component walk instead of one openat2."""
    real = tmp_path / "real"
    real.mkdir()
    root = real
    if via_link:
        root = tmp_path / "via"
        root.symlink_to(real, target_is_directory=True)
    return real, FsStore(root)


@pytest.mark.parametrize("via_link", [False, True], ids=["one-call-open", "walk (root through a link)"])
def test_reads_refuse_links_and_odd_files_under_the_root_either_way(tmp_path, via_link):
    """The one-call open (openat2) and the component walk it falls back to (a root whose own path has a
    link, which the operator may choose and which is followed) answer alike: objects read, absent is None,
    a link at a directory or at the object is refused (OSError), a FIFO is refused without blocking."""
    real, st = _store_maybe_via_link(tmp_path, via_link)
    data = _data(5000, seed=4)
    assert st.put_if_absent("t/x/obj", data) and st.put_if_absent("t/y/obj", data)
    buf = bytearray(8192)
    assert st.get_into("t/x/obj", buf) == 5000 and bytes(buf[:5000]) == data
    assert st.get_into("t/x/none", buf) is None and st.get_into("t/none/obj", buf) is None
    outside = tmp_path / "outside"
    shutil.copytree(real / "t" / "y", outside)
    shutil.rmtree(real / "t" / "y")
    os.symlink(outside, real / "t" / "y")  # a link at a directory component
    with pytest.raises(OSError, match="symbolic link"):
        st.get_into("t/y/obj", buf)
    # listing does not follow it either, at the last component or above it (review finding 2026-11-29: a
    # prefix below the link listed the names and sizes outside the root)
    (outside / "sub").mkdir()
    (outside / "sub" / "obj2").write_bytes(b"x")
    assert [o.name for o in st.list("t/")] == ["t/x/obj"]
    assert list(st.list("t/y/")) == [] and list(st.list("t/y/sub/")) == []
    os.symlink(outside / "obj", real / "t" / "x" / "lnk")  # a link at the object name
    with pytest.raises(OSError, match="symbolic link"):
        st.get_into("t/x/lnk", buf)
    os.mkfifo(real / "t" / "x" / "fifo")
    with pytest.raises(OSError, match="not a regular file"):
        st.get_into("t/x/fifo", buf)
    for bad in ("t/../t/x/obj", "/t/x/obj", "t//x/obj", "t/./x/obj", "./t/x/obj", "t/x/obj/", "t/x/.."):
        with pytest.raises(ValueError, match="without '..'"):
            st.get_into(bad, buf)


def test_each_io_thread_keeps_one_bounce_buffer_instead_of_lending_one_per_block(tmp_path):
    """Issue 24 item 4: lending a bounce buffer per block took the buffer pool's lock and its arena checks
    twice per block, GIL-held work every I/O thread queues for; each thread now takes one at its first load
    and keeps it (it runs one load at a time). Failed before: one take per block load (24)."""
    from kvbm_backend.config import G4Config
    from kvbm_backend.pool.g4.pool import G4Pool

    ns = tiny_ns("bounce/kept")
    bpb = ns.layout.bytes_per_block
    keys = ns.keys(list(range(1, 13)))
    data = [np.full(bpb, i + 1, np.uint8) for i in range(12)]
    cfg = G4Config(url=f"file://{tmp_path / 'g4'}", encrypt=False, max_inflight=2, timeout_s=G4_TIMEOUT_S)
    with G4Pool(cfg, ns) as p:
        assert p.put(keys, data).result(HANG_S).written == 12
        out = [np.zeros(bpb, np.uint8) for _ in range(12)]
        assert p.get(keys, out).result(HANG_S).ok == [True] * 12
        assert p.get_staged(keys, out).future.result(HANG_S).ok == [True] * 12
        assert all(np.array_equal(a, b) for a, b in zip(out, data))
        st = p.reader.bounce.stats()
        assert st["reused"] + st["allocated"] <= 2, st  # at most one per I/O thread


@pytest.mark.parametrize("via_link", [False, True], ids=["one-call-open", "walk (root through a link)"])
def test_a_name_with_a_nul_byte_is_refused_either_way(tmp_path, via_link):
    """Reviewer (2026-11-30): the one-call open passed the path through ctypes.c_char_p, which ends it at the
    first NUL: ``obj\\x00junk`` opened ``obj``, where the walk (os.open) raises ValueError. Both refuse now."""
    _, st = _store_maybe_via_link(tmp_path, via_link)
    assert st.put_if_absent("t/x/obj", _data(5000, seed=5))
    with pytest.raises(ValueError, match="null byte"):
        st.get_into("t/x/obj\x00junk", bytearray(8192))
