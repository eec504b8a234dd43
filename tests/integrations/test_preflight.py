"""The launchers' preflight checks the ``--kv-transfer-config`` vLLM will use: the last one given, under either
spelling (vLLM's parser takes ``--kv_transfer_config`` too). Review finding (2026-11-29): the first was checked,
so an operator's config passed after a launch script's own went unchecked and the engine started with it."""
from __future__ import annotations

import json

import pytest

from kvbm_backend.integrations.preflight import check_argv


def _ktc(tmp_path, capacity_gb):
    return json.dumps({"kv_connector": "KvbmBackendConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "kvbm_backend": {"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": capacity_gb}}}})


def test_the_last_kv_transfer_config_of_either_spelling_is_checked(tmp_path):
    good, bad = _ktc(tmp_path, 1), _ktc(tmp_path, -1)
    assert check_argv(["serve", "m", "--kv-transfer-config", good]) is None
    for argv in (["--kv-transfer-config", good, "--kv-transfer-config", bad],
                 ["--kv-transfer-config", good, f"--kv_transfer_config={bad}"],
                 ["--kv_transfer_config", bad]):
        why = check_argv(["serve", "m", *argv])
        assert why and "g3.capacity_gb" in why, (argv, why)
    assert check_argv(["serve", "m", "--kv-transfer-config", bad, "--kv-transfer-config", good]) is None


def _encrypted_g4(tmp_path):
    return {"g4": {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "encrypt": True,
                   "keyring": {"path": str(tmp_path / "keys" / "keyring.json"), "kek_env": "KVBM_TEST_KEK"}}}


def test_a_dry_run_creates_no_keyring_and_no_kek_file(tmp_path, monkeypatch):
    """Review finding (2026-11-29): the scripts' dry run ("print, check, do not start") created the keyring and a
    plaintext KEK file on the host. A dry-run check writes nothing; the real start still creates them. ``kek_env`` not
    named and ``$KVBM_BACKEND_KEK`` unset: the KEK file is the KEK (a non-default variable left unset is refused:
    tests/crypto/test_kek_env_named.py)."""
    monkeypatch.delenv("KVBM_BACKEND_KEK", raising=False)
    monkeypatch.delenv("KVBM_BACKEND__G4__KEYRING__KEK_ENV", raising=False)
    (tmp_path / "keys").mkdir()
    g4 = _encrypted_g4(tmp_path)
    del g4["g4"]["keyring"]["kek_env"]
    ktc = json.dumps({"kv_connector": "KvbmBackendConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"kvbm_backend": {"g3": {"enabled": False}, **g4}}})
    assert check_argv(["serve", "m", "--kv-transfer-config", ktc], create=False) is None
    assert list((tmp_path / "keys").iterdir()) == []
    assert check_argv(["serve", "m", "--kv-transfer-config", ktc]) is None  # the launcher's own check creates it
    assert (tmp_path / "keys" / "keyring.json").exists() and (tmp_path / "keys" / "keyring.json.kek").exists()


def test_native_tiers_are_checked_too(tmp_path, monkeypatch):
    """Review finding (2026-11-29): only KvbmBackendConnector was checked; a G4Tier whose keyring was wrapped under
    another KEK passed the tiering script's check and failed inside vLLM's workers (API server up, serving
    nothing). G3Tier/G4Tier entries of an OffloadingConnector (alone or in a MultiConnector) are checked now."""
    import base64
    import os

    from kvbm_backend.config import load_config
    from kvbm_backend.crypto.keyring import Keyring
    monkeypatch.setenv("KVBM_TEST_KEK", base64.b64encode(os.urandom(32)).decode())
    g4 = _encrypted_g4(tmp_path)
    (tmp_path / "keys").mkdir()
    Keyring.from_config(load_config(g4, use_env=False).g4.keyring).close()  # wrapped under the first KEK
    cfg = tmp_path / "kvbm.yaml"
    cfg.write_text(json.dumps({"g3": {"paths": [str(tmp_path / "g3")], "capacity_gb": 1}, **g4}))

    def tiering(tiers):
        return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec", "secondary_tiers": tiers}})
    mod = "kvbm_backend.integrations.vllm.tiering"
    ok = tiering([{"type": "G3Tier", "module_path": mod, "config": str(cfg)},
                  {"type": "G4Tier", "module_path": mod, "config": str(cfg)}])
    assert check_argv(["serve", "m", "--kv-transfer-config", ok]) is None
    monkeypatch.setenv("KVBM_TEST_KEK", base64.b64encode(os.urandom(32)).decode())  # another KEK
    why = check_argv(["serve", "m", "--kv-transfer-config", ok])
    # the G3Tier, first, opens that keyring too: it follows its revocations (since 2026-12, tier_revoked)
    assert why and "G3Tier" in why and "g4.keyring" in why and "KEK" in why, why
    g4_alone = tiering([{"type": "G4Tier", "module_path": mod, "config": str(cfg)}])
    why = check_argv(["serve", "m", "--kv-transfer-config", g4_alone])
    assert why and "G4Tier" in why and "KEK" in why, why
    bad_g3 = tiering([{"type": "G3Tier", "module_path": mod, "config": str(cfg), "g3": {"capacity_gb": -1}}])
    multi = json.dumps({"kv_connector": "MultiConnector", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "NixlConnector"}, json.loads(bad_g3)]}})
    why = check_argv(["serve", "m", "--kv-transfer-config", multi])
    assert why and "G3Tier" in why and "g3.capacity_gb" in why, why
    other = tiering([{"type": "fs", "root_dir": "/nowhere"}])  # vLLM's own tiers are not ours to check
    assert check_argv(["serve", "m", "--kv-transfer-config", other]) is None


def test_a_g4_handoff_worker_without_g4_is_refused(tmp_path):
    """Review finding (2026-11-30, r1/r5): ``disagg_prefill_g4.sh`` started without G4 and said nothing (the dry
    run's effective line showed g4.enabled=false [default], exit 0); the prefill worker's blocks reached only its
    own G3, which no other worker can open, and each decode request waited ``handoff_wait_s`` for them. With our
    connector alone (the G4 handoff) a prefill or decode worker needs G4, and a prefill worker save_to_g4."""
    g3 = {"paths": [str(tmp_path / "g3")], "capacity_gb": 1}
    g4 = {"enabled": True, "url": f"file://{tmp_path / 'g4'}", "encrypt": False}

    def ktc(backend, connector="KvbmBackendConnector", **opts):
        ours = {"kv_connector": "KvbmBackendConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"kvbm_backend": backend, **opts}}
        if connector == "MultiConnector":
            return json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
                "connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_both"}, ours]}})
        return json.dumps(ours)

    no_g4 = ktc({"g3": g3})
    for mode in ("prefill", "decode"):
        why = check_argv(["--disaggregation-mode", mode, "--kv-transfer-config", no_g4], create=False)
        assert why and why.startswith("kv_connector_extra_config: g4.enabled: --disaggregation-mode " + mode), why
        assert "G3 is private" in why
        assert check_argv([f"--disaggregation-mode={mode}", "--kv-transfer-config", ktc({"g3": g3, "g4": g4})]) is None
    why = check_argv(["--disaggregation-mode", "prefill", "--kv-transfer-config",
                      ktc({"g3": g3, "g4": g4}, save_to_g4=False)])
    assert why and "save_to_g4" in why, why
    assert check_argv(["--disaggregation-mode", "decode", "--kv-transfer-config",
                       ktc({"g3": g3, "g4": g4}, save_to_g4=False)]) is None  # a decode worker only reads G4
    # aggregated, or beside NixlConnector (NIXL carries the KV): G3 alone is fine
    assert check_argv(["--kv-transfer-config", no_g4]) is None
    assert check_argv(["--disaggregation-mode", "agg", "--kv-transfer-config", no_g4]) is None
    assert check_argv(["--disaggregation-mode", "prefill", "--kv-transfer-config",
                       ktc({"g3": g3}, connector="MultiConnector")]) is None


