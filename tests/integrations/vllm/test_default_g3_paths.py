"""The default ``g3.paths`` (``./kvbm-g3``, relative to the working directory) is judged like a given path by what
opens G3: the connector's config (:func:`~kvbm_backend.integrations.vllm.extra_config.config_from_extra`), a G3Tier's
(:func:`~kvbm_backend.integrations.vllm.extra_config.tier_config`) and the launchers' preflight of both.

Finding (2026-12-03): pydantic does not validate defaults, so only a ``g3.paths`` the user gave was checked
(:func:`kvbm_backend.config.dir_problem`). The connector with G3 on and ``g3.paths`` unset, started from a working
directory where ``./kvbm-g3`` cannot be created (a file of that name there, a read-only root in a container), passed
``config_from_extra`` and the preflight (``check_argv``), then the engine failed opening the pool with a bare
``FileExistsError: [Errno 17] File exists: '.../kvbm-g3'`` naming no field. Now: ConfigError ``g3.paths[0]: ...``
saying it is the default and how to set it. Plain :func:`~kvbm_backend.config.load_config` (CLI tools that never open
G3) still loads such a config from any directory.

The unwritable working directory is real: a read-only tmpfs mount (root writes a 0555 directory regardless), or a
file named ``kvbm-g3`` in the working directory (:mod:`tests.helpers.ro_cwd`)."""
from __future__ import annotations

import json

import pytest

from kvbm_backend.config import ConfigError, load_config
from kvbm_backend.integrations.preflight import check_argv, check_tier
from kvbm_backend.integrations.vllm.extra_config import config_from_extra, tier_config
from tests.helpers import ro_cwd as _ro_cwd

ro_cwd = _ro_cwd.ro_cwd  # the fixture: a working directory where ./kvbm-g3 cannot be created

DEFAULT_RE = (r"g3\.paths\[0\]: .+ \(got '\./kvbm-g3': the default, relative to the working directory .+; set "
              r"g3\.paths, or DYN_KVBM_DISK_CACHE_DIR, to a directory this process can write\)")
# the real connector's kv_connector_extra_config as a launcher gives it (G3 on by default, paths unset)
EXTRA = {"kvbm_backend": {"g3": {"capacity_gb": 1, "files_per_path": 1}}}


def _argv(extra: dict) -> list[str]:
    ktc = {"kv_connector": "KvbmBackendConnector", "kv_connector_module_path": "kvbm_backend.integrations.vllm.connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    return ["serve", "some/model", "--enable-prefix-caching", "--kv-transfer-config", json.dumps(ktc)]


def test_the_connectors_config_refuses_the_default_g3_paths_naming_it(ro_cwd, tmp_path):
    """Before: ``config_from_extra`` passed (the engine then failed with ``FileExistsError``)."""
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.kvbm_backend: " + DEFAULT_RE):
        config_from_extra(EXTRA)
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.kvbm_backend: " + DEFAULT_RE):
        config_from_extra({})  # no kvbm_backend at all: every default
    cfg_file = tmp_path / "kvbm.yaml"
    cfg_file.write_text("g3:\n  capacity_gb: 1\n")
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.config_file: " + DEFAULT_RE):
        config_from_extra({"config_file": str(cfg_file)})
    assert not (ro_cwd / "kvbm-g3").is_dir()


def test_the_preflight_refuses_the_default_g3_paths_naming_it(ro_cwd):
    """Before: ``check_argv`` returned None (nothing wrong) for the real argv."""
    why = check_argv(_argv(EXTRA), create=False)
    assert why is not None and why.startswith("kv_connector_extra_config.kvbm_backend: g3.paths[0]: ")
    assert "the default, relative to the working directory" in why and "DYN_KVBM_DISK_CACHE_DIR" in why
    assert check_argv(_argv(EXTRA)) == why  # create=True: the same


def test_a_g3_tier_says_its_refused_path_is_the_default(ro_cwd, tmp_path):
    """A G3Tier already refused the default (its config is dumped and loaded again); now the error says it is the
    default and how to set it. Before: ``g3.paths[0]: ... (got './kvbm-g3')`` with no hint."""
    with pytest.raises(ConfigError, match=r"^" + DEFAULT_RE):
        tier_config(None, g3={"capacity_gb": 1}, tier="G3")
    with pytest.raises(ConfigError, match=r"^secondary_tiers G3Tier: " + DEFAULT_RE):
        check_tier({"type": "G3Tier", "module_path": "kvbm_backend.integrations.vllm.tiering", "g3": {}},
                   create=False)


def test_a_given_path_an_env_path_or_g3_off_is_not_the_default(ro_cwd, tmp_path, monkeypatch):
    """What sets ``g3.paths`` replaces the default: a writable one passes, an unwritable one keeps its own error
    (no "the default"); G3 off and a G4Tier check nothing of G3; plain ``load_config`` is not refused."""
    good = str(tmp_path / "g3")
    cfg, _ = config_from_extra({"kvbm_backend": {"g3": {"paths": [good]}}})
    assert cfg.g3.paths == [good]
    assert check_argv(_argv({"kvbm_backend": {"g3": {"paths": [good]}}}), create=False) is None
    with pytest.raises(ConfigError, match=r"g3\.paths\[0\]: .+\(got '\./kvbm-g3'\)$"):
        config_from_extra({"kvbm_backend": {"g3": {"paths": ["./kvbm-g3"]}}})
    assert tier_config(None, g3={"paths": [good]}, tier="G3").g3.paths == [good]
    cfg, _ = config_from_extra({"kvbm_backend": {"g3": {"enabled": False}}})
    assert not cfg.g3.enabled
    assert tier_config(None, g4={"url": f"file://{tmp_path / 'store'}", "encrypt": False}, tier="G4").g4.enabled
    assert load_config({}).g3.paths == ["./kvbm-g3"]  # CLI tools that never open G3 load it anywhere
    monkeypatch.setenv("DYN_KVBM_DISK_CACHE_DIR", good)
    assert config_from_extra(EXTRA)[0].g3.paths == [good]
    assert check_argv(_argv(EXTRA), create=False) is None
    assert not (ro_cwd / "kvbm-g3").is_dir()


def test_the_real_connector_refuses_the_default_naming_the_field(ro_cwd, tmp_path):
    """vLLM builds the connector (scheduler role, ``uni`` executor: it opens G3 itself). Before: the pool's
    ``os.makedirs('./kvbm-g3')`` failed (``FileExistsError`` / ``OSError`` read-only filesystem), no field named."""
    pytest.importorskip("vllm.v1.core.sched.scheduler")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    from tests.helpers.vllm_sched import tiny_scheduler
    with pytest.raises(ConfigError, match=r"^kv_connector_extra_config\.kvbm_backend: " + DEFAULT_RE):
        tiny_scheduler(tmp_path, {"kvbm_backend": {"model": "tiny", "g3": {"capacity_gb": 0.2, "files_per_path": 1}}},
                       lambda kw, names: [KVCacheGroupSpec(names, FullAttentionSpec(**kw))],
                       block_size=16, num_blocks=32, batched_tokens=64)
    assert not (ro_cwd / "kvbm-g3").is_dir()
