"""A native tier (``G3Tier``/``G4Tier`` under vLLM's real TieringOffloadingSpec, loaded by ``module_path``) checks and
creates the directories of its own pool only.

Finding (2026-12-03): a G4Tier-only setup (no G3Tier in ``secondary_tiers``) still checked the default ``g3.paths``
(``./kvbm-g3``) and refused to start where that directory cannot be made: ``g3.paths[0]: cannot be created: ... is not
writable by this process (read-only filesystem)`` from a container whose root (the working directory) is read-only,
although G3 is not used at all; a G3Tier likewise checked an enabled ``g4.url`` ``file://`` directory of a shared
config file it never opens. Now a G4Tier checks ``g4`` (and opens its keyring), a G3Tier ``g3``
(:func:`kvbm_backend.integrations.vllm.extra_config.tier_config`), and the launchers' preflight does the same; the
tier in use still refuses a bad directory naming the field. The connector's behaviour is unchanged: G3 on (its
default) checks ``g3.paths``; ``g3.enabled: false`` checks none and starts from a read-only working directory.

The unwritable working directory is real: a read-only tmpfs mount (root, as the tests run, writes a 0555 directory
regardless), or, where no mount is possible, a file named ``kvbm-g3`` in the working directory."""
from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from kvbm_backend.config import ConfigError, load_config  # noqa: E402
from kvbm_backend.integrations.preflight import check_tier  # noqa: E402
from kvbm_backend.integrations.vllm.tiering_harness import TieringHarness, offloading_config  # noqa: E402
from tests.helpers import ro_cwd as _ro_cwd  # noqa: E402
from tests.helpers.ro_cwd import cannot_mkdir  # noqa: E402
from tests.integrations.vllm.test_tiering import GEO, MOD, g3_tier, keys_for, payloads  # noqa: E402

pytestmark = [pytest.mark.vllm]
ro_cwd = _ro_cwd.ro_cwd  # the fixture: a working directory where ./kvbm-g3 cannot be created


def _g4_tier(tmp_path: Path) -> dict:
    """An encrypted G4Tier, nothing about G3 set: its store and keyring (the KEK from the environment) in tmp_path."""
    return {"type": "G4Tier", "module_path": MOD, "num_kv_heads": GEO["num_kv_heads"], "io_threads": 2,
            "g4": {"url": f"file://{tmp_path / 'store'}", "timeout_s": 60.0,
                   "keyring": {"path": str(tmp_path / "keys" / "keyring.json")}}}


def _round_trip(tier: dict) -> TieringHarness:
    """Build ``tier`` under vLLM's manager, store chunks, drop the primary, read them back from the tier."""
    h = TieringHarness(offloading_config(secondary_tiers=[tier], chunks=8, **GEO))
    try:
        keys, data = keys_for(4, "ro-cwd"), payloads(h, 4)
        h.store(keys, data)
        h.wait_idle()
        h.reset_primary()
        got = h.load(keys)
        assert len(got) == 4 and all((a == b).all() for a, b in zip(got, data))
    except BaseException:
        h.shutdown()
        raise
    return h


def test_a_g4_tier_alone_starts_where_the_default_g3_paths_cannot_be_made(tmp_path, monkeypatch, ro_cwd):
    """Before: ``ConfigError: g3.paths[0]: ...`` (``./kvbm-g3``) at construction and in the preflight."""
    cannot_mkdir(ro_cwd)
    monkeypatch.setenv("KVBM_BACKEND_KEK", base64.b64encode(os.urandom(32)).decode())
    tier = _g4_tier(tmp_path)
    h = _round_trip(tier)
    try:
        assert type(h.tier.pool).__name__ == "G4Pool" and h.tier.config.g4.enabled and h.tier.config.g4.encrypt
        assert (tmp_path / "keys" / "keyring.json").is_file()  # what the G4Tier uses is made
    finally:
        h.shutdown()
    check_tier(tier)  # the launchers' preflight passes it too
    assert not (ro_cwd / "kvbm-g3").is_dir()


def test_a_g4_tier_still_refuses_its_own_store_directory_naming_the_field(tmp_path, ro_cwd):
    tier = _g4_tier(tmp_path)
    tier["g4"].update(url=f"file://{ro_cwd / 'kvbm-g3' / 'store'}", encrypt=False)
    tier["g4"].pop("keyring")
    for build in (lambda: TieringHarness(offloading_config(secondary_tiers=[tier], chunks=8, **GEO)),
                  lambda: check_tier(tier)):
        with pytest.raises(ConfigError, match=r"g4\.url: "):
            build()


def test_a_g3_tier_ignores_the_g4_store_directory_of_a_shared_config(tmp_path, ro_cwd):
    """A config file shared by both tiers turns G4 on at a ``file://`` store under the read-only working directory;
    the G3Tier never opens G4. Before: ``ConfigError: g4.url: ...``."""
    cfg = tmp_path / "kvbm.yaml"
    cfg.write_text(f"g4:\n  enabled: true\n  url: file://{ro_cwd / 'kvbm-g3' / 'store'}\n  encrypt: false\n")
    tier = g3_tier(tmp_path / "g3", config=str(cfg))
    h = _round_trip(tier)
    try:
        assert type(h.tier.pool).__name__ == "G3Pool" and (tmp_path / "g3").is_dir()
    finally:
        h.shutdown()
    check_tier(tier)  # the launchers' preflight passes it too


def test_a_g3_tier_still_refuses_its_own_paths_naming_the_field(tmp_path, ro_cwd):
    tier = g3_tier(tmp_path / "g3")
    tier["g3"].pop("paths")  # the default ./kvbm-g3, in the read-only working directory
    for build in (lambda: TieringHarness(offloading_config(secondary_tiers=[tier], chunks=8, **GEO)),
                  lambda: check_tier(tier)):
        with pytest.raises(ConfigError, match=r"g3\.paths\[0\]: "):
            build()


def test_the_connectors_config_is_unchanged(tmp_path, ro_cwd):
    """The connector (``kv_connector_extra_config``) uses G3 unless ``g3.enabled`` is false: G3 on checks the
    ``g3.paths`` given as before; off, nothing of G3 is checked or opened, so G4 alone starts from a read-only cwd."""
    from kvbm_backend.integrations.tiers import open_tiers
    from kvbm_backend.integrations.vllm.extra_config import config_from_extra
    from tests.helpers.pools import tiny_ns
    g4 = {"enabled": True, "url": f"file://{tmp_path / 'store'}", "encrypt": False}
    with pytest.raises(ConfigError, match=r"kvbm_backend: g3\.paths\[0\]: "):
        config_from_extra({"kvbm_backend": {"g3": {"paths": ["./kvbm-g3"]}, "g4": g4}})
    cfg, _ = config_from_extra({"kvbm_backend": {"g3": {"enabled": False}, "g4": g4}})
    g3, g4pool = open_tiers(cfg, tiny_ns())
    try:
        assert g3 is None and type(g4pool).__name__ == "G4Pool"
    finally:
        if g4pool is not None:
            g4pool.close()
    assert not (ro_cwd / "kvbm-g3").is_dir()
    assert load_config({"g3": {"enabled": False, "paths": ["./kvbm-g3"]}}).g3.paths == ["./kvbm-g3"]