def test_the_disaggregation_mode_from_dynamos_environment_variable_is_checked(tmp_path, monkeypatch):
    """Review finding (2026-11-30, dyn): ``dynamo.vllm`` takes ``--disaggregation-mode`` from
    ``DYN_VLLM_DISAGGREGATION_MODE`` where the flag is absent (its parser's default; the flag wins where both are
    given), but the preflight read only the flag: a G3-only worker of our connector alone, made a prefill worker by
    the variable, passed (dry run included) and promised blocks no decode worker could read."""
    g3 = {"paths": [str(tmp_path / "g3")], "capacity_gb": 1}
    no_g4 = json.dumps({"kv_connector": "KvbmBackendConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"kvbm_backend": {"g3": g3}}})
    for mode in ("prefill", "decode"):
        monkeypatch.setenv("DYN_VLLM_DISAGGREGATION_MODE", mode)
        why = check_argv(["--model", "m", "--kv-transfer-config", no_g4], create=False)
        assert why and why.startswith(
            f"kv_connector_extra_config: g4.enabled: DYN_VLLM_DISAGGREGATION_MODE={mode} with"), why
        # the flag beats the variable, as in dynamo.vllm's parser
        assert check_argv(["--disaggregation-mode", "agg", "--kv-transfer-config", no_g4], create=False) is None
    monkeypatch.setenv("DYN_VLLM_DISAGGREGATION_MODE", "agg")
    why = check_argv(["--disaggregation-mode", "prefill", "--kv-transfer-config", no_g4], create=False)
    assert why and "g4.enabled: --disaggregation-mode prefill with" in why, why
    assert check_argv(["--kv-transfer-config", no_g4], create=False) is None


def test_a_g3_path_that_cannot_be_created_is_refused_before_the_engine_starts(tmp_path):
    """Review finding (2026-11-30, dyn): a missing ``g3.paths`` entry whose nearest existing ancestor this process
    cannot write (the scripts' default ``/mnt/nvme0/kvbm`` on a host without that mount, for a non-root worker)
    passed the preflight and the dry run: "a missing parent's permissions are not judged". The pool's
    ``makedirs_private`` then failed inside vLLM's worker (a traceback there, not one line here). Root bypasses
    directory permissions, so as root the check runs with the effective uid of ``nobody`` (a real permission
    check, as tests/core/test_config.py does)."""
    import os
    import tempfile

    import pytest

    from kvbm_backend.fsmodes import makedirs_private
    from tests.core.test_config import _effective_uid
    uid = 65534 if os.geteuid() == 0 else None
    d = tempfile.mkdtemp(prefix="kvbm-ro-", dir="/tmp")  # /tmp: reachable by `nobody` (pytest's tmp is 0700)
    g3 = os.path.join(d, "nvme0", "kvbm")
    ktc = json.dumps({"kv_connector": "KvbmBackendConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"kvbm_backend": {"g3": {"paths": [g3], "capacity_gb": 1}}}})
    try:
        os.chmod(d, 0o555)
        with _effective_uid(uid):
            with pytest.raises(PermissionError):  # what the pool would meet inside the engine
                makedirs_private(g3)
            why = check_argv(["--model", "m", "--kv-transfer-config", ktc], create=False)
        assert why and why.startswith("kv_connector_extra_config.kvbm_backend: g3.paths[0]: cannot be created: "), why
        assert f"{d} is not writable by this process" in why, why
        os.chmod(d, 0o777)
        with _effective_uid(uid):
            assert check_argv(["--model", "m", "--kv-transfer-config", ktc], create=False) is None
    finally:
        os.chmod(d, 0o700)
        import shutil
        shutil.rmtree(d)


def test_the_kv_transfer_config_vllm_resolves_from_config_files_and_dotted_options_is_checked(tmp_path):
    """Review finding (2026-11-30, pre): the preflight read only ``--kv-transfer-config JSON`` flags. vLLM 0.32's
    ``FlexibleArgumentParser`` also takes it from ``--config FILE.yaml`` (a mapping or a JSON string; the command
    line's flags win over the file's) and from dotted ``--kv-transfer-config.KEY=V`` options, merged into one JSON
    given after the others (so it replaces a full one). A bad G3 setting given so passed the check and failed
    inside vLLM's worker. The check now takes the config vLLM's own parser resolves."""
    import yaml
    good, bad = _ktc(tmp_path, 1), _ktc(tmp_path, -1)

    def config(name, body):
        f = tmp_path / name
        f.write_text(yaml.safe_dump(body))
        return str(f)

    bad_map = config("bad_map.yaml", {"kv-transfer-config": json.loads(bad), "port": 8000})
    bad_str = config("bad_str.yaml", {"kv_transfer_config": bad})
    good_map = config("good_map.yaml", {"kv-transfer-config": json.loads(good)})
    dotted = ["--kv-transfer-config.kv_connector", "KvbmBackendConnector", "--kv_transfer_config.kv_role=kv_both",
              f"--kv-transfer-config.kv_connector_extra_config.kvbm_backend.g3.paths+={tmp_path / 'g3'}"]
    refused = {
        "config mapping": ["serve", "m", "--config", bad_map],
        "config JSON string, no subcommand": ["--model", "m", "--config", bad_str],
        "config, other flags after it": ["serve", "m", "--config", bad_map, "--port", "1"],
        "dotted": ["serve", "m", *dotted, "--kv-transfer-config.kv_connector_extra_config.kvbm_backend.g3.capacity_gb",
                   "-1"],
        "dotted after a good full JSON": ["serve", "m", "--kv-transfer-config", good, *dotted,
                                          "--kv-transfer-config.kv_connector_extra_config.kvbm_backend.g3."
                                          "capacity_gb=-1"],
        "equals form": ["serve", "m", f"--kv-transfer-config={good}", f"--kv-transfer-config={bad}"],
    }
    for form, argv in refused.items():
        why = check_argv(argv, create=False)
        assert why and "g3.capacity_gb" in why, (form, why)
    passed = {
        "config mapping": ["serve", "m", "--config", good_map],
        "the command line beats the file": ["serve", "m", "--config", bad_map, "--kv-transfer-config", good],
        "dotted": ["serve", "m", *dotted, "--kv-transfer-config.kv_connector_extra_config.kvbm_backend.g3."
                   "capacity_gb=1"],
    }
    for form, argv in passed.items():
        assert check_argv(argv, create=False) is None, form
    # a dotted option alone replaces the full JSON naming ours: vLLM would run without our connector
    why = check_argv(["serve", "m", "--kv-transfer-config", good,
                      "--kv-transfer-config.kv_connector_extra_config.kvbm_backend.g3.capacity_gb=1"], create=False)
    assert why and "names no kv_connector" in why, why
    # a --config vLLM cannot read: one line naming it, not a silent pass
    for path in (str(tmp_path / "missing.yaml"), str(tmp_path / "kvbm.json")):
        why = check_argv(["serve", "m", "--config", path, "--kv-transfer-config", good], create=False)
        assert why and why.startswith(f"--config {path}: vLLM cannot read its arguments") and "not checked" in why, why


@pytest.mark.slow  # imports vLLM (torch) and builds its parsers: ~20 s on a busy 2-core machine
def test_an_abbreviated_kv_transfer_config_is_resolved_as_vllms_parser_resolves_it(tmp_path):
    """Review finding (2026-11-30): vLLM 0.32's ``FlexibleArgumentParser`` is an ``argparse.ArgumentParser`` with
    ``allow_abbrev`` left True (``vllm serve``'s parser and the engine parser ``dynamo.vllm`` hands vLLM's options
    to), so ``--kv-transfer-conf JSON`` (any unambiguous prefix, either spelling, ``=V``, dotted) is the
    ``--kv-transfer-config`` the engine uses. The preflight matched the full name only: a bad G3 setting given so
    passed the check (None) and failed inside vLLM's worker. It now takes the value vLLM's own parser assigns."""
    import yaml
    good, bad = _ktc(tmp_path, 1), _ktc(tmp_path, -1)
    cfg = tmp_path / "abbrev.yaml"
    cfg.write_text(yaml.safe_dump({"kv-transfer-conf": json.loads(bad)}))
    refused = {
        "prefix": ["serve", "m", "--kv-transfer-conf", bad],
        "short prefix, underscores, =V": ["serve", "m", f"--kv_t={bad}"],
        "an abbreviation after the full name wins": ["serve", "m", "--kv-transfer-config", good, "--kv-tr", bad],
        "dynamo.vllm form (no subcommand)": ["--model", "m", "--kv-transfer-co", bad],
        "dotted under an abbreviated name": [
            "serve", "m", "--kv-transfer-conf.kv_connector", "KvbmBackendConnector", "--kv-transfer-conf.kv_role",
            "kv_both", f"--kv-transfer-conf.kv_connector_extra_config.kvbm_backend.g3.paths+={tmp_path / 'g3'}",
            "--kv-transfer-conf.kv_connector_extra_config.kvbm_backend.g3.capacity_gb=-1"],
        "abbreviated key in --config FILE": ["serve", "m", "--config", str(cfg)],
    }
    for form, argv in refused.items():
        why = check_argv(argv, create=False)
        assert why and "g3.capacity_gb" in why, (form, why)
    assert check_argv(["serve", "m", "--kv-transfer-conf", bad, "--kv-transfer-config", good], create=False) is None
    assert check_argv(["serve", "m", "--kv-transfer-conf", good], create=False) is None
    # an ambiguous prefix: vLLM refuses the command line, so the preflight names it instead of passing it
    why = check_argv(["serve", "m", "--kv", bad], create=False)
    assert why and "ambiguous option: --kv" in why and "not checked" in why, why


def test_a_native_tier_whose_section_is_off_is_refused_as_the_tier_refuses_it(tmp_path, monkeypatch):
    """Review finding (2026-12-01): a G3Tier with ``g3.enabled: false`` and a G4Tier with ``g4.enabled: false`` passed
    the preflight (the G4 check even forced ``enabled`` on), and the tiers opened their pools anyway. The tiers refuse
    such a config now (tests/integrations/vllm/test_tiering_config.py) and the preflight says so first, with the same
    line, naming the field, in a dry run too; a G4Tier whose g4.enabled is unset (the tier is the opt-in) passes."""
    monkeypatch.delenv("KVBM_BACKEND__G3__ENABLED", raising=False)
    monkeypatch.delenv("KVBM_BACKEND__G4__ENABLED", raising=False)
    mod = "kvbm_backend.integrations.vllm.tiering"
    cfg = tmp_path / "kvbm.yaml"
    cfg.write_text(f"g3: {{paths: [{tmp_path / 'g3'}], enabled: false}}\n"
                   f"g4: {{url: 'file://{tmp_path / 'g4'}', encrypt: false}}\n")

    def argv(*tiers):
        return ["serve", "m", "--kv-transfer-config", json.dumps({
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "secondary_tiers": list(tiers)}})]
    g3t = {"type": "G3Tier", "module_path": mod, "config": str(cfg)}
    g4t = {"type": "G4Tier", "module_path": mod, "config": str(cfg)}
    for create in (True, False):
        why = check_argv(argv(g3t, g4t), create=create)
        assert why and why.startswith("kv_connector_extra_config: secondary_tiers G3Tier: g3.enabled: false, but "
                                      "secondary_tiers has a G3Tier"), why
        assert "set g3.enabled: true" in why, why
    assert check_argv(argv(g4t)) is None  # g4.enabled unset: the G4Tier is the opt-in
    why = check_argv(argv({**g4t, "g4": {"enabled": False}}))
    assert why and why.startswith("kv_connector_extra_config: secondary_tiers G4Tier: g4.enabled: false"), why
    assert check_argv(argv({**g3t, "g3": {"enabled": True}}, g4t)) is None  # the tier's own key turns it on
    assert not (tmp_path / "g3").exists() and not (tmp_path / "g4").exists()
