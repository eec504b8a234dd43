"""``KVBM_BACKEND__SECTION__FIELD`` of a text field takes the variable's text (docs/configuration.md: "Any field can
be set from the environment ... (JSON values parsed)", the module doc of kvbm_backend.config: "parsed as JSON when
they parse, else taken as strings").

Before 2026-12-03 the text was parsed as JSON whatever the field: a numeric tenant id (``KVBM_BACKEND__TENANT=42``, a
customer number), a numeric weights revision (``KVBM_BACKEND__REVISION=2``) or a keyring file named by digits parsed
as a number, and the worker refused to start (``tenant (from KVBM_BACKEND__TENANT): Input should be a valid string
(got 42)``): those values could not be set from the environment as documented at all."""
from __future__ import annotations

import pytest

from kvbm_backend.config import ConfigError, load_config


@pytest.mark.parametrize("var, path, text", [
    ("KVBM_BACKEND__TENANT", ("tenant",), "42"),
    ("KVBM_BACKEND__REVISION", ("revision",), "2"),
    ("KVBM_BACKEND__MODEL", ("model",), "7"),
    ("KVBM_BACKEND__TENANT", ("tenant",), "true"),
    ("KVBM_BACKEND__REVISION", ("revision",), "1.5e3"),
    ("KVBM_BACKEND__G4__REGION", ("g4", "region"), "1"),
    ("KVBM_BACKEND__G4__KEYRING__KEK_ENV", ("g4", "keyring", "kek_env"), "0"),
])
def test_a_text_field_takes_the_variable_s_text(var, path, text):
    cfg = load_config(environ={var: text})
    value = cfg
    for part in path:
        value = getattr(value, part)
    assert value == text


def test_the_text_reaches_what_the_field_does(tmp_path):
    """The tenant and revision set so are the ones the connector names blocks by (the config's namespace parts)."""
    from kvbm_backend.integrations.vllm.namespaces import namespace_revision
    cfg = load_config(environ={"KVBM_BACKEND__TENANT": "1001", "KVBM_BACKEND__REVISION": "20241201"})
    assert cfg.tenant == "1001"
    assert namespace_revision(cfg, "main") == "20241201"  # set: vLLM's --revision does not replace it


def test_other_fields_still_parse_json_and_null_unsets_an_optional_text_field():
    cfg = load_config(environ={"KVBM_BACKEND__G3__CAPACITY_GB": "7", "KVBM_BACKEND__G4__ENCRYPT": "false",
                               "KVBM_BACKEND__G4__REGION": "null", "KVBM_BACKEND__LOAD_GIL_SWITCH_MS": "null",
                               "KVBM_BACKEND__G3__PATHS": '["/tmp"]'})
    assert cfg.g3.capacity_gb == 7 and cfg.g4.encrypt is False and cfg.g4.region is None
    assert cfg.load_gil_switch_ms is None and cfg.g3.paths == ["/tmp"]
    with pytest.raises(ConfigError, match=r"g3.capacity_gb \(from KVBM_BACKEND__G3__CAPACITY_GB\)"):
        load_config(environ={"KVBM_BACKEND__G3__CAPACITY_GB": "ten"})
    # a whole section given as JSON keeps its JSON types: the text rule is for a variable naming the field itself
    with pytest.raises(ConfigError, match=r"g4.region \(from KVBM_BACKEND__G4\): Input should be a valid string"):
        load_config(environ={"KVBM_BACKEND__G4": '{"region": 5}'})
