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
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    r = _unshare_sh(f"mount -t ramfs none {mnt} && chmod 700 {mnt}",
                    f"exec {sys.executable} -m kvbm_backend.apps.cli doctor --path {mnt} --json")
    rep = json.loads(r.stdout)
    p = rep["paths"][0]
    assert p["fs_type"] == "ramfs" and p["o_direct"] is False
    # a ramfs reports no free space (statvfs 0 of 0): a G3 pool gets no slot there, so it is a problem (exit 1)
    assert r.returncode == 1 and [x.split(":")[1] for x in rep["problems"]] == [" room for no slot"], rep["problems"]
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


# ---- G3 paths the pool cannot use: doctor's verdict agrees with G3Pool's open (review finding 2026-11-30: OK,
# exit 0, for a read-only, a full and a ramfs filesystem, a regular file, and `--path s3://...` probed as a
# local relative directory) ----------------------------------------------------------------------------------
def _json_cli(*args):
    r = _cli(*args, "--json")
    return r, (json.loads(r.stdout) if r.stdout.strip().startswith("{") else None)


def _open_pool_error(cfg_file) -> str | None:
    """G3Pool's open with the same config (the crash-writer namespace: 8 KiB blocks): None, or its error."""
    from tests.helpers.crash_writer import NS
    from kvbm_backend.config import load_config
    from kvbm_backend.pool.g3 import G3Pool
    try:
        G3Pool(load_config(str(cfg_file), use_env=False).g3, NS).close()
    except (ValueError, OSError) as e:
        return str(e)
    return None


@pytest.mark.slow
def test_a_file_and_a_path_under_a_file_are_problems(tmp_path):
    f = tmp_path / "trace.jsonl"
    f.write_text("{}\n")
    f.chmod(0o600)
    for p, why in ((f, "is a file, not a directory"), (f / "g3", f"{f} is a file: the directory cannot be created")):
        r, rep = _json_cli("--path", str(p))
        assert r.returncode == 1, r.stderr
        line = f"g3 path {p}: {why} under it" if "created" in why else f"g3 path {p}: {why}"
        # the path under a file also has its mode check's line (cannot stat), as before
        assert [x for x in rep["problems"] if not x.startswith("mode: ")] == [line], rep["problems"]
        assert "the pool creates it" not in rep["paths"][0]["note"]


@pytest.mark.slow
def test_a_url_other_than_file_is_refused_not_probed_as_a_local_directory(tmp_path):
    for p in ("s3://kvbm-test/p", "mem://x", "file://relative/p", ""):
        r = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", "doctor", "--json", "--path", p],
                           capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": REPO})
        assert r.returncode == 2 and r.stdout == "", (p, r.stdout[-500:])
        assert f"--path {p!r}" in r.stderr, r.stderr
    assert not any(tmp_path.iterdir())  # nothing created or probed under the current directory ("s3:/...")
    r, rep = _json_cli("--path", f"file://{tmp_path}")  # a file:// G4 root is still probed
    assert r.returncode == 0 and rep["paths"][0]["path"] == str(tmp_path), r.stderr


@pytest.mark.slow
def test_every_file_url_form_g4_url_accepts_is_probed_at_its_absolute_path(tmp_path):
    """``file:/abs`` (RFC 8089, one slash) and ``file://localhost/abs`` are the absolute ``/abs``, as ``g4.url``
    takes them; before 2026-11-30 doctor probed them as relative directories (``file:`` and ``localhost``) under
    the current one and reported that. ``file:relative`` and ``s3:/b`` are refused naming the value."""
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO}
    for p in (f"file:{root}", f"file://localhost{root}", f"file://{root}"):
        r = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", "doctor", "--json", "--path", p],
                           capture_output=True, text=True, timeout=HANG_S, cwd=cwd, env=env)
        assert r.returncode == 0, (p, r.stderr[-2000:])
        rep = json.loads(r.stdout)
        assert rep["paths"][0]["path"] == str(root) and rep["paths"][0]["exists"] is True, (p, rep["paths"])
        assert "probed_at" not in rep["paths"][0], (p, rep["paths"])
        assert rep["modes"]["checked"] == [str(root)], (p, rep["modes"])
    for p in ("file:relative", "s3:/kvbm-test/p", "file:/"):
        r = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", "doctor", "--json", "--path", p],
                           capture_output=True, text=True, timeout=HANG_S, cwd=cwd, env=env)
        assert r.returncode == 2 and r.stdout == "", (p, r.stdout[-500:])
        assert f"--path {p!r}" in r.stderr, r.stderr
    assert not any(cwd.iterdir())
    # a configured g4.url of that form is the G4 root doctor probes and mode-checks (not a relative directory)
    r, rep = _json_cli("--config", json.dumps({"g4": {"enabled": True, "url": f"file:{root}", "encrypt": False}}))
    assert str(root) in rep["modes"]["checked"] and f"file:{root}" not in rep["modes"]["checked"], rep["modes"]


