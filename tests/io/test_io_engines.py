"""I/O engines on real files: round trips (O_DIRECT and buffered), short reads at EOF, errors through
the Future, file helpers and the O_DIRECT probe."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvbm_backend.io import IoOp, make_engine, open_file, probe_o_direct
from kvbm_backend.io.nixl_engine import nixl_unavailable_reason
from kvbm_backend.memory import aligned_empty, aligned_zeros
from kvbm_backend.transfer import Extent, coalesce

K4 = 4096
MiB = 1 << 20
NIXL_SKIP = nixl_unavailable_reason()
HANG_S = 600.0  # a hang guard, not a bound: waits for results and processes that must come; returns as soon as they do
ENGINE_NAMES = ["posix", pytest.param("nixl", marks=pytest.mark.skipif(NIXL_SKIP is not None, reason=str(NIXL_SKIP)))]


def _rand(rng, n):
    a = aligned_empty(n)
    a[:] = rng.integers(0, 256, n, dtype=np.uint8)
    return a


@pytest.fixture(params=ENGINE_NAMES)
def engine(request):
    eng = make_engine(request.param, threads=4)
    yield eng
    eng.close()


@pytest.mark.parametrize("o_direct", [True, False])
def test_round_trip_blocks_through_planner(engine, tmp_path, o_direct):
    """Random blocks -> coalesced writes into 2 files -> coalesced reads into fresh buffers: equal."""
    rng = np.random.default_rng(1)
    block = 48 * K4  # 192 KiB: io_size 1 MiB cuts runs at buffer boundaries (5 blocks per op)
    fds = [open_file(str(tmp_path / f"slab{i}"), o_direct=o_direct, size=64 * block) for i in range(2)]
    try:
        slots = rng.permutation(64)[:40]
        src = [_rand(rng, block) for _ in slots]
        ext = [Extent(fds[s % 2], int(s // 2) * block, [b]) for s, b in zip(slots, src)]
        ops = coalesce(ext, MiB, write=True)
        assert len(ops) < len(ext)  # adjacent slots merged
        got = engine.submit(ops).result(timeout=HANG_S)
        assert got == [op.nbytes for op in ops]

        dst = [aligned_zeros(block) for _ in slots]
        ext = [Extent(fds[s % 2], int(s // 2) * block, [b]) for s, b in zip(slots, dst)]
        rops = coalesce(ext, MiB, write=False)
        assert engine.submit(rops).result(timeout=HANG_S) == [op.nbytes for op in rops]
        for a, b in zip(src, dst):
            assert np.array_equal(a, b)
        # the bytes are really in the files (read with plain os.pread, no engine)
        s0 = int(slots[0])
        with open(tmp_path / f"slab{s0 % 2}", "rb") as f:
            f.seek(int(s0 // 2) * block)
            assert f.read(block) == src[0].tobytes()
    finally:
        for fd in fds:
            os.close(fd)


def test_iovec_op_and_large_op(engine, tmp_path):
    """One op with many iovecs and one 8 MiB op, both directions."""
    rng = np.random.default_rng(2)
    fd = open_file(str(tmp_path / "f"), o_direct=True)
    try:
        small = [_rand(rng, K4 * (1 + i % 3)) for i in range(300)]
        big = _rand(rng, 8 * MiB)
        off2 = sum(b.nbytes for b in small)
        w = [IoOp(fd, 0, small, write=True), IoOp(fd, off2, [big], write=True)]
        assert engine.submit(w).result(timeout=HANG_S) == [off2, big.nbytes]
        back_small = [aligned_zeros(b.nbytes) for b in small]
        back_big = aligned_zeros(big.nbytes)
        r = [IoOp(fd, 0, back_small, write=False), IoOp(fd, off2, [back_big], write=False)]
        assert engine.submit(r).result(timeout=HANG_S) == [off2, big.nbytes]
        assert all(np.array_equal(a, b) for a, b in zip(small, back_small))
        assert np.array_equal(big, back_big)
    finally:
        os.close(fd)


@pytest.mark.parametrize("o_direct", [True, False])
def test_short_read_at_eof(engine, tmp_path, o_direct):
    """Reading past the end returns the short count (not an error); bytes before EOF are right."""
    p = tmp_path / "short"
    data = np.random.default_rng(3).integers(0, 256, 3 * K4 + 100, dtype=np.uint8)
    p.write_bytes(data.tobytes())  # 12388 bytes: the tail is not a 4 KiB multiple
    fd = open_file(str(p), o_direct=o_direct, create=False)
    try:
        a, b = aligned_zeros(2 * K4), aligned_zeros(4 * K4)
        ops = [IoOp(fd, 0, [a, b], write=False),  # 24 KiB asked, 12388 there
               IoOp(fd, 8 * K4, [aligned_zeros(K4)], write=False)]  # wholly past EOF
        assert engine.submit(ops).result(timeout=HANG_S) == [data.size, 0]
        assert np.array_equal(np.concatenate([a, b])[: data.size], data)
    finally:
        os.close(fd)


def test_misaligned_o_direct_raises_einval_in_future(engine, tmp_path):
    fd = open_file(str(tmp_path / "f"), o_direct=True, size=4 * K4)
    try:
        buf = aligned_empty(2 * K4)
        bad = buf[1:1 + K4]  # address off by one byte
        f = engine.submit([IoOp(fd, 0, [aligned_zeros(K4)], write=True), IoOp(fd, K4, [bad], write=True)])
        with pytest.raises(OSError) as ei:
            f.result(timeout=HANG_S)
        assert ei.value.errno == errno.EINVAL
        f = engine.submit([IoOp(fd, 100, [buf[:K4]], write=False)])  # misaligned offset
        with pytest.raises(OSError) as ei:
            f.result(timeout=HANG_S)
        assert ei.value.errno == errno.EINVAL
        # the engine still works after an error
        ok = aligned_zeros(K4)
        assert engine.submit([IoOp(fd, 0, [ok], write=False)]).result(timeout=HANG_S) == [K4]
    finally:
        os.close(fd)


def test_bad_fd_raises(engine):
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError):
        engine.submit([IoOp(r, 0, [aligned_zeros(K4)], write=False)]).result(timeout=HANG_S)


def test_failed_io_raises_and_engine_recovers(engine, tmp_path):
    """A write to a read-only fd fails (EBADF from the kernel; NIXL says EIO) and the next op works."""
    p = tmp_path / "ro"
    p.write_bytes(bytes(2 * K4))
    ro = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(OSError):
            engine.submit([IoOp(ro, 0, [aligned_zeros(K4)], write=True)]).result(timeout=HANG_S)
        back = aligned_empty(2 * K4)
        back[:] = 1
        assert engine.submit([IoOp(ro, 0, [back], write=False)]).result(timeout=HANG_S) == [2 * K4]
        assert not back.any()
    finally:
        os.close(ro)


def test_many_concurrent_submits(engine, tmp_path):
    """Several callers' jobs in flight at once, more ops than the queue depth: all land correctly."""
    rng = np.random.default_rng(4)
    fd = open_file(str(tmp_path / "f"), o_direct=True)
    try:
        blocks = [_rand(rng, 16 * K4) for _ in range(200)]
        futs = [engine.submit([IoOp(fd, (j * 20 + i) * 16 * K4, [blocks[j * 20 + i]], write=True)
                               for i in range(20)]) for j in range(10)]
        assert all(f.result(timeout=HANG_S) == [16 * K4] * 20 for f in futs)
        back = [aligned_zeros(16 * K4) for _ in blocks]
        ops = coalesce([Extent(fd, i * 16 * K4, [b]) for i, b in enumerate(back)], 256 * K4, write=False)
        assert engine.submit(ops).result(timeout=HANG_S) == [op.nbytes for op in ops]
        assert all(np.array_equal(a, b) for a, b in zip(blocks, back))
    finally:
        os.close(fd)


