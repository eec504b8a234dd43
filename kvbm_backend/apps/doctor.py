"""``kvbm-backend doctor``: what this machine can do for the G3/G4 pools and the GPU path, probed,
not assumed.

Sections of the result (:func:`run_doctor`):

* ``gpu``: torch and its CUDA build, devices, ``libcuda.so.1`` loadable + ``cuInit``, ``nvidia-smi``.
* ``gds``: the ``nvidia-fs`` kernel module (``/proc/driver/nvidia-fs``), ``cufile.json`` (path from
  ``CUFILE_ENV_PATH_JSON`` or ``/etc/cufile.json``; the keys that decide GDS vs compat), libcufile.
* ``kvikio``: installed/version, compat mode (setting and kvikio's decision), usable here + reason.
* ``nixl``: version, every plugin NIXL's agent lists with whether its library loads (and what is
  missing), whether the POSIX backend starts, whether GDS_MT is usable.
* ``paths``: per given or configured path: filesystem type, O_DIRECT (a real aligned write/read probe
  via :func:`kvbm_backend.io.probe_o_direct`), free and total bytes. A missing directory is probed at
  its nearest existing ancestor (where the pool would create it) and says so. Each G3 directory is judged
  by the G3 pool's own open rules (:mod:`.doctor_paths`: writable directory, O_DIRECT decision, room for
  a slot and for the path's share of ``g3.capacity_gb``); a ``--path`` that is a URL other than a
  ``file:`` URL of an absolute path (``file:///path``, ``file:/path``, ``file://localhost/path``: that path, a
  G4 root) is refused (ConfigError).
* ``modes``: ``{"checked": [...], "problems": [...], "notes": [...]}``: every G3 directory, ``file://`` G4
  root and the keyring (file, lock, KEK file and directory) looked at, and one line per path whose mode
  gives group or others access (:func:`kvbm_backend.fsmodes.mode_problems`; everything kvbm-backend creates
  is 0600/0700, but a directory that already existed keeps its mode). What the code accepts is a note, not
  a problem: a store directory others may list but not write (0755: kubelet's ``hostPath``
  ``DirectoryOrCreate``), and a keyring directory the keyring's own rule
  (:func:`kvbm_backend.fsmodes.check_trusted_dir`) accepts (a Kubernetes Secret volume's tmpfs, 1777).
* ``engine``: the G3 I/O engine ``make_engine`` will build from the config and why; the device load
  path (``gds`` / ``kvikio-compat`` / ``pinned-bounce`` / none) and why.
* ``g4``: the configured G4 store and keyring, probed (:func:`kvbm_backend.apps.doctor_g4.g4_info`: URL,
  endpoint reachable, credentials, bucket, a create-exclusive put/delete of a probe object, keyring
  loads with its KEK).
* ``config``: the config file's absolute path, ``"inline JSON"`` (never the text: it may carry
  credentials), or None.
* ``problems`` / ``verdict``: every problem found (G4 checks, file modes, a G3 path the pool cannot use,
  a configured engine that will fail), one line each (a keyring path both the G4 ``keyring`` check and the
  mode check refuse is one line: :func:`report_problems`; ``modes["problems"]`` still lists it), and ``"OK"`` or ``"N problems"``; ``kvbm-backend doctor`` exits 1 when
  there is any.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import subprocess
from typing import Any

CUFILE_KEYS = (
    "properties.allow_compat_mode", "properties.use_poll_mode", "properties.poll_mode_max_size_kb",
    "properties.max_direct_io_size_kb", "properties.max_device_cache_size_kb",
    "properties.max_device_pinned_mem_size_kb", "properties.use_pci_p2pdma", "properties.gds_rdma_write_support",
    "execution.max_io_threads", "execution.parallel_io", "execution.max_io_queue_depth",
    "fs.generic.posix_unaligned_writes", "fs.lustre.posix_gds_min_kb", "fs.nfs.posix_gds_min_kb", "logging.level",
)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ---- GPU and driver ------------------------------------------------------------------------------
def gpu_info() -> dict:
    """torch / CUDA / driver facts. Never raises."""
    out: dict[str, Any] = {}
    try:
        from kvbm_backend.workdir import outside_removed_workdir
        with outside_removed_workdir():  # torch's oneMKL ends the process in a removed working directory
            import torch
        out["torch"] = torch.__version__
        out["torch_cuda_build"] = torch.version.cuda
        out["cuda_available"] = bool(torch.cuda.is_available())
        devs = []
        if out["cuda_available"]:
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                devs.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                             "capability": f"{p.major}.{p.minor}"})
        out["devices"] = devs
    except Exception as e:  # noqa: BLE001
        out["torch"] = None
        out["cuda_available"] = False
        out["torch_error"] = _err(e)
        out["devices"] = []
    from kvbm_backend.io.kvikio_engine import _libcuda_status
    ok, why = _libcuda_status()
    out["libcuda_loadable"] = ok or not why.startswith("libcuda.so.1 not loadable")
    out["cuinit_ok"] = ok
    out["driver_detail"] = "libcuda.so.1 loaded, cuInit(0) succeeded" if ok else why
    smi = shutil.which("nvidia-smi")
    out["nvidia_smi"] = smi
    if smi:
        try:
            r = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            out["nvidia_smi_output"] = (r.stdout or r.stderr).strip()
        except (OSError, subprocess.SubprocessError) as e:
            out["nvidia_smi_output"] = _err(e)
    return out


# ---- cuFile / GDS --------------------------------------------------------------------------------
def _strip_json_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(re.sub(r'^((?:[^"\n]|"(?:\\.|[^"\\])*")*?)\s*//.*$', r"\1", ln) for ln in text.splitlines())


def cufile_json_info(path: str | None = None) -> dict:
    """Locate and read cufile.json (JSON with ``//`` comments, as NVIDIA ships it): ``path``,
    ``source`` (env or default), ``exists``, ``keys`` (the subset of :data:`CUFILE_KEYS` present) or
    ``error``."""
    src = "argument" if path else ("CUFILE_ENV_PATH_JSON" if os.environ.get("CUFILE_ENV_PATH_JSON") else "default")
    path = path or os.environ.get("CUFILE_ENV_PATH_JSON") or "/etc/cufile.json"
    out: dict[str, Any] = {"path": path, "source": src, "exists": os.path.isfile(path)}
    if not out["exists"]:
        return out
    try:
        with open(path) as f:
            data = json.loads(_strip_json_comments(f.read()))
    except (OSError, ValueError) as e:
        out["error"] = _err(e)
        return out
    keys = {}
    for k in CUFILE_KEYS:
        d: Any = data
        for part in k.split("."):
            if not isinstance(d, dict) or part not in d:
                d = None
                break
            d = d[part]
        if d is not None:
            keys[k] = d
    out["keys"] = keys
    return out


def gds_info() -> dict:
    out: dict[str, Any] = {}
    ver = "/proc/driver/nvidia-fs/version"
    if os.path.exists("/proc/driver/nvidia-fs"):
        try:
            with open(ver) as f:
                out["nvidia_fs"] = f"loaded ({f.read().strip().splitlines()[0]})"
        except OSError:
            out["nvidia_fs"] = "loaded (/proc/driver/nvidia-fs present)"
        out["nvidia_fs_loaded"] = True
    else:
        loaded = os.path.isdir("/sys/module/nvidia_fs")
        out["nvidia_fs_loaded"] = loaded
        out["nvidia_fs"] = ("module present in /sys/module, /proc/driver/nvidia-fs missing" if loaded else
                            "not loaded (/proc/driver/nvidia-fs missing): cuFile can only run in compat mode")
    out["cufile_json"] = cufile_json_info()
    try:
        import kvikio.cufile_driver as cfd
        maj, mnr = cfd.libcufile_version()
        out["libcufile"] = f"{maj}.{mnr}" if (maj, mnr) != (0, 0) else "not found"
    except Exception as e:  # noqa: BLE001
        out["libcufile"] = f"unknown ({_err(e)})"
    return out


# ---- kvikio --------------------------------------------------------------------------------------
def kvikio_info() -> dict:
    from kvbm_backend.io.kvikio_engine import kvikio_available, kvikio_mode
    out = kvikio_mode()
    ok, why = kvikio_available()
    out["usable"] = ok
    out["usable_detail"] = why
    return out


# ---- NIXL ----------------------------------------------------------------------------------------
def nixl_info() -> dict:
    out: dict[str, Any] = {}
    try:
        from kvbm_backend.workdir import outside_removed_workdir
        with outside_removed_workdir():  # it imports torch (gpu_info)
            import nixl._api  # noqa: F401 - configures the "nixl" logger on import; quieten it afterwards
    except Exception:  # noqa: BLE001 - reported below
        pass
    nl = logging.getLogger("nixl")
    old = nl.level
    nl.setLevel(logging.ERROR)  # NIXL logs INFO/WARNING for every agent and unavailable plugin
    try:
        try:
            from importlib.metadata import version
            out["version"] = version("nixl-cu12")
        except Exception:  # noqa: BLE001
            out["version"] = None
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except Exception as e:  # noqa: BLE001
            out["installed"] = False
            out["error"] = _err(e)
            return out
        out["installed"] = True
        from kvbm_backend.io.nixl_gds import gds_mt_available, plugin_load_error
        try:
            from kvbm_backend.io.nixl_engine import quiet_nixl_logging
            quiet_nixl_logging()
            agent = nixl_agent(f"kvbm-doctor-{os.getpid()}", nixl_agent_config(enable_prog_thread=False, backends=[]))
            names = list(agent.get_plugin_list())
        except Exception as e:  # noqa: BLE001
            out["error"] = _err(e)
            names = []
        plugins = {}
        for n in names:
            err = plugin_load_error(n)
            plugins[n] = "loads" if err is None else f"does not load: {err}"
        out["plugins"] = plugins
        try:
            from kvbm_backend.io.nixl_engine import nixl_unavailable_reason
            r = nixl_unavailable_reason()
        except ImportError as e:
            r = _err(e)
        out["posix_backend"] = "starts" if r is None else r
        ok, why = gds_mt_available()
        out["gds_mt"] = f"usable ({why})" if ok else f"not usable: {why}"
        out["gds_mt_usable"] = ok
        return out
    finally:
        nl.setLevel(old)


# ---- paths (doctor_paths.py) ---------------------------------------------------------------------
from .doctor_paths import fs_type, path_info  # noqa: E402,F401 - re-exported: doctor's API since before the split


# ---- engine choice -------------------------------------------------------------------------------
def engine_choice(cfg, gpu: dict, kvk: dict, nixl: dict, paths: list[dict]) -> dict:
    from kvbm_backend.io import AUTO_ENGINE
    want = cfg.g3.engine
    name = AUTO_ENGINE if want == "auto" else want
    out: dict[str, Any] = {"g3_engine_configured": want}
    if want == "auto":
        why = (f"auto = {AUTO_ENGINE} (kvbm_backend.io.AUTO_ENGINE, chosen by measurement: see "
               "kvbm_backend/io/__init__.py)")
    else:
        why = "configured"
    if name == "nixl" and nixl.get("posix_backend") != "starts":
        reason = nixl.get("posix_backend") or nixl.get("error")
        if want == "auto":  # make_engine("auto") falls back to posix where NIXL cannot start
            name = "posix"
            why += f"; NIXL cannot start here ({reason}), so auto falls back to posix"
        else:
            why += f"; WILL FAIL: {reason}"
    if name == "kvikio" and not kvk.get("usable"):
        why += f"; WILL FAIL: {kvk.get('usable_detail')}"
    out["g3_engine"] = name
    out["g3_engine_why"] = why
    od = cfg.g3.o_direct
    out["o_direct_setting"] = od
    out["o_direct_used"] = {p["path"]: (p.get("o_direct") if od == "auto" else od == "on") for p in paths}
    if not gpu.get("cuda_available"):
        out["device_path"] = "none"
        out["device_path_why"] = ("no CUDA device: the connector loads KV through the G3 pool's device reader in "
                                  "host mode (same code, CPU tensors), no storage->HBM path here")
    elif cfg.g3.device_path == "pinned-bounce":
        out["device_path"] = "pinned-bounce"
        out["device_path_why"] = "forced by g3.device_path"
    elif not kvk.get("usable"):
        out["device_path"] = "pinned-bounce"
        out["device_path_why"] = f"kvikio unusable ({kvk.get('usable_detail')}): pinned host bounce + H2D copy"
    else:
        probe_dir = next((p.get("probed_at", p["path"]) for p in paths if p.get("o_direct") is not None), None)
        if probe_dir is None:
            out["device_path"] = kvk.get("io")
            out["device_path_why"] = "not probed (no writable path): " + str(kvk.get("reason"))
        else:
            from kvbm_backend.gpu.probe import probe_device_path
            try:
                r = probe_device_path(probe_dir, "cuda", prefer=cfg.g3.device_path)
                out["device_path"], out["device_path_why"] = r.mode, f"probed in {probe_dir}: {r.reason}"
            except Exception as e:  # noqa: BLE001
                out["device_path"], out["device_path_why"] = "pinned-bounce", f"probe failed: {_err(e)}"
    out["nixl_gds_mt"] = "selectable" if nixl.get("gds_mt_usable") else "not selected: " + str(nixl.get("gds_mt"))
    return out


def modes_info(paths: list[str], keyring_paths: list[str], owners: dict[str, str] | None = None) -> dict:
    """Mode check of store directories (``paths``, ``file://`` allowed, walked) and keyring files (each
    and its directory). Never raises.

    A store directory group/others may list but not write (0755) is a note, not a problem (the G3 pool's
    rule, :func:`kvbm_backend.fsmodes.dir_problem`, accepts it). A keyring's directory is judged by the
    keyring's own rule (:func:`kvbm_backend.fsmodes.check_trusted_dir`: this uid or root, not writable by
    others unless sticky, e.g. a Kubernetes Secret volume's tmpfs root, 1777): a problem when it refuses,
    a note when it accepts a mode wider than 0700. Returns ``{"checked", "problems", "notes"}``; ``owners`` (a
    dict, filled) maps each problem of a keyring path (its directory, file, lock, KEK file) to that path."""
    from kvbm_backend.fsmodes import UnsafePath, WorkdirRemoved, abspath, check_trusted_dir, mode_problems

    from .doctor_paths import local_dir
    checked: list[str] = []
    problems: list[str] = []
    notes: list[str] = []
    own = owners if owners is not None else {}
    for p in paths:
        p = local_dir(p)
        if "://" in p:
            continue
        try:
            ap = abspath(os.path.expanduser(p))
        except WorkdirRemoved:  # relative, the working directory removed: names nothing (path_info says so)
            continue
        checked.append(p)
        problems += mode_problems(ap, notes=notes)
    for k in keyring_paths:
        try:
            k = abspath(os.path.expanduser(k))
        except WorkdirRemoved:  # the G4 keyring check names it (doctor_g4)
            continue
        d = os.path.dirname(k)
        if d not in checked:
            checked.append(d)
            try:
                check_trusted_dir(d, "keyring")
                mode = stat.S_IMODE(os.stat(d).st_mode)
                if mode & 0o077:
                    notes.append(f"{d}: directory mode {mode:04o}: the keyring's rule accepts it (owner this uid "
                                 "or root; not writable by others, or sticky: no one else can replace its files)")
            except UnsafePath as e:
                problems.append(str(e))
                own[str(e)] = d
            except FileNotFoundError:
                pass
            except OSError as e:
                problems.append(f"{d}: cannot stat ({e.strerror})")
        for q in (k, f"{k}.lock", f"{k}.kek"):
            if q not in checked:
                checked.append(q)
                for x in mode_problems(q, max_entries=0):
                    if x not in problems:
                        problems.append(x)
                        own[x] = q
    return {"checked": checked, "problems": problems, "notes": notes}


def report_problems(g4: dict, mode_problems: list[str], owners: dict[str, str]) -> list[str]:
    """The report's G4 and mode problem lines, each keyring path in one line: a mode problem of a keyring path
    (``owners``: problem -> path, from :func:`modes_info`) that the failed G4 ``keyring`` check names too is
    folded into that check's line (``"; mode: ..."`` added when its text is not the check's own), not a
    second line. Before 2026-11-30 a keyring directory or file with a loose mode was two problems (the G4
    check's refusal and the mode check's line) and counted twice in the verdict."""
    row = next((r for r in g4.get("checks", []) if r["check"] == "keyring" and r["ok"] is False), None)
    folded: list[str] = []
    rest: list[str] = []
    for m in mode_problems:
        p = owners.get(m)
        # the path as a whole word of the check's text: /d/keyring.json is not /d/keyring.json.kek
        named = p is not None and row is not None and re.search(
            rf"(?<![\w./-]){re.escape(p)}(?![\w/-]|\.\w)", row["detail"]) is not None
        if not named:
            rest.append(f"mode: {m}")
        elif row is not None and m != row["detail"]:
            folded.append(m)
    out = []
    for line in g4.get("problems", []):
        if row is not None and folded and line == f"g4 keyring: {row['detail']}":
            line += "".join(f"; mode: {m}" for m in folded)
        out.append(line)
    return out + rest


def run_doctor(paths: list[str], config: str | None = None) -> dict:
    """Probe this machine.

    Args:
        paths: directories to probe (G3 directories, ``file://`` G4 roots); the config's G3 paths and
            file:// G4 URL are added.
        config: a config file (YAML/TOML/JSON) or inline JSON; None: defaults plus environment.
    Returns:
        ``{"gpu", "gds", "kvikio", "nixl", "paths", "modes", "engine", "g4", "config", "problems",
        "verdict"}`` (see the module docstring); JSON-serialisable. ``config`` is the argument as given,
        URLs in it without credentials or query (:func:`kvbm_backend.pool.g4.store.redact_urls`).
    Raises:
        ConfigError: the config is invalid (message names the field), or a ``paths`` entry is a URL
            other than a ``file:`` URL of an absolute path (``file:///path``, ``file:/path``).
    """
    from kvbm_backend.config import load_config

    from .doctor_paths import check_path_arg, g3_path_problems, g4_path_problems, is_g4_root
    for p in paths:
        check_path_arg(p)
    cfg = load_config(config)
    g3_configured = list(cfg.g3.paths if (cfg.g3.enabled and (config or not paths)) else [])
    g4_url = cfg.g4.url if cfg.g4.enabled and cfg.g4.url and is_g4_root(cfg.g4.url) else None
    all_paths = list(dict.fromkeys(list(paths) + g3_configured + ([g4_url] if g4_url else [])))
    gpu = gpu_info()
    gds = gds_info()
    kvk = kvikio_info()
    nixl = nixl_info()
    pinfo = [path_info(p) for p in all_paths]
    kr = [x for x in ((cfg.g4.keyring.path if cfg.g4.enabled else None),
                      getattr(cfg.g4.keyring, "kek_file", None) if cfg.g4.enabled else None) if x]
    from .doctor_g4 import g4_info
    owners: dict[str, str] = {}
    modes = modes_info(all_paths, kr, owners)
    engine = engine_choice(cfg, gpu, kvk, nixl, pinfo)
    g4 = g4_info(cfg)
    problems = report_problems(g4, modes["problems"], owners)  # a keyring path the G4 check names: one line
    g3_dirs = [p for p in all_paths if not is_g4_root(p)]
    for p, info in zip(all_paths, pinfo):
        if not is_g4_root(p):  # a G3 directory: judged by the pool's own rules (doctor_paths)
            problems += g3_path_problems(info, cfg.g3, len(g3_configured) if p in g3_configured else len(g3_dirs),
                                         configured=p in g3_configured)
        elif p != g4_url:  # the configured store is probed by g4_info (a real put)
            problems += g4_path_problems(info)
    if "WILL FAIL" in engine.get("g3_engine_why", ""):
        problems.append(f"g3.engine {engine['g3_engine']}: {engine['g3_engine_why']}")
    return {"gpu": gpu, "gds": gds, "kvikio": kvk, "nixl": nixl, "paths": pinfo, "modes": modes,
            "engine": engine, "g4": g4, "config": config_label(config), "problems": problems, "verdict": verdict(problems)}


def config_label(config: str | None) -> str | None:
    """What the report names as its config: the file's absolute path, ``"inline JSON"`` for an inline config
    (never its text: it may carry credentials, e.g. an ``endpoint_url`` with ``USER:SECRET@``), or None."""
    if config is None:
        return None
    return "inline JSON" if config.lstrip().startswith("{") else os.path.abspath(config)


def verdict(problems: list[str]) -> str:
    """``"OK"``, or ``"N problems"`` (``"1 problem"``)."""
    n = len(problems)
    return "OK" if n == 0 else f"{n} problem{'' if n == 1 else 's'}"


# ---- rendering -----------------------------------------------------------------------------------
def _fmt(v) -> str:
    if isinstance(v, bool):
        return "[green]yes[/green]" if v else "[red]no[/red]"
    if v is None:
        return "-"
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)
    return str(v)


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:,.1f} GB"


def print_doctor(result: dict, console=None) -> None:
    """Rich tables of a :func:`run_doctor` result (stdout)."""
    from rich.console import Console
    from rich.table import Table
    console = console or Console()
    for section in ("gpu", "gds", "kvikio", "nixl"):
        t = Table(title=section.upper(), show_header=False, title_justify="left")
        t.add_column("key", style="bold")
        t.add_column("value", overflow="fold")
        for k, v in result.get(section, {}).items():
            if k == "plugins" and isinstance(v, dict):
                for pn, pv in v.items():
                    t.add_row(f"plugin {pn}", pv)
            elif k == "cufile_json" and isinstance(v, dict):
                t.add_row("cufile.json", f"{v['path']} ({v['source']}): " + ("present" if v["exists"] else "absent"))
                for kk, vv in (v.get("keys") or {}).items():
                    t.add_row(f"  {kk}", _fmt(vv))
                if v.get("error"):
                    t.add_row("  error", v["error"])
            elif k == "devices":
                for d in v:
                    t.add_row(f"cuda:{d['index']}", f"{d['name']}, {d['memory_gib']} GiB, sm {d['capability']}")
                if not v:
                    t.add_row("devices", "none")
            else:
                t.add_row(k, _fmt(v))
        console.print(t)
    t = Table(title="PATHS", title_justify="left")
    for c in ("path", "fs", "O_DIRECT", "free", "total", "note"):
        t.add_column(c)
    for p in result.get("paths", []):
        t.add_row(p["path"], p.get("fs_type", "?"), _fmt(p.get("o_direct")), _gb(p.get("free_bytes")),
                  _gb(p.get("total_bytes")), p.get("note") or p.get("o_direct_error") or "")
    console.print(t)
    modes = result.get("modes") or {}
    if modes.get("checked") and not modes.get("problems") and not modes.get("notes"):
        console.print(f"modes: {len(modes['checked'])} paths checked, all private (0600 files, 0700 directories)")
    for n in modes.get("notes") or []:
        console.print(f"note: mode: {n}", soft_wrap=True, highlight=False, markup=False)
    t = Table(title="ENGINE", show_header=False, title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value", overflow="fold")
    for k, v in result.get("engine", {}).items():
        t.add_row(k, _fmt(v))
    console.print(t)
    g4 = result.get("g4") or {}
    if g4.get("enabled"):
        t = Table(title=f"G4 {g4.get('url')}", title_justify="left")
        t.add_column("check")
        t.add_column("result")
        t.add_column("detail", overflow="fold")
        for r in g4.get("checks", []):
            ok = r["ok"]
            t.add_row(r["check"], "-" if ok is None else ("[green]ok[/green]" if ok else "[red]PROBLEM[/red]"),
                      r["detail"])
        console.print(t)
    else:
        console.print("g4: not enabled in the config (nothing checked)")
    from rich.text import Text
    for p in result.get("problems", []):  # plain, unwrapped lines: each problem greppable as one line
        console.print(Text.assemble(("problem", "red"), ": ", p), soft_wrap=True, highlight=False)
    console.print(result.get("verdict", "?"), soft_wrap=True, highlight=False)
