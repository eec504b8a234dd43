"""Config tree: sources, KVBM env names, errors that name the field."""
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvbm_backend.config import ConfigError, env_overrides, load_config

HANG_S = 600.0  # a hang guard, not a bound: waits for a process (a CLI run) that must end; returns as soon as it does (the unit lane runs at nice 19)


def test_defaults_and_kvbm_env_names(tmp_path):
    cfg = load_config(None, environ={"DYN_KVBM_DISK_CACHE_DIR": "/nvme0/kv:/nvme1/kv", "DYN_KVBM_DISK_CACHE_GB": "500"})
    assert cfg.g3.paths == ["/nvme0/kv", "/nvme1/kv"]
    assert cfg.g3.capacity_gb == 500
    assert cfg.g3.admission.policy == "frequency"
    assert cfg.g4.encrypt is True


def test_generic_env_override_wins_over_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("g4:\n  url: s3://bkt/b\n  timeout_s: 1.5\n")
    cfg = load_config(p, environ={"KVBM_BACKEND__G4__TIMEOUT_S": "0.5"})
    assert cfg.g4.url == "s3://bkt/b" and cfg.g4.timeout_s == 0.5


@pytest.mark.parametrize("suffix,text", [(".toml", '[g3]\ncapacity_gb = 2.5\n'),
                                         (".json", json.dumps({"g3": {"capacity_gb": 2.5}}))])
def test_file_formats(tmp_path, suffix, text):
    p = tmp_path / f"c{suffix}"
    p.write_text(text)
    assert load_config(p, use_env=False).g3.capacity_gb == 2.5


def test_inline_json_like_kv_connector_extra_config():
    assert load_config('{"g3": {"io_size_bytes": 2097152}}', use_env=False).g3.io_size_bytes == 2 << 20