def test_submit_does_not_block(tmp_path):
    """submit returns before the I/O finishes: with 1 thread and 64 x 1 MiB O_DIRECT writes queued,
    the Future is still pending when submit returns (an engine that did the I/O inline would return
    a finished Future). No wall-clock ratio: that was flaky on a loaded 2-core machine."""
    eng = make_engine("posix", threads=1)
    fd = open_file(str(tmp_path / "f"), o_direct=True)
    try:
        bufs = [aligned_zeros(MiB) for _ in range(64)]
        ops = [IoOp(fd, i * MiB, [b], write=True) for i, b in enumerate(bufs)]
        fut = eng.submit(ops)
        assert not fut.done()
        assert fut.result(timeout=HANG_S) == [MiB] * 64
        assert os.fstat(fd).st_size == 64 * MiB
    finally:
        eng.close()
        os.close(fd)


def test_empty_submit_and_closed_engine():
    eng = make_engine("posix")
    assert eng.submit([]).result(timeout=HANG_S) == []
    eng.close()
    with pytest.raises(OSError, match="closed"):
        eng.submit([IoOp(0, 0, [aligned_zeros(K4)], write=False)]).result(timeout=HANG_S)


def _gds_posix():
    pytest.importorskip("nixl")
    from kvbm_backend.io.nixl_gds import NixlGdsEngine, plugin_load_error
    if plugin_load_error("POSIX") is not None:
        pytest.skip(f"NIXL POSIX plugin does not load: {plugin_load_error('POSIX')}")
    return NixlGdsEngine(backend="POSIX", threads=2)