def test_config_dir_is_not_a_config_file(tmp_path):
    r = _cli("--config", str(tmp_path))
    assert r.returncode == 2
    assert f"config file {tmp_path}: is a directory, not a config file" in r.stderr, r.stderr


@pytest.mark.slow
def test_no_room_for_a_slot_is_a_problem_exactly_when_the_pool_cannot_open(tmp_path):
    """A real directory and the real statvfs: a watermark above the free fraction leaves no room for a slot;
    doctor says so and G3Pool's open with the same config fails; with the default watermark both succeed."""
    g3 = tmp_path / "g3"
    g3.mkdir(mode=0o700)
    st = os.statvfs(g3)
    free_fraction = st.f_bavail / st.f_blocks
    if free_fraction > 0.999:
        pytest.skip(f"{g3}'s filesystem is {free_fraction:.2%} free: no watermark below 1 can be above that")
    cfg = tmp_path / "c.json"
    # the margin above the free fraction: as wide as the disk allows (up to 1% of it), so that other processes
    # freeing space between doctor's statvfs and the pool's open (a busy CI machine) do not make room
    margin = min(0.01, (1 - free_fraction) / 2)
    for mff, fits in ((round(free_fraction + margin, 4), False), (0.0, True)):
        cfg.write_text(json.dumps({"g3": {"paths": [str(g3)], "capacity_gb": 0.001, "min_free_fraction": mff}}))
        cfg.chmod(0o600)
        r, rep = _json_cli("--config", str(cfg))
        pool_error = _open_pool_error(cfg)
        if fits:
            assert r.returncode == 0 and rep["problems"] == [] and pool_error is None, (r.stderr, rep["problems"])
            assert rep["paths"][0]["room_bytes"] >= 10**6
        else:
            assert r.returncode == 1, r.stderr
            assert len(rep["problems"]) == 1 and rep["problems"][0].startswith(f"g3 path {g3}: room for no slot")
            assert pool_error is not None and "room for no slot" in pool_error


@pytest.mark.slow
def test_less_room_than_the_capacity_share_is_a_problem_that_says_so(tmp_path):
    g3a, g3b = tmp_path / "a", tmp_path / "b"
    g3a.mkdir(mode=0o700)
    g3b.mkdir(mode=0o700)
    st = os.statvfs(g3a)
    cap_gb = 2 * st.f_blocks * st.f_frsize / 1e9 * 1.5  # each path's share (cap/2) is 1.5x the filesystem
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"g3": {"paths": [str(g3a), str(g3b)], "capacity_gb": cap_gb}}))
    cfg.chmod(0o600)
    r, rep = _json_cli("--config", str(cfg))
    assert r.returncode == 1
    assert len(rep["problems"]) == 2, rep["problems"]
    for p, line in zip((g3a, g3b), rep["problems"]):
        assert line.startswith(f"g3 path {p}: room for ") and "less than its share of g3.capacity_gb" in line
        assert "over 2 paths): the pool opens with less" in line
    assert _open_pool_error(cfg) is None  # it opens, with less than capacity_gb