@pytest.mark.parametrize("src,field", [
    ({"g3": {"capacity_gb": 0}}, "g3.capacity_gb"),
    ({"g3": {"engine": "spdk"}}, "g3.engine"),
    ({"g4": {"timeout_s": "soon"}}, "g4.timeout_s"),
    ({"g3": {"capcity_gb": 1}}, "g3.capcity_gb"),
    ({"g3": {"admission": {"policy": "lfu"}}}, "g3.admission.policy"),
])
def test_errors_name_the_field(src, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(src, use_env=False)


def test_unreadable_file_named(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("g3: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


# --- strictness (issue 10): finite floats, bounded timeouts, usable G3 paths -------------------------

@pytest.mark.parametrize("field", ["g3.capacity_gb", "g3.load_timeout_s", "g3.min_free_fraction", "g4.timeout_s",
                                   "g4.breaker_reset_s", "g4.keyring.reload_interval_s"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), "inf", "Infinity", "NaN"])
def test_every_float_must_be_finite(field, value):
    # an infinite timeout would turn a hung store into a stalled decode (invariant 3)
    src: dict = {}
    *parents, leaf = field.split(".")
    d = src
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = value
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: Input should be a finite number \(got "):
        load_config(src, use_env=False)


@pytest.mark.parametrize("env", [{"KVBM_BACKEND__G4__TIMEOUT_S": "Infinity"}, {"KVBM_BACKEND__G4__TIMEOUT_S": "NaN"},
                                 {"KVBM_BACKEND__G3__LOAD_TIMEOUT_S": "inf"}])
def test_env_inf_nan_refused_and_env_named(env):
    (name,) = env
    with pytest.raises(ConfigError, match=rf"\(from {name}\): Input should be a finite number"):
        load_config(None, environ=env)


def test_kvbm_capacity_env_inf_refused():
    with pytest.raises(ConfigError, match=r"^g3\.capacity_gb \(from DYN_KVBM_DISK_CACHE_GB\): .*finite"):
        load_config(None, environ={"DYN_KVBM_DISK_CACHE_GB": "inf"})


@pytest.mark.parametrize("field,value", [("g3.load_timeout_s", 121), ("g4.timeout_s", 1e6),
                                         ("g4.breaker_reset_s", 86400)])
def test_timeouts_have_upper_bounds(field, value):
    section, leaf = field.split(".")
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: Input should be less than or equal to"):
        load_config({section: {leaf: value}}, use_env=False)
    load_config({section: {leaf: 60}}, use_env=False)  # a long but sane value is fine


@pytest.mark.parametrize("paths,idx", [([""], 0), (["/tmp", ""], 1), (["   "], 0)])
def test_empty_g3_path_refused(paths, idx):
    with pytest.raises(ConfigError, match=rf"^g3\.paths\[{idx}\]: empty path"):
        load_config({"g3": {"paths": paths}}, use_env=False)
    with pytest.raises(ConfigError, match=r"^g3\.paths: List should have at least 1 item"):
        load_config({"g3": {"paths": []}}, use_env=False)


@pytest.mark.parametrize("value", ["/a::/b", "/a:", ":/a", ":"])
def test_kvbm_dir_env_with_empty_entry_refused(value):
    with pytest.raises(ConfigError, match=r"^DYN_KVBM_DISK_CACHE_DIR: empty path entry .*current directory") as ei:
        load_config(None, environ={"DYN_KVBM_DISK_CACHE_DIR": value})
    assert repr(value) in str(ei.value)


def test_g3_path_that_is_a_file_refused(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    with pytest.raises(ConfigError, match=rf"^g3\.paths\[1\]: is a file, not a directory \(got '{re.escape(str(f))}'\)"):
        load_config({"g3": {"paths": [str(tmp_path / "ok"), str(f)]}}, use_env=False)
    # under a file: mkdir would fail later with NotADirectoryError
    with pytest.raises(ConfigError, match=rf"^g3\.paths\[0\]: {re.escape(str(f))} is a file: the directory cannot"):
        load_config({"g3": {"paths": [str(f / "sub" / "g3")]}}, use_env=False)
    # the KVBM env name is given when the value came from it
    with pytest.raises(ConfigError, match=r"^g3\.paths\[1\] \(from DYN_KVBM_DISK_CACHE_DIR\): is a file"):
        load_config(None, environ={"DYN_KVBM_DISK_CACHE_DIR": f"{tmp_path}:{f}"})
    # a disabled G3 is not opened, so its paths are not inspected
    assert load_config({"g3": {"enabled": False, "paths": [str(f)]}}, use_env=False).g3.paths == [str(f)]


@contextlib.contextmanager
def _effective_uid(uid: int | None):
    """Run the body with effective uid/gid ``uid`` (None: unchanged); root gets its ids back after."""
    if uid is None:
        yield
        return
    os.setegid(uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_g3_directory_not_writable_refused():
    # Root bypasses directory permissions, so as root the load runs with the effective uid of `nobody`
    # (65534; the check uses effective ids): a real permission check either way, never a mock.
    uid = 65534 if os.geteuid() == 0 else None
    d = tempfile.mkdtemp(prefix="kvbm-ro-", dir="/tmp")  # /tmp: reachable by `nobody` (pytest's tmp is 0700)
    try:
        os.chmod(d, 0o555)
        with _effective_uid(uid), pytest.raises(ConfigError) as ei:
            load_config({"g3": {"paths": [d]}}, use_env=False)
        assert str(ei.value).startswith("g3.paths[0]: directory is not writable by this process"), ei.value
        assert repr(d) in str(ei.value)
        os.chmod(d, 0o777)
        with _effective_uid(uid):
            assert load_config({"g3": {"paths": [d]}}, use_env=False).g3.paths == [d]
    finally:
        os.chmod(d, 0o700)
        os.rmdir(d)


def test_g3_directory_on_read_only_mount_refused(tmp_path):
    # A read-only filesystem stops root too (EROFS), and the message says which of the two it is.
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    r = subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root/CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {r.stderr.strip()}")
        with pytest.raises(ConfigError, match=r"^g3\.paths\[0\]: directory is not writable by this process "
                                              r"\(read-only filesystem\)"):
            load_config({"g3": {"paths": [str(ro)]}}, use_env=False)
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_dynamo_kvbm_disable_disk_offload_filter_env():
    from kvbm_backend.config import ConfigError, load_config
    assert load_config({}, environ={"DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true"}).g3.admission.policy == "all"
    assert load_config({}, environ={"DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "0"}).g3.admission.policy == "frequency"
    # KVBM_BACKEND__ names win over KVBM's (documented precedence)
    env = {"DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "1", "KVBM_BACKEND__G3__ADMISSION__POLICY": "frequency"}
    assert load_config({}, environ=env).g3.admission.policy == "frequency"
    import pytest as _pt
    with _pt.raises(ConfigError, match="DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER"):
        load_config({}, environ={"DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "maybe"})


# --- numbers (issue 26 item 13): no bools as numbers, finite, bounded above ----------------------------

def _number_fields(model=None, prefix=""):
    """(dotted path, annotation, field info) of every int/float field of the tree."""
    from pydantic import BaseModel

    from kvbm_backend.config import KvbmBackendConfig
    model = model or KvbmBackendConfig
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _number_fields(ann, f"{prefix}{name}.")
        elif ann in (int, float, int | None, float | None):
            yield f"{prefix}{name}", ann, f


NUMBER_FIELDS = [p for p, _, _ in _number_fields()]


def _nested(path: str, value) -> dict:
    src: dict = {}
    *parents, leaf = path.split(".")
    d = src
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = value
    return src


def test_the_number_fields_are_found():
    assert {"g3.capacity_gb", "g3.files_per_path", "g3.admission.tracker_entries", "g4.breaker_failures",
            "g4.keyring.rotate_after_uses", "metrics.port"} <= set(NUMBER_FIELDS)


@pytest.mark.parametrize("field", NUMBER_FIELDS)
@pytest.mark.parametrize("value", [True, False])
def test_bool_is_not_a_number(field, value):
    # pydantic's lax mode took `capacity_gb: true` as 1 GB and `files_per_path: false` as 0
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: expected a number, not a boolean \(got {value}\)"):
        load_config(_nested(field, value), use_env=False)


def test_env_overrides_merge_field_by_field():
    """Review finding (2026-11-29): an environment variable setting a whole section replaced the fields other
    variables had set (``DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER``'s policy lost to ``KVBM_BACKEND__G3__ADMISSION``,
    ``DYN_KVBM_DISK_CACHE_DIR`` to ``KVBM_BACKEND__G3``), and a field under a scalar raised a bare TypeError."""
    base = {"g3": {"paths": ["/tmp/x"]}}
    c = load_config(base, environ={"DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
                                   "KVBM_BACKEND__G3__ADMISSION": '{"tracker_entries": 4096}'})
    assert (c.g3.admission.policy, c.g3.admission.tracker_entries) == ("all", 4096)
    c = load_config(base, environ={"DYN_KVBM_DISK_CACHE_DIR": "/tmp/dyn-g3", "KVBM_BACKEND__G3": '{"capacity_gb": 5}'})
    assert (c.g3.paths, c.g3.capacity_gb) == (["/tmp/dyn-g3"], 5.0)
    c = load_config(base, environ={"KVBM_BACKEND__G3__ADMISSION__POLICY": "all",  # the deeper variable wins
                                   "KVBM_BACKEND__G3__ADMISSION": '{"policy": "frequency", "tracker_entries": 2048}'})
    assert (c.g3.admission.policy, c.g3.admission.tracker_entries) == ("all", 2048)
    with pytest.raises(ConfigError, match="KVBM_BACKEND__G3__ADMISSION__POLICY: g3.admission is not a section"):
        load_config(base, environ={"KVBM_BACKEND__G3__ADMISSION": "1", "KVBM_BACKEND__G3__ADMISSION__POLICY": "all"})


def test_env_sources_are_recorded_per_field():
    """Review finding (2026-11-30): ``KVBM_BACKEND__G3='{"capacity_gb": 5}'`` was recorded as setting the whole g3
    section (``("g3",)``), so ``config effective`` took every g3 field as the environment's and dropped the launch
    script's ``g3.paths`` default. A section variable sets only the fields it holds: one source per field."""
    src: dict = {}
    env_overrides({"KVBM_BACKEND__G3": '{"capacity_gb": 5, "admission": {"policy": "all"}}'}, src)
    assert src == {("g3", "capacity_gb"): "KVBM_BACKEND__G3", ("g3", "admission", "policy"): "KVBM_BACKEND__G3"}
    src = {}
    env_overrides({"DYN_KVBM_DISK_CACHE_DIR": "/tmp/a", "KVBM_BACKEND__G3": '{"paths": ["/tmp/b"]}',
                   "KVBM_BACKEND__G4": "{}", "KVBM_BACKEND__G3__CAPACITY_GB": "2"}, src)
    assert src == {("g3", "paths"): "KVBM_BACKEND__G3", ("g4",): "KVBM_BACKEND__G4",  # an empty mapping: its own path
                   ("g3", "capacity_gb"): "KVBM_BACKEND__G3__CAPACITY_GB"}
    src = {}  # a value that is not a mapping replaces the fields below it: their sources go too
    assert env_overrides({"DYN_KVBM_DISK_CACHE_DIR": "/tmp/a", "KVBM_BACKEND__G3": "5"}, src) == {"g3": 5}
    assert src == {("g3",): "KVBM_BACKEND__G3"}
    # errors still name the variable: a field it holds, an unknown section it is, a whole section set to a scalar
    for env, want in (({"KVBM_BACKEND__G3": '{"capacity_gb": "x"}'}, r"^g3\.capacity_gb \(from KVBM_BACKEND__G3\): "),
                      ({"KVBM_BACKEND__NOSUCH": '{"a": 1}'}, r"^nosuch \(from KVBM_BACKEND__NOSUCH\): Extra inputs"),
                      ({"KVBM_BACKEND__G3": "5"}, r"^g3 \(from KVBM_BACKEND__G3\): "),
                      ({"KVBM_BACKEND__G3": '{"capacity_gb": "x"}', "KVBM_BACKEND__G3__CAPACITY_GB": "y"},
                       r"^g3\.capacity_gb \(from KVBM_BACKEND__G3__CAPACITY_GB\): ")):
        with pytest.raises(ConfigError, match=want):
            load_config({"g3": {"paths": ["/tmp/x"]}}, environ=env)


def test_bool_from_env_json_is_not_a_number():
    with pytest.raises(ConfigError, match=r"^g3\.capacity_gb \(from KVBM_BACKEND__G3__CAPACITY_GB\): expected a "
                                          r"number, not a boolean"):
        load_config(None, environ={"KVBM_BACKEND__G3__CAPACITY_GB": "true"})
    # numbers given as strings (env values, YAML's `1e3` without a dot) still parse
    assert load_config(None, environ={"DYN_KVBM_DISK_CACHE_GB": "1e3"}).g3.capacity_gb == 1000


@pytest.mark.parametrize("field", NUMBER_FIELDS)
def test_every_number_has_an_upper_bound_in_its_description(field):
    import annotated_types
    (_, _, info), = [x for x in _number_fields() if x[0] == field]
    bounds = [m for m in info.metadata if isinstance(m, (annotated_types.Le, annotated_types.Lt))]
    assert bounds, f"{field} has no upper bound"
    hi = getattr(bounds[0], "le", getattr(bounds[0], "lt", None))
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: Input should be less than"):
        load_config(_nested(field, hi * 2 + 1), use_env=False)


@pytest.mark.parametrize("field,value", [("g3.capacity_gb", 1e300), ("g3.capacity_gb", "1e300"),
                                         ("g3.capacity_gb", 10_000_001), ("g3.io_size_bytes", 1 << 40),
                                         ("g3.admission.tracker_entries", 10 ** 30),
                                         ("g4.write_queue_blocks", 10 ** 400)])
def test_absurd_sizes_refused(field, value):
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}: Input should be less than or equal to"):
        load_config(_nested(field, value), use_env=False)
    assert load_config({"g3": {"capacity_gb": 10_000_000}}, use_env=False).g3.capacity_gb == 1e7  # 10 PB is fine


def test_yaml_capacity_1e300_through_the_cli(tmp_path):
    import sys
    f = tmp_path / "c.yaml"
    f.write_text("g3:\n  capacity_gb: 1e300\n  files_per_path: true\n")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", "doctor", "--config", str(f)],
                       capture_output=True, text=True, timeout=HANG_S, cwd=repo)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == ("error: g3.capacity_gb: Input should be less than or equal to 10000000 (got '1e300'); "
                                "g3.files_per_path: expected a number, not a boolean (got True)"), r.stderr


def test_kvbm_disk_o_direct_switch_and_kvbm_only_names(caplog):
    """Dynamo KVBM's DYN_KVBM_DISK_DISABLE_O_DIRECT turns G3's O_DIRECT off (KVBM's name honoured, the source
    named); KVBM settings with no meaning here are one warning each naming what to use, never silently
    ignored nor an error (KVBM may run beside us and read them); a bad switch value names the variable."""
    import logging

    from kvbm_backend import config as c
    cfg = load_config({}, environ={"DYN_KVBM_DISK_DISABLE_O_DIRECT": "true"})
    assert cfg.g3.o_direct == "off"
    assert load_config({}, environ={"DYN_KVBM_DISK_DISABLE_O_DIRECT": "0"}).g3.o_direct == "auto"
    with pytest.raises(ConfigError, match="^DYN_KVBM_DISK_DISABLE_O_DIRECT: expected true/false"):
        load_config({}, environ={"DYN_KVBM_DISK_DISABLE_O_DIRECT": "maybe"})
    c._kvbm_only_warned.clear()
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.config"):
        load_config({}, environ={"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "5000", "DYN_KVBM_CPU_CACHE_GB": "4"})
        load_config({}, environ={"DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "5000"})
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and any("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS" in m and "g3.capacity_gb" in m for m in msgs)
    assert set(c.KVBM_ONLY_ENV) >= {"DYN_KVBM_CPU_CACHE_GB", "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS"}


# --- g4.url / g4.endpoint_url forms (issue 22 item 3): a typo is one line at load, not a dead worker ------

@pytest.mark.parametrize("url,why", [
    ("s3:/bucket", r"two slashes after 's3:'; did you mean s3://bucket\?"),
    ("s3:bucket/p", r"did you mean s3://bucket/p\?"),
    ("s3://", r"no bucket"),
    ("s3:///prefix", r"no bucket"),
    ("s3://My_Bucket/p", r"bucket 'My_Bucket': only lowercase letters"),
    ("s3://ab/p", r"bucket 'ab': 3 to 63 characters"),
    ("s3://" + "b" * 64, r"3 to 63 characters"),
    ("s3://a..b/p", r"two adjacent periods"),
    ("s3://-bucket/p", r"starting and ending with a letter or digit"),
    ("s3://192.168.1.10/p", r"looks like an IP address; did you mean g4.endpoint_url\?"),
    ("s3://minio:9000/bucket", r"bucket 'minio:9000'"),
    ("s3://key:secret@bucket/p", r"only lowercase letters"),
    ("s3://xn--bucket/p", r"'xn--' is reserved"),
    ("s3://bucket-s3alias", r"'-s3alias' is reserved"),
    ("s3://bucket/p?region=x", r"no query"),
    ("s3://bucket/p ", r"contains whitespace"),
    # review 2026-12-02: obstore refused such keys before sending them, taken for an outage (breaker open, every
    # offload dropped); a server that collapses them wrote under another prefix
    ("s3://bucket/team//kv", r"the prefix '/team//kv' has an empty path segment \(did you mean s3://bucket/team/kv\?\)"),
    ("s3://bucket/team/./kv", r"has a path segment '\.'"),
    ("s3://bucket/a/../kv", r"has a path segment '\.\.'"),
    ("file://relative", r"file URLs must be absolute, file:///path \(three slashes; .*names host 'relative'"),
    ("file://relative/dir", r"names host 'relative'"),
    ("file:relative", r"file URLs must be absolute"),
    ("file://", r"file URLs must be absolute"),
    ("file:///", r"filesystem root"),
    ("/shared/kv", r"no scheme; .*did you mean file:///shared/kv\?"),
    ("bucket/prefix", r"no scheme"),
    ("gs://bucket/p", r"scheme 'gs' not supported; use s3://, file://, mem://"),
    ("http://host/p", r"scheme 'http' not supported"),
    ("mem://", r"mem:// URL needs a name"),
])
@pytest.mark.parametrize("enabled", [True, False])
def test_g4_url_typos_refused_at_load_naming_the_field(url, why, enabled):
    """Issue 22 item 3: these passed load_config (and doctor, and the launcher's preflight); the worker then
    died in the store factory ~55 s into `vllm serve`. A typo is refused whether G4 is enabled or not."""
    with pytest.raises(ConfigError, match=rf"^g4\.url: .*{why}") as ei:
        load_config({"g4": {"enabled": enabled, "url": url, "encrypt": False}}, use_env=False)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("url", ["s3://bucket", "s3://kvbm-g4/llama-3.1-8b", "s3://my.bucket.name/a/b/", "S3://bucket/p",
                                 "s3://b12/p", "file:///shared/kv", "file://localhost/shared/kv", "file:/shared/kv",
                                 "mem://unit-test"])
def test_g4_url_good_forms_load(url):
    cfg = load_config({"g4": {"url": url}}, use_env=False)
    assert cfg.g4.url == url


def test_g4_url_required_when_enabled_and_optional_when_not(tmp_path):
    with pytest.raises(ConfigError, match=r"^g4\.url: required when g4\.enabled is true"):
        load_config({"g4": {"enabled": True, "encrypt": False}}, use_env=False)
    with pytest.raises(ConfigError, match=r"^g4\.url \(from KVBM_BACKEND__G4__URL\): required when g4\.enabled"):
        load_config(None, environ={"KVBM_BACKEND__G4__ENABLED": "true", "KVBM_BACKEND__G4__URL": ""})
    assert load_config({"g4": {"enabled": False, "url": ""}}, use_env=False).g4.url == ""
    assert load_config({"g4": {"enabled": False}}, use_env=False).g4.url is None


def test_g4_url_from_env_names_the_variable():
    with pytest.raises(ConfigError, match=r"^g4\.url \(from KVBM_BACKEND__G4__URL\): .*no bucket"):
        load_config(None, environ={"KVBM_BACKEND__G4__URL": "s3://"})


def test_enabled_g4_file_url_directory_checked_like_a_g3_path(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match=rf"^g4\.url: {re.escape(str(f))} is a file: the directory cannot be created"):
        load_config({"g4": {"enabled": True, "url": f"file://{f}/g4", "encrypt": False}}, use_env=False)
    with pytest.raises(ConfigError, match=r"^g4\.url: is a file, not a directory"):
        load_config({"g4": {"enabled": True, "url": f"file://{f}", "encrypt": False}}, use_env=False)
    # a disabled G4 is not opened: its directory is not inspected (its form still is)
    assert load_config({"g4": {"url": f"file://{f}/g4"}}, use_env=False).g4.url == f"file://{f}/g4"
    assert load_config({"g4": {"enabled": True, "url": f"file://{tmp_path}/new/g4", "encrypt": False}},
                       use_env=False).g4.enabled


@pytest.mark.parametrize("endpoint,why", [
    ("127.0.0.1:8333", r"expected http://HOST\[:PORT\] or https://HOST\[:PORT\]; did you mean http://127.0.0.1:8333\?"),
    ("minio.storage.svc", r"expected .*; did you mean http://minio.storage.svc\?"),
    ("s3://minio:9000", r"expected http://HOST"),
    ("http://", r"not a valid endpoint"),
    ("http://host:99999", r"not a URL \(Port out of range"),
    ("http://host:port", r"not a URL"),
    ("http://under_score:9000", r"not a valid endpoint"),
    ("http://host :9000", r"contains whitespace"),
])
def test_g4_endpoint_url_typos_refused_at_load(endpoint, why):
    with pytest.raises(ConfigError, match=rf"^g4\.endpoint_url: {why}"):
        load_config({"g4": {"url": "s3://bucket/p", "endpoint_url": endpoint}}, use_env=False)


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:8333", "https://minio.storage.svc:9000", "http://[::1]:9000",
                                      "https://s3.eu-west-3.amazonaws.com", "http://localhost:9000/"])
def test_g4_endpoint_url_good_forms_load(endpoint):
    assert load_config({"g4": {"endpoint_url": endpoint}}, use_env=False).g4.endpoint_url == endpoint


def test_every_g4_url_the_config_accepts_opens_its_store(tmp_path):
    """The config's rules and the store factory's agree: a URL that loads opens (no request goes out)."""
    from kvbm_backend.pool.g4.factory import open_store
    for url in ("s3://bucket", "s3://my.bucket.name/a/b/", "S3://bucket/p", f"file://{tmp_path}/a",
                f"file://localhost{tmp_path}/b", f"file:{tmp_path}/c", "mem://unit-test-open"):
        cfg = load_config({"g4": {"enabled": True, "url": url, "encrypt": False}}, use_env=False)
        assert open_store(cfg.g4.url, cfg.g4).url


@pytest.mark.parametrize("url,why", [("s3:/bucket", "two slashes"), ("file://relative", "file URLs must be absolute")])
def test_g4_url_typo_through_doctor(tmp_path, url, why):
    import sys
    f = tmp_path / "c.yaml"
    f.write_text(f"g3:\n  paths: [{tmp_path / 'g3'}]\ng4:\n  enabled: true\n  url: {url}\n  encrypt: false\n")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.cli", "doctor", "--config", str(f)],
                       capture_output=True, text=True, timeout=HANG_S, cwd=repo)
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: g4.url: ") and why in err[0], r.stderr


@pytest.mark.parametrize("value", [5000, 4097, 1 << 20 | 512])
def test_io_size_not_a_multiple_of_4096_is_refused_by_the_config(value, tmp_path):
    """Issue 23: the config checks ``g3.io_size_bytes`` itself (a positive multiple of 4096, one line naming
    the field); the pool no longer rounds an odd value silently, the apps use the same rule."""
    with pytest.raises(ConfigError, match=rf"^g3\.io_size_bytes: must be a positive multiple of 4096 bytes, at most "
                                          rf"1 GiB \(got {value}\)$"):
        load_config({"g3": {"io_size_bytes": value}}, use_env=False)
    cfg = load_config({"g3": {"io_size_bytes": 3 << 12, "paths": [str(tmp_path)]}}, use_env=False)
    assert cfg.g3.io_size_bytes == 12288
    from kvbm_backend.config import io_size_problem
    assert io_size_problem(value) and io_size_problem(0) and io_size_problem(2 << 30) and not io_size_problem(4096)


def test_a_refused_url_is_quoted_without_its_credentials():
    """Review note (2026-11-30): a config error quoted the value it refused as given, so a worker's start-up
    error (printed by vLLM, kept by the pod's log) carried an ``endpoint_url``'s ``USER:SECRET@``; the CLI's own
    reports redacted it, the error itself did not. Now every config error line passes URLs through
    ``store_url.redact_urls``."""
    secret = "TopSecret123"
    bad = {"g4": {"enabled": True, "url": "s3://kvbm-bucket/p", "endpoint_url": f"ftp://AKIAUSER:{secret}@127.0.0.1:1"}}
    with pytest.raises(ConfigError) as e:
        load_config(bad, use_env=False)
    assert "g4.endpoint_url" in str(e.value) and "ftp://127.0.0.1:1" in str(e.value) and secret not in str(e.value)
    with pytest.raises(ConfigError) as e:  # from the environment too, named by its variable
        load_config({}, environ={"KVBM_BACKEND__G4__ENDPOINT_URL": f"ftp://AKIAUSER:{secret}@127.0.0.1:1"})
    assert "KVBM_BACKEND__G4__ENDPOINT_URL" in str(e.value) and secret not in str(e.value)


# --- one rule for every DYN_KVBM_* boolean (review finding 2026-11-30) ----------------------------------

_KVBM_SWITCHES = {  # variable -> (what a true value gives, read off the loaded config)
    "DYN_KVBM_METRICS": (True, lambda c: c.metrics.enabled),
    "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": ("all", lambda c: c.g3.admission.policy),
    "DYN_KVBM_DISK_DISABLE_O_DIRECT": ("off", lambda c: c.g3.o_direct),
}


@pytest.mark.parametrize("name", sorted(_KVBM_SWITCHES))
def test_every_dyn_kvbm_boolean_reads_by_one_rule(name):
    """Review finding (2026-11-30): ``DYN_KVBM_METRICS`` went to pydantic (refused ``" true"``, took ``t``/``y``)
    while the other switches went through ``_kvbm_flag`` (spaces stripped, ``t``/``y`` refused). Every one now
    takes true/false, 1/0, yes/no, on/off, any case, spaces around ignored, and refuses anything else naming
    itself (docs/configuration.md)."""
    want, read = _KVBM_SWITCHES[name]
    unset = read(load_config({}, environ={}))
    for v in ("true", " true", "TRUE ", "1", "yes", "On"):
        assert read(load_config({}, environ={name: v})) == want, v
    for v in ("false", " 0", "No", "off "):
        got = read(load_config({}, environ={name: v}))
        assert got == (False if name == "DYN_KVBM_METRICS" else unset), v
    assert read(load_config({}, environ={name: "  "})) == unset  # blank: unset
    for v in ("t", "y", "f", "n", "enable", "2"):
        with pytest.raises(ConfigError, match=rf"^{name}: expected true/false, 1/0, yes/no or on/off, got '{v}'$"):
            load_config({}, environ={name: v})


@pytest.mark.parametrize("sep", [": ", " :", ":  "])
def test_kvbm_dir_env_entry_with_spaces_refused(tmp_path, monkeypatch, sep):
    """Review finding (2026-11-30): ``DYN_KVBM_DISK_CACHE_DIR='/a: /b'`` gave G3 the path ``' /b'``, relative:
    a G3 directory named `` /b`` in the current directory. Now one error naming the variable and the entry."""
    monkeypatch.chdir(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    value = f"{a}{sep}{b}"
    with pytest.raises(ConfigError, match=r"^DYN_KVBM_DISK_CACHE_DIR: path entry .* has spaces around it") as ei:
        load_config(None, environ={"DYN_KVBM_DISK_CACHE_DIR": value})
    assert repr(value) in str(ei.value)
    assert sorted(os.listdir(tmp_path)) == []  # nothing made in the current directory
    assert load_config(None, environ={"DYN_KVBM_DISK_CACHE_DIR": f"{a}:{b}"}).g3.paths == [str(a), str(b)]


@pytest.mark.parametrize("name, text", [
    ("c.YAML", "model: m\ng3:\n  capacity_gb: 3\n"),
    ("c.Yml", "model: m\ng3:\n  capacity_gb: 3\n"),
    ("c.TOML", 'model = "m"\n[g3]\ncapacity_gb = 3\n'),
], ids=["YAML", "Yml", "TOML"])
def test_config_file_suffix_is_read_in_any_case(tmp_path, name, text):
    """Review finding (2026-11-30): ``config.YAML`` / ``.Yml`` / ``.TOML`` were parsed as JSON (``config file
    ...: Expecting value``). Checked through the real ``python -m kvbm_backend.apps.effective`` too."""
    p = tmp_path / name
    p.write_text(text)
    assert load_config(str(p), use_env=False).g3.capacity_gb == 3
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBM_BACKEND", "DYN_KVBM_"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    ktc = {"kv_connector": "KvbmBackendConnector", "kv_connector_extra_config": {"config_file": str(p)}}
    r = subprocess.run([sys.executable, "-m", "kvbm_backend.apps.effective", "--for", "vllm", json.dumps(ktc)],
                       capture_output=True, text=True, env=env, timeout=600)  # a hang guard only
    assert r.returncode == 0, r.stderr
    assert "g3.capacity_gb=3 [file]" in r.stderr, r.stderr


@pytest.mark.parametrize("name,text,line", [
    ("sections.yaml", "g3:\n  paths: [/nvme/kv]\n  capacity_gb: 800\ng4:\n  enabled: false\ng3:\n  fsync: true\n",
     "line 6: key 'g3' appears twice in one mapping (first at line 1"),
    ("field.yaml", "g3:\n  capacity_gb: 800\n  capacity_gb: 8\n", "line 3: key 'capacity_gb' appears twice"),
    ("sections.json", '{"g3": {"capacity_gb": 800}, "g3": {"fsync": true}}', "key 'g3' appears twice in one object"),
])
def test_a_key_repeated_in_a_config_file_is_refused_naming_it(tmp_path, name, text, line):
    """Review finding 2026-12-02: YAML's safe loader and ``json.loads`` keep a repeated key's last copy, so a second
    ``g3:`` section added at the bottom of a ConfigMap silently dropped the first's paths and capacity (G3 opened
    ``./kvbm-g3`` with 10 GB; ``doctor`` said OK). TOML refuses repeats by itself."""
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f, use_env=False)
    assert str(e.value).startswith(f"config file {f}: {line}"), str(e.value)
    with pytest.raises(ConfigError, match="key 'g3' appears twice in one object"):
        load_config('{"g3": {"capacity_gb": 800}, "g3": {}}', use_env=False)
    ok = tmp_path / "ok.yaml"
    ok.write_text("g3:\n  capacity_gb: 800\ng4:\n  enabled: false\n")
    assert load_config(ok, use_env=False).g3.capacity_gb == 800


def test_a_g3_directory_listed_twice_is_refused_naming_the_field(tmp_path):
    """``g3.paths`` entries name distinct directories (a trailing ``/``, ``..`` or a symbolic link name the same
    one). Review finding 2026-12-02: ``[/a, /a/]`` passed every check and the pool failed in the engine, its own
    second directory lock blamed on another worker."""
    a = tmp_path / "a"
    a.mkdir()
    (tmp_path / "link").symlink_to(a)
    for twice in ([str(a), f"{a}/"], [str(a), str(tmp_path / "link")], [str(a), str(tmp_path / "b" / ".." / "a")]):
        with pytest.raises(ConfigError) as e:
            load_config({"g3": {"paths": twice}}, use_env=False)
        assert str(e.value).startswith(f"g3.paths: entry 1 ({twice[1]!r}) is the same directory as entry 0 "
                                       f"({str(a)!r}): list each directory once"), str(e.value)
    with pytest.raises(ConfigError, match=r"^g3.paths \(from DYN_KVBM_DISK_CACHE_DIR\): entry 1 "):
        load_config(None, environ={"DYN_KVBM_DISK_CACHE_DIR": f"{a}:{a}"})
    assert load_config({"g3": {"paths": [str(a), str(tmp_path / "c")]}}, use_env=False).g3.paths[1] == str(tmp_path / "c")