@pytest.mark.parametrize("name", ["posix", "nixl_gds"])
def test_a_close_racing_a_submit_fails_the_future_after_the_started_ops(tmp_path, name):
    """The engine's pool shut down between two ops of one submit (its ``close`` racing the submit): the ops
    already started are waited for, and the submit returns a Future failed with EBADF instead of raising
    from the middle (the caller would hand back buffers an op still writes into; review 2026-11-30: the
    NIXL GDS and kvikio engines raised RuntimeError there)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    eng = make_engine("posix", threads=2) if name == "posix" else _gds_posix()
    attr = "_pool"
    started, release = threading.Event(), threading.Event()

    class ClosesAfterOneSubmit(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):
            def held(*a, **k):
                started.set()
                release.wait(HANG_S)  # the first op is still running when the submit returns
                return fn(*a, **k)
            f = super().submit(held, *args, **kwargs)
            self.shutdown(wait=False)  # close() racing the submit
            return f

    real = getattr(eng, attr)
    pool = ClosesAfterOneSubmit(max_workers=1)
    setattr(eng, attr, pool)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"x" * (2 * K4), 0)
        bufs = [aligned_zeros(K4), aligned_zeros(K4)]
        fut = eng.submit([IoOp(fd, 0, [bufs[0]], write=False), IoOp(fd, K4, [bufs[1]], write=False)])
        assert started.wait(HANG_S)
        assert not fut.done()  # the started op is waited for
        release.set()
        e = fut.exception(timeout=HANG_S)
        assert isinstance(e, OSError) and e.errno == errno.EBADF and "closed" in str(e), e
        assert bytes(bufs[0]) == b"x" * K4  # the started op ran to its end before the Future resolved
    finally:
        release.set()
        pool.shutdown(wait=True)
        setattr(eng, attr, real)
        eng.close()
        os.close(fd)


def test_make_engine_names():
    eng = make_engine("auto")
    assert eng.name in ("posix", "nixl")
    eng.close()
    with pytest.raises(ValueError, match="unknown I/O engine 'bogus'"):
        make_engine("bogus")


def test_open_file_preallocates(tmp_path):
    fd = open_file(str(tmp_path / "pre"), o_direct=True, size=3 * MiB)
    try:
        st = os.fstat(fd)
        assert st.st_size == 3 * MiB
        assert st.st_blocks * 512 >= 3 * MiB  # really allocated, not sparse
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        open_file(str(tmp_path / "missing"), o_direct=False, create=False)
    with pytest.raises(ValueError, match="size"):
        open_file(str(tmp_path / "neg"), o_direct=False, size=-1)


def test_probe_o_direct_disk(tmp_path):
    assert probe_o_direct(str(tmp_path)) is True
    assert os.listdir(tmp_path) == []  # probe file removed
    with pytest.raises(OSError):
        probe_o_direct(str(tmp_path / "nope"))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm tmpfs here")
def test_probe_o_direct_tmpfs_matches_kernel():
    """tmpfs refuses O_DIRECT (EINVAL) before Linux 6.6 and accepts it since (shmem direct I/O)."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    assert probe_o_direct("/dev/shm") is ((major, minor) >= (6, 6))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) to mount a private ramfs")
