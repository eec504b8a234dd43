"""The G4 drop line of the configured default tenant (config ``tenant``) when the keyring has no key for it.

Before, the pool did not know the config's ``tenant``: a configured default ``acme`` missing from a keyring that
creates no tenants was logged as "no data key for the tenant ... `kvbm-backend keys create`" (nothing said it was
the default tenant every request without a cache_salt has), and the empty tenant ``""`` was always called "the
default `tenant`" with "or set `tenant:` in the config", though the config had set it. Now
:func:`kvbm_backend.integrations.tiers.open_tiers` hands the config's ``tenant`` to the pool, and the line names
the default tenant by its setting, never by its id (the rule in ``G4Writer._drop_text``). Real pools from
``open_tiers`` over a real ``file://`` store with a real keyring (:func:`tests.helpers.g4_target.g4_target`)."""
from __future__ import annotations

import base64
import logging
import os

import pytest

from kvbm_backend.config import KeyringConfig, load_config
from kvbm_backend.crypto.keyring import Keyring
from kvbm_backend.integrations.tiers import open_tiers
from tests.helpers.g4_target import g4_target
from tests.helpers.g4_writer import namespace, put_blocks

TENANT = "acme-Secret-7"  # the configured default: must never appear in a log line


@pytest.fixture(params=["fs"])
def cfg(request, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBM_BACKEND_KEK", base64.b64encode(os.urandom(32)).decode())
    g4 = g4_target(request, tmp_path, "unused", auto_create_tenants=False)
    (tmp_path / "keys").mkdir(mode=0o700)
    Keyring.from_config(KeyringConfig(path=g4["keyring"]["path"])).close()  # an empty keyring: no tenant at all
    return load_config({"tenant": TENANT, "g3": {"enabled": False}, "g4": {"enabled": True, **g4}}, use_env=False)


def _drop_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "dropped_unknown_tenant" in r.getMessage()]


def test_the_configured_default_tenants_drop_line_names_it_by_its_setting_not_its_id(cfg, caplog):
    caplog.set_level(logging.WARNING, logger="kvbm_backend")
    _, g4 = open_tiers(cfg, namespace())
    assert g4 is not None
    try:
        assert put_blocks(g4, [1], TENANT).dropped == 1
        lines = _drop_lines(caplog)
        assert len(lines) == 1 and g4.pseudonym(TENANT).hex() in lines[0], caplog.text
        assert "the configured default tenant (the value of `tenant`, not logged: every request without a " \
               "cache_salt has it)" in lines[0], lines[0]
        assert f"`kvbm-backend keys create --keyring {cfg.g4.keyring.path} --tenant <the configured tenant>`" \
               in lines[0], lines[0]
        assert TENANT not in caplog.text and TENANT.lower() not in caplog.text.lower()
    finally:
        g4.close()


def test_the_empty_tenant_is_not_called_the_default_when_the_config_sets_another(cfg, caplog):
    caplog.set_level(logging.WARNING, logger="kvbm_backend")
    _, g4 = open_tiers(cfg, namespace())
    assert g4 is not None
    try:
        assert put_blocks(g4, [2], "").dropped == 1  # a request that named the empty tenant itself
        lines = _drop_lines(caplog)
        assert len(lines) == 1 and g4.pseudonym("").hex() in lines[0], caplog.text
        assert 'the empty tenant "" (not the default `tenant`: a request named it)' in lines[0], lines[0]
        assert f"keys create --keyring {cfg.g4.keyring.path} --tenant ''`" in lines[0], lines[0]
        assert "(the default `tenant`:" not in lines[0] and "set `tenant:`" not in lines[0], lines[0]
        assert TENANT not in caplog.text
    finally:
        g4.close()