def _unshare_sh(setup: str, script: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``setup && script`` (sh) in a private mount namespace (``unshare --mount``), from the repository with
    ``env`` (default: this environment with PYTHONPATH the repository); skip where ``setup`` cannot run there
    (not root, no unshare(1), mounts refused)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to mount in a private mount namespace")
    ns = [unshare, "--mount", "--propagation", "private", "sh", "-c"]
    probe = subprocess.run(ns + [setup + " && echo ok"], capture_output=True, text=True, timeout=HANG_S)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount in a private mount namespace here: {probe.stderr.strip()[:200]}")
    return subprocess.run(ns + [f"{setup} && {script}"], capture_output=True, text=True, timeout=HANG_S, cwd=REPO,
                          env=env if env is not None else {**os.environ, "PYTHONPATH": REPO})


def _in_private_mounts(tmp_path, script: str) -> subprocess.CompletedProcess:
    """Run ``script`` (sh) in a private mount namespace in which tmp_path/full is a full 64 KiB tmpfs,
    tmp_path/ro a read-only tmpfs and tmp_path/ramfs a ramfs (all 0700); skip where that cannot be done."""
    for d in ("full", "ro", "ramfs"):
        (tmp_path / d).mkdir()
    setup = (f"mount -t tmpfs -o size=64k,mode=700 tmpfs {tmp_path}/full && "
             f"(dd if=/dev/zero of={tmp_path}/full/fill bs=4k count=100 2>/dev/null; chmod 600 {tmp_path}/full/fill) && "
             f"mount -t tmpfs -o ro,mode=700 tmpfs {tmp_path}/ro && mount -t ramfs -o mode=700 ramfs {tmp_path}/ramfs")
    r = _unshare_sh(setup, script)
    for d in ("full", "ro", "ramfs"):
        assert not any((tmp_path / d).iterdir())  # the namespace's mounts are gone; nothing leaked here
    return r


@pytest.mark.slow
def test_read_only_full_and_ramfs_paths_are_problems(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    doctor = f"{sys.executable} -m kvbm_backend.apps.cli doctor --json"
    script = " ; ".join(f"{doctor} --path {tmp_path}/{d} > {out}/{d}.json 2>{out}/{d}.err; echo $? > {out}/{d}.rc"
                        for d in ("ro", "full", "ramfs"))
    r = _in_private_mounts(tmp_path, script)
    assert r.returncode == 0, r.stderr
    res = {d: (int((out / f"{d}.rc").read_text()), json.loads((out / f"{d}.json").read_text()))
           for d in ("ro", "full", "ramfs")}
    rc, rep = res["ro"]
    assert rc == 1 and rep["problems"] == [f"g3 path {tmp_path}/ro: directory is not writable by this process "
                                           "(read-only filesystem)"], rep["problems"]
    for d in ("full", "ramfs"):
        rc, rep = res[d]
        assert rc == 1, (out / f"{d}.err").read_text()
        assert any(p.startswith(f"g3 path {tmp_path}/{d}: room for no slot: 0 bytes") for p in rep["problems"]), \
            rep["problems"]
    assert res["ramfs"][1]["paths"][0]["o_direct"] is False
    assert res["full"][1]["paths"][0]["free_bytes"] == 0


_POOL_OPEN = """
import sys
from tests.helpers.crash_writer import NS
from kvbm_backend.config import load_config
from kvbm_backend.pool.g3 import G3Pool
try:
    G3Pool(load_config(sys.argv[1], use_env=False).g3, NS).close()
    print("opened")
except (ValueError, OSError) as e:
    print("failed:", e)
"""


@pytest.mark.slow
def test_doctor_and_the_pool_agree_on_a_full_tmpfs_and_a_ramfs(tmp_path):
    """Via --config: doctor says a problem (exit 1) for the G3 configs whose pool cannot open; g3.o_direct on a
    ramfs (no O_DIRECT) is named."""
    out = tmp_path / "out"
    out.mkdir(mode=0o700)
    cases = {"full": {"paths": [f"{tmp_path}/full"]}, "ramfs": {"paths": [f"{tmp_path}/ramfs"]},
             "ramfs_on": {"paths": [f"{tmp_path}/ramfs"], "o_direct": "on"}}
    lines = []
    for name, g3 in cases.items():
        (out / f"{name}.cfg.json").write_text(json.dumps({"g3": {**g3, "capacity_gb": 1, "engine": "posix"}}))
        (out / f"{name}.cfg.json").chmod(0o600)
        lines.append(f"{sys.executable} -m kvbm_backend.apps.cli doctor --json --config {out}/{name}.cfg.json "
                     f"> {out}/{name}.json 2>{out}/{name}.err; echo $? > {out}/{name}.rc; "
                     f"{sys.executable} -c '{_POOL_OPEN}' {out}/{name}.cfg.json > {out}/{name}.pool")
    r = _in_private_mounts(tmp_path, " ; ".join(lines))
    assert r.returncode == 0, r.stderr
    for name in cases:
        rc, rep = int((out / f"{name}.rc").read_text()), json.loads((out / f"{name}.json").read_text())
        pool = (out / f"{name}.pool").read_text()
        assert pool.startswith("failed:") and "room for no slot" in pool, pool
        assert rc == 1 and rep["verdict"] != "OK", (out / f"{name}.err").read_text()
        assert any("room for no slot" in p for p in rep["problems"]), rep["problems"]
    on = json.loads((out / "ramfs_on.json").read_text())["problems"]
    assert any("g3.o_direct is on but ramfs refuses O_DIRECT" in p for p in on), on
    auto = json.loads((out / "ramfs.json").read_text())["problems"]
    assert not any("O_DIRECT" in p for p in auto), auto  # auto: buffered I/O there, no O_DIRECT problem


def _k8s_doctor_config(tmp_path, keyring_dir: str) -> str:
    """The examples/k8s ConfigMap's YAML with its G3 directory, G4 store (file://) and keyring mapped to temp
    paths (the keyring at ``keyring_dir``/keyring.json); returns the config file's path."""
    import yaml
    docs = list(yaml.safe_load_all(open(os.path.join(REPO, "examples", "k8s", "worker.yaml"))))
    cm = yaml.safe_load(next(d for d in docs if d and d["kind"] == "ConfigMap")["data"]["kvbm-backend.yaml"])
    cm["g3"].update(paths=[f"{tmp_path}/kvbm-g3"], capacity_gb=0.001)
    cm["g4"].update(url=f"file://{tmp_path}/store")
    cm["g4"].pop("endpoint_url", None)
    cm["g4"]["keyring"]["path"] = f"{keyring_dir}/keyring.json"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(cm))
    cfg.chmod(0o600)
    return str(cfg)


def _keys_create(keyring: str, env: dict) -> None:
    r = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", "keys", "create", "--keyring", keyring,
                        "--tenant", "TENANT", "--json"], capture_output=True, text=True, timeout=HANG_S, cwd=REPO,
                       env=env)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_doctor_accepts_the_k8s_secret_volume_and_hostpath_modes_the_code_accepts(tmp_path):
    """Deployment review: on examples/k8s as documented doctor always failed (exit 1): the keyring's directory,
    a Secret volume (a read-only tmpfs, mode 1777, kubelet's ``..data`` link layout), and a G3 ``hostPath``
    directory kubelet's DirectoryOrCreate makes 0755 were 'problems' with a 'chmod 700' fix, although the
    keyring (fsmodes.check_trusted_dir) and G3Pool accept both. Doctor now judges them by those rules: notes,
    exit 0; and the keyring really loads there and G3Pool really opens on the 0755 directory. Real CLI, a
    real tmpfs in a private mount namespace."""
    env = {**os.environ, "PYTHONPATH": REPO,
           "KVBM_BACKEND_KEK": __import__("base64").b64encode(os.urandom(32)).decode()}
    (tmp_path / "op").mkdir(mode=0o700)
    _keys_create(f"{tmp_path}/op/keyring.json", env)
    for d in ("mnt", "kvbm-g3", "store", "out"):
        (tmp_path / d).mkdir(mode=0o755)
    os.chmod(tmp_path / "kvbm-g3", 0o755)
    os.chmod(tmp_path / "store", 0o755)
    cfg = _k8s_doctor_config(tmp_path, f"{tmp_path}/mnt")
    m, ts, out = f"{tmp_path}/mnt", "..2026_11_30_07_45_00.000000001", f"{tmp_path}/out"
    setup = (f"mount -t tmpfs -o size=1m,mode=1777 tmpfs {m} && mkdir -m 755 {m}/{ts} && "
             f"cp {tmp_path}/op/keyring.json {m}/{ts}/ && chmod 400 {m}/{ts}/keyring.json && "
             f"ln -s {ts} {m}/..data && ln -s ..data/keyring.json {m}/keyring.json && mount -o remount,ro {m}")
    script = (f"{sys.executable} -m kvbm_backend.apps.cli doctor --json --config {cfg} > {out}/doc.json "
              f"2> {out}/doc.err; echo $? > {out}/doc.rc; {sys.executable} -c '{_POOL_OPEN}' {cfg} > {out}/pool")
    r = _unshare_sh(setup, script, env)
    assert r.returncode == 0, r.stderr
    assert not any((tmp_path / "mnt").iterdir())  # the namespace's mount is gone; nothing leaked here
    assert (tmp_path / "out" / "pool").read_text().strip() == "opened"  # G3Pool accepts the 0755 directory
    rep = json.loads((tmp_path / "out" / "doc.json").read_text())
    rc = int((tmp_path / "out" / "doc.rc").read_text())
    assert rc == 0 and rep["problems"] == [] and rep["verdict"] == "OK", rep["problems"]
    assert any(c["check"] == "keyring" and c["ok"] for c in rep["g4"]["checks"]), rep["g4"]  # it loads there
    notes = rep["modes"]["notes"]
    assert any(n.startswith(f"{m}: directory mode 1777: the keyring's rule accepts it") for n in notes), notes
    assert any(n.startswith(f"{tmp_path}/kvbm-g3: directory mode 0755 lets group/others list it") for n in notes), notes