def test_probe_o_direct_false_on_ramfs(tmp_path):
    """ramfs has no direct I/O at all: the probe must say False (run in a private mount namespace so
    the host's mount table is untouched)."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    code = "import sys; from kvbm_backend.io import probe_o_direct; print(probe_o_direct(sys.argv[1]))"
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           f'mount -t ramfs none "$1" && exec "{sys.executable}" -c "{code}" "$1"', "sh", str(mnt)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if r.returncode != 0 and "mount" in r.stderr and "False" not in r.stdout:
        pytest.skip(f"cannot mount ramfs in a private namespace here: {r.stderr.strip()[:200]}")
    assert r.stdout.strip() == "False", r.stderr


def test_baseline_and_engine_comparison_run(tmp_path):
    """The benchmark functions measure real I/O (small sizes here), verify the bytes, and report ratios
    against the baseline of the same run."""
    from kvbm_backend.apps.bench.baseline import odirect_baseline
    from kvbm_backend.apps.bench.engines import compare_engines

    b = odirect_baseline(str(tmp_path), 8 * MiB, 256 * K4, 4)
    assert b["o_direct"] is True
    assert b["write_s"] > 0 and b["read_s"] > 0
    assert b["write_gbps"] == pytest.approx(8 * MiB / b["write_s"] / 1e9)
    variants = ("posix",) if NIXL_SKIP else ("posix", "nixl", "nixl_batched")
    res = compare_engines(str(tmp_path), 8 * MiB, 256 * K4, 4, variants=variants)
    for v in variants:
        assert res[v]["write_ratio"] == pytest.approx(res[v]["write_gbps"] / res["baseline"]["write_gbps"])
        assert res[v]["read_gbps"] > 0
    assert os.listdir(tmp_path) == []  # temp files removed
    with pytest.raises(ValueError, match="io_size"):
        odirect_baseline(str(tmp_path), 8 * MiB, 1000, 4)
    with pytest.raises(ValueError, match="total_bytes"):
        odirect_baseline(str(tmp_path), 8 * MiB + K4, 256 * K4, 4)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_baseline_buffered_fallback_where_o_direct_refused(tmp_path):
    """On a ramfs (no O_DIRECT) the baseline runs buffered and says so: run in a private mount
    namespace; skipped where that is not possible."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a private ramfs")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    code = ("import sys, json; from kvbm_backend.apps.bench.baseline import odirect_baseline; "
            "print(json.dumps(odirect_baseline(sys.argv[1], 4 << 20, 1 << 20, 2)))")
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           f'mount -t ramfs none "$1" && exec "{sys.executable}" -c "{code}" "$1"', "sh", str(mnt)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if r.returncode != 0 and "mount" in r.stderr and not r.stdout:
        pytest.skip(f"cannot mount ramfs in a private namespace here: {r.stderr.strip()[:200]}")
    import json

    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["o_direct"] is False
    assert res["read_gbps"] > 0


@pytest.mark.skipif(NIXL_SKIP is not None, reason=str(NIXL_SKIP))
def test_nixl_driver_failure_fails_futures_not_hangs(tmp_path):
    """If the NIXL driver thread dies (here: a bug injected into its job set-up), every queued Future
    fails with OSError instead of hanging, and later submits fail at once."""
    from kvbm_backend.io.nixl_engine import NixlEngine

    eng = NixlEngine(threads=2)
    fd = open_file(str(tmp_path / "f"), o_direct=True, size=MiB)
    try:
        assert eng.submit([IoOp(fd, 0, [aligned_zeros(K4)], write=True)]).result(timeout=HANG_S) == [K4]
        def bug(job):
            raise ZeroDivisionError("injected driver bug")

        eng._start = bug
        f1 = eng.submit([IoOp(fd, 0, [aligned_zeros(K4)], write=True)])
        with pytest.raises(OSError, match="driver stopped"):
            f1.result(timeout=HANG_S)
        with pytest.raises(OSError):
            eng.submit([IoOp(fd, 0, [aligned_zeros(K4)], write=False)]).result(timeout=HANG_S)
    finally:
        eng.close()
        os.close(fd)


@pytest.mark.skipif(NIXL_SKIP is not None, reason=str(NIXL_SKIP))
@pytest.mark.parametrize("queue_depth,threads", [(1, 1), (3, 2), (1024, 8)])
def test_nixl_grouping_round_trip(tmp_path, queue_depth, threads):
    """Ops with more buffers than the per-transfer descriptor limit, and many small ops, are split
    into NIXL transfers correctly for any queue depth / transfers in flight."""
    rng = np.random.default_rng(5)
    eng = make_engine("nixl", threads=threads, queue_depth=queue_depth)
    fd = open_file(str(tmp_path / "f"), o_direct=True)
    try:
        bufs = [_rand(rng, K4 * (1 + i % 4)) for i in range(40)]
        ops = [IoOp(fd, 0, bufs[:7], write=True)]  # 7 buffers in one op
        pos = sum(b.nbytes for b in bufs[:7])
        for b in bufs[7:]:
            ops.append(IoOp(fd, pos, [b], write=True))
            pos += b.nbytes
        assert eng.submit(ops).result(timeout=HANG_S) == [op.nbytes for op in ops]
        back = aligned_zeros(pos)
        assert eng.submit(coalesce([Extent(fd, 0, [back])], 5 * K4, write=False)).result(timeout=HANG_S)
        assert np.array_equal(back, np.concatenate(bufs))
    finally:
        eng.close()
        os.close(fd)


