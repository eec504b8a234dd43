"""Config tree: sources, KVBM env names, errors that name the field."""
import json

import pytest

from kvbm_backend.config import ConfigError, load_config


def test_defaults_and_kvbm_env_names(tmp_path):
    cfg = load_config(None, environ={"DYN_KVBM_DISK_CACHE_DIR": "/nvme0/kv:/nvme1/kv", "DYN_KVBM_DISK_CACHE_GB": "500"})
    assert cfg.g3.paths == ["/nvme0/kv", "/nvme1/kv"]
    assert cfg.g3.capacity_gb == 500
    assert cfg.g3.admission.policy == "frequency"
    assert cfg.g4.encrypt is True


def test_generic_env_override_wins_over_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("g4:\n  url: s3://a/b\n  timeout_s: 1.5\n")
    cfg = load_config(p, environ={"KVBM_BACKEND__G4__TIMEOUT_S": "0.5"})
    assert cfg.g4.url == "s3://a/b" and cfg.g4.timeout_s == 0.5


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
