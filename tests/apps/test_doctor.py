"""``kvbm-backend doctor`` tells the truth on this machine: no GPU (where there is none), O_DIRECT per
path from a real probe (ext4 yes; ramfs no; tmpfs yes only from Linux 6.6), NIXL's POSIX plugin found,
cufile.json read, and the engine it names matches what make_engine does."""
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys

import pytest

from kvbm_backend.apps.doctor import cufile_json_info, path_info, run_doctor

HANG_S = 600.0  # a hang guard, not a bound: waits for a process (a CLI run) that must end; returns as soon as it does (the unit lane runs at nice 19)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args, env=None, cmd_prefix=()):
    r = subprocess.run([*cmd_prefix, sys.executable, "-m", "kvbm_backend.apps.cli", "doctor", *args],
                       capture_output=True, text=True, timeout=HANG_S, cwd=REPO, env=env)
    return r


def _raw_o_direct(d: str) -> bool:
    """Independent check: open a file in d with O_DIRECT and do one aligned write+read."""
    p = os.path.join(d, "raw-odirect-check")
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, 4096)
        buf.write(b"x" * 4096)
        os.pwritev(fd, [buf], 0)
        os.preadv(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(p)


def _kernel() -> tuple[int, int]:
    parts = platform.release().split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("doctor")
    r = _cli("--path", str(d), "--path", str(d / "not" / "yet"), "--json")
    assert r.returncode == 0, r.stderr
    return d, json.loads(r.stdout)


def test_gpu_section_matches_reality(report):
    _, rep = report
    torch = pytest.importorskip("torch")
    assert rep["gpu"]["cuda_available"] == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert rep["gpu"]["devices"] == []
        assert rep["engine"]["device_path"] == "none"
    else:
        assert rep["gpu"]["devices"] and rep["engine"]["device_path"] in ("gds", "kvikio-compat", "pinned-bounce")
    try:
        import ctypes
        ctypes.CDLL("libcuda.so.1")
        has_driver = True
    except OSError:
        has_driver = False
    assert rep["gpu"]["libcuda_loadable"] == has_driver
    if not has_driver:
        assert "libcuda.so.1 not loadable" in rep["gpu"]["driver_detail"]
        assert rep["kvikio"]["usable"] is False or not rep["kvikio"]["installed"]
    assert rep["gds"]["nvidia_fs_loaded"] == (os.path.exists("/proc/driver/nvidia-fs")
                                              or os.path.isdir("/sys/module/nvidia_fs"))


def test_disk_dir_takes_o_direct_and_missing_dir_probes_its_ancestor(report):
    d, rep = report
    p0, p1 = rep["paths"]
    assert p0["path"] == str(d) and p0["exists"] is True
    assert p0["o_direct"] == _raw_o_direct(str(d))
    if p0["fs_type"] in ("ext4", "xfs", "btrfs"):
        assert p0["o_direct"] is True
    assert p0["free_bytes"] > 0 and p0["total_bytes"] >= p0["free_bytes"]
    assert p1["exists"] is False and p1["probed_at"] == str(d) and "nearest existing ancestor" in p1["note"]
    assert not os.path.exists(d / "not")  # doctor creates nothing


def test_nixl_posix_plugin_found_and_gds_mt_not_selected_without_gpu(report):
    _, rep = report
    pytest.importorskip("nixl")
    assert rep["nixl"]["installed"] is True
    assert rep["nixl"]["plugins"]["POSIX"] == "loads"
    assert rep["nixl"]["posix_backend"] == "starts"
    assert "GDS_MT" in rep["nixl"]["plugins"]
    if not rep["gpu"]["cuda_available"]:
        assert rep["nixl"]["gds_mt_usable"] is False
        assert rep["engine"]["nixl_gds_mt"].startswith("not selected")


def test_engine_named_is_the_one_make_engine_builds(report):
    _, rep = report
    from kvbm_backend.io import make_engine
    e = make_engine("auto")
    try:
        assert rep["engine"]["g3_engine"] == e.name
    finally:
        e.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this machine")
def test_tmpfs_o_direct_is_reported_truthfully():
    info = path_info("/dev/shm")
    assert info["fs_type"] == "tmpfs"
    # tmpfs accepts O_DIRECT since Linux 6.6; before that open() fails with EINVAL
    assert info["o_direct"] == (_kernel() >= (6, 6))
    assert info["o_direct"] == _raw_o_direct("/dev/shm")


def test_ramfs_refuses_o_direct(tmp_path):
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to mount a private ramfs")
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    probe = subprocess.run([unshare, "-m", "sh", "-c", f"mount -t ramfs none {mnt} && echo ok"],
                           capture_output=True, text=True, timeout=HANG_S)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount ramfs in a private mount namespace: {probe.stderr.strip()}")
    r = subprocess.run([unshare, "-m", "sh", "-c",
                        f"mount -t ramfs none {mnt} && chmod 700 {mnt} && exec {sys.executable} -m kvbm_backend.apps.cli doctor "
                        f"--path {mnt} --json"], capture_output=True, text=True, timeout=HANG_S, cwd=REPO)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)["paths"][0]
    assert p["fs_type"] == "ramfs" and p["o_direct"] is False
    assert not any(mnt.iterdir())  # the namespace's mount is gone; nothing leaked here