def test_doctor_keeps_what_the_pool_and_keyring_refuse_as_problems(tmp_path):
    """The other side of the rule: a keyring directory others can write (0777, no sticky bit), a G3 directory
    others can write and one of another uid are problems (exit 1), as the keyring and G3Pool refuse them."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    env = {**os.environ, "PYTHONPATH": REPO,
           "KVBM_BACKEND_KEK": __import__("base64").b64encode(os.urandom(32)).decode()}
    (tmp_path / "kr").mkdir(mode=0o700)
    _keys_create(f"{tmp_path}/kr/keyring.json", env)
    os.chmod(tmp_path / "kr", 0o777)
    (tmp_path / "store").mkdir(mode=0o700)
    (tmp_path / "kvbm-g3").mkdir(mode=0o700)
    os.chmod(tmp_path / "kvbm-g3", 0o777)
    (tmp_path / "other").mkdir(mode=0o700)
    os.chown(tmp_path / "other", 4321, 4321)
    cfg = _k8s_doctor_config(tmp_path, f"{tmp_path}/kr")
    r = _cli("--json", "--config", cfg, "--path", f"{tmp_path}/other", env=env)
    assert r.returncode == 1, r.stderr
    probs = json.loads(r.stdout)["problems"]
    # the keyring directory is one problem (the keyring's own refusal, from the G4 check), not also a "mode:" line
    assert [p for p in probs if f"directory {tmp_path}/kr " in p] == [p for p in probs if p.startswith(
        f"g4 keyring: directory {tmp_path}/kr of the keyring is writable by group or others (mode 0777, and not "
        "sticky)")], probs
    assert f"mode: {tmp_path}/kvbm-g3: directory mode 0777 gives group/others access (fix: chmod 700 " \
           f"{tmp_path}/kvbm-g3)" in probs, probs
    assert any(p.startswith(f"g3 path {tmp_path}/other: directory is owned by uid 4321, not by this process")
               and "G3Pool's open refuses it" in p for p in probs), probs
    assert sum(p.startswith(f"g4 keyring: directory {tmp_path}/kr of the keyring is writable") for p in probs) == 1
    assert len(probs) == 3, probs  # those (before 2026-11-30 the keyring directory was a 4th, "mode:", line)