@pytest.mark.parametrize("engine_name", ENGINE_NAMES)
def test_concurrent_submits_across_files_round_trip(tmp_path, engine_name):
    """Regression (NIXL 1.5.1 shared fd registration): 32 jobs of 16 x 256 KiB O_DIRECT writes over 4
    files, all submitted at once on one engine, then 32 jobs of reads (each job reading another job's
    blocks, so jobs on the same fds overlap in time): every job succeeds and every byte comes back.
    Before the fix, a finished nixl job deregistered an fd registration that later jobs' prepared
    transfers still pointed at, and 24 of 32 writes failed with EBADF from io_submit."""
    rng = np.random.default_rng(6)
    n_jobs, per_job, size, n_files = 32, 16, 64 * K4, 4  # 256 KiB blocks, 128 MiB in all
    eng = make_engine(engine_name, threads=8)
    fds = [open_file(str(tmp_path / f"f{i}"), o_direct=True, size=n_jobs * per_job * size // n_files)
           for i in range(n_files)]
    try:
        src = [_rand(rng, size) for _ in range(n_jobs * per_job)]

        def where(k):  # block k -> (fd, offset): round-robin over the files
            return fds[k % n_files], (k // n_files) * size

        def job_ops(j, bufs, write):
            return [IoOp(*where(j * per_job + i), [bufs[j * per_job + i]], write) for i in range(per_job)]

        futs = [eng.submit(job_ops(j, src, True)) for j in range(n_jobs)]
        errors = []
        for f in futs:
            try:
                assert f.result(timeout=HANG_S) == [size] * per_job
            except OSError as e:
                errors.append(e)
        assert not errors, f"{len(errors)} of {n_jobs} write jobs failed, first: {errors[0]}"
        back = [aligned_zeros(size) for _ in src]
        order = rng.permutation(n_jobs)
        futs = [eng.submit(job_ops(int(j), back, False)) for j in order]
        assert all(f.result(timeout=HANG_S) == [size] * per_job for f in futs)
        bad = [k for k, (a, b) in enumerate(zip(src, back)) if not np.array_equal(a, b)]
        assert not bad, f"{len(bad)} blocks differ, first {bad[:5]}"
        if engine_name == "nixl":
            assert len(eng._files) == 0  # every shared fd registration released with its last job
    finally:
        eng.close()
        for fd in fds:
            os.close(fd)


@pytest.mark.skipif(NIXL_SKIP is not None, reason=str(NIXL_SKIP))
def test_nixl_logs_stay_off_stdout(tmp_path):
    """A process that uses the nixl engine prints only its own output on stdout: NIXL's INFO lines
    are quietened and its warnings go to stderr (NIXL 1.5.1 logs INFO to stdout by default)."""
    code = (
        "import json, logging, os, sys\n"
        "from kvbm_backend.io import IoOp, make_engine, open_file\n"
        "from kvbm_backend.memory import aligned_zeros\n"
        "eng = make_engine('nixl')\n"
        "fd = open_file(os.path.join(sys.argv[1], 'f'), o_direct=True, size=1 << 20)\n"
        "n = eng.submit([IoOp(fd, 0, [aligned_zeros(1 << 20)], True)]).result(timeout=600)\n"
        "logging.getLogger('nixl.api').warning('probe-warning')\n"
        "eng.close()\n"
        "print(json.dumps({'engine': eng.name, 'bytes': n}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                       timeout=HANG_S, env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stderr
    import json

    assert json.loads(r.stdout) == {"engine": "nixl", "bytes": [1 << 20]}, r.stdout
    assert "probe-warning" in r.stderr
    assert "NIXL INFO" not in r.stderr + r.stdout


def test_doctor_engine_choice_says_auto_falls_back_to_posix():
    """doctor: with g3.engine=auto and NIXL unable to start, auto really builds posix (make_engine's
    fallback), so doctor reports posix and why; an explicit nixl still says it will fail."""
    from kvbm_backend.config import KvbmBackendConfig
    from kvbm_backend.apps.doctor import engine_choice
    from kvbm_backend.io import AUTO_ENGINE

    nixl = {"posix_backend": "failed: injected reason"}
    out = engine_choice(KvbmBackendConfig.model_validate({"g3": {"engine": "auto"}}), {}, {}, nixl, [])
    if AUTO_ENGINE == "nixl":
        assert out["g3_engine"] == "posix"
        assert "falls back to posix" in out["g3_engine_why"] and "injected reason" in out["g3_engine_why"]
    assert "WILL FAIL" not in out["g3_engine_why"]
    out = engine_choice(KvbmBackendConfig.model_validate({"g3": {"engine": "nixl"}}), {}, {}, nixl, [])
    assert out["g3_engine"] == "nixl" and "WILL FAIL: failed: injected reason" in out["g3_engine_why"]


def test_a_read_and_a_write_in_one_submit_each_go_their_way(engine, tmp_path):
    """The IoOp contract allows reads and writes in one submit. Review finding (2026-11-29): NIXL gave a group
    of ops its first op's direction, so a read op beside a write wrote the read buffer over the file and
    reported the read complete (the planner never mixes them today)."""
    fd = open_file(str(tmp_path / "mixed"), o_direct=True, size=8 * K4)
    try:
        old = aligned_empty(K4)
        old[:] = 0xAA
        os.pwritev(fd, [old], 4 * K4)
        w, r = aligned_empty(K4), aligned_empty(K4)
        w[:], r[:] = 0x11, 0x55
        assert engine.submit([IoOp(fd, 0, [w], write=True), IoOp(fd, 4 * K4, [r], write=False)]).result(20) == [K4, K4]
        back = aligned_empty(2 * K4)
        os.preadv(fd, [back[:K4], back[K4:]], 0), os.preadv(fd, [back[K4:]], 4 * K4)
        assert (r == 0xAA).all() and (back[:K4] == 0x11).all() and (back[K4:] == 0xAA).all()
    finally:
        os.close(fd)


def test_a_strided_buffer_is_refused_einval_and_nothing_outside_it_is_touched(engine, tmp_path):
    """Review finding (2026-11-29): NIXL took (address, nbytes) of a strided view and read the file over the
    memory between its elements (2,048 bytes outside the view overwritten, success reported); posix raised a
    TypeError the interface does not promise. Both now fail the Future with EINVAL."""
    path = str(tmp_path / "strided")
    with open(path, "wb") as f:
        f.write(b"\x22" * 2 * K4)
    fd = os.open(path, os.O_RDWR)
    try:
        big = np.full(2 * K4, 0x77, np.uint8)
        view = big[::2]  # 4 KiB of elements, 8 KiB of memory
        with pytest.raises(OSError) as e:
            engine.submit([IoOp(fd, 0, [view], write=False)]).result(20)
        assert e.value.errno == errno.EINVAL
        assert (big == 0x77).all()
    finally:
        os.close(fd)


@pytest.mark.skipif(NIXL_SKIP is not None, reason=str(NIXL_SKIP))
def test_nixl_refuses_an_op_of_more_than_iov_max_buffers_instead_of_hanging(tmp_path):
    """Review finding (2026-11-29): an op of more than 65,536 buffers was never posted (NIXL's descriptor pool)
    and never failed: its Future hung, close() never returned, the driver thread spun a core. Posix answers
    EINVAL above IOV_MAX (1,024); NIXL now does the same."""
    from kvbm_backend.io.base import IOV_MAX
    fd = open_file(str(tmp_path / "many"), o_direct=False, size=(IOV_MAX + 1) * 16)
    eng = make_engine("nixl", threads=2)
    try:
        bufs = [np.zeros(16, np.uint8) for _ in range(IOV_MAX + 1)]
        with pytest.raises(OSError) as e:
            eng.submit([IoOp(fd, 0, bufs, write=True)]).result(60)
        assert e.value.errno == errno.EINVAL and "IOV_MAX" in str(e.value)
        ok = [np.full(16, 3, np.uint8) for _ in range(IOV_MAX)]
        assert eng.submit([IoOp(fd, 0, ok, write=True)]).result(60) == [16 * IOV_MAX]
    finally:
        eng.close()
        os.close(fd)