def test_cufile_json_with_comments_is_read(tmp_path, monkeypatch):
    cj = tmp_path / "cufile.json"
    cj.write_text("""{
        // NVIDIA ships cufile.json with comments
        "logging": { "level": "ERROR" },
        "properties": {
            "allow_compat_mode": true, // fall back to POSIX
            "max_direct_io_size_kb": 16384,
            "use_poll_mode": false
        },
        /* block comment */
        "execution": { "max_io_threads": 4, "parallel_io": true },
        "fs": { "generic": { "posix_unaligned_writes": false } }
    }""")
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(cj))
    info = cufile_json_info()
    assert info["source"] == "CUFILE_ENV_PATH_JSON" and info["exists"]
    assert info["keys"] == {"logging.level": "ERROR", "properties.allow_compat_mode": True,
                            "properties.max_direct_io_size_kb": 16384, "properties.use_poll_mode": False,
                            "execution.max_io_threads": 4, "execution.parallel_io": True,
                            "fs.generic.posix_unaligned_writes": False}
    cj.write_text("{ not json")
    assert "error" in cufile_json_info()
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(tmp_path / "absent.json"))
    assert cufile_json_info()["exists"] is False


def test_config_paths_and_engine_from_config(tmp_path):
    g3 = tmp_path / "g3a"
    g3.mkdir()
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"g3": {"paths": [str(g3)], "engine": "kvikio", "o_direct": "off"}}))
    rep = run_doctor([], str(cfg))
    assert [p["path"] for p in rep["paths"]] == [str(g3)]
    assert rep["engine"]["g3_engine"] == "kvikio"
    assert rep["engine"]["o_direct_used"] == {str(g3): False}
    if not rep["kvikio"]["usable"]:
        assert "WILL FAIL" in rep["engine"]["g3_engine_why"]
        assert rep["kvikio"]["usable_detail"] in rep["engine"]["g3_engine_why"]


def test_bad_config_is_a_clear_error_and_table_is_default(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"g3": {"engine": "fast"}}))
    r = _cli("--config", str(bad))
    assert r.returncode == 2 and "g3.engine" in r.stderr
    bad.chmod(0o600)  # tmp_path is probed below: a 0644 file in it is a mode problem (exit 1)
    r = _cli("--path", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for title in ("GPU", "GDS", "KVIKIO", "NIXL", "PATHS", "ENGINE", "O_DIRECT"):
        assert title in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "OK"


def test_config_dir_is_not_a_config_file(tmp_path):
    r = _cli("--config", str(tmp_path))
    assert r.returncode == 2
    assert f"config file {tmp_path}: is a directory, not a config file" in r.stderr, r.stderr
