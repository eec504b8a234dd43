"""Every configuration field is documented, and every documented field does something.

The configuration reference's table (docs/configuration.md) must name exactly the fields of
:class:`kvbm_backend.config.KvbmBackendConfig` (nothing undocumented, nothing documented that does not
exist). ``FIELD_TESTS`` is the ledger of the tests that show each field's effect: a new field fails
here until it has a README row and a test named below, and each named test must exist and use the
field by name (so renaming or deleting a test cannot silently drop a field's coverage)."""
from __future__ import annotations

import ast
import math
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from kvbm_backend.config import KvbmBackendConfig

ROOT = Path(__file__).resolve().parents[2]

# field -> tests ("path::function") that show what it does; at least one of them names the field
FIELD_TESTS: dict[str, list[str]] = {
    "model": ["tests/integrations/vllm/test_connector_units.py::test_model_and_revision_from_the_config_name_the_namespace",
              "tests/integrations/vllm/test_namespace_identity.py::test_a_config_model_vllm_does_not_serve_is_one_warning_naming_both"],
    "revision": ["tests/integrations/vllm/test_connector_units.py::test_model_and_revision_from_the_config_name_the_namespace",
                 "tests/integrations/vllm/test_namespace_identity.py::"
                 "test_an_explicit_revision_keeps_the_quantization_and_overrides_suffixes"],
    "tenant": ["tests/integrations/vllm/test_tiering.py::test_g4_tier_store_then_load"],
    "g3.enabled": ["tests/pool/test_pool_conformance.py::test_open_tiers_opens_only_the_enabled_tiers",
                   "tests/core/test_config.py::test_g3_path_that_is_a_file_refused"],
    "g3.paths": ["tests/pool/g3/test_g3_pool.py::test_several_paths_stripe_blocks_across_every_directory",
                 "tests/core/test_config.py::test_g3_path_that_is_a_file_refused"],
    "g3.capacity_gb": ["tests/pool/g3/test_g3_pool.py::test_lru_eviction_order",
                       "tests/core/test_config.py::test_defaults_and_kvbm_env_names"],
    "g3.files_per_path": ["tests/pool/g3/test_g3_pool.py::test_adjacent_slots_and_striping",
                          "tests/pool/g3/test_g3_pool.py::test_several_paths_stripe_blocks_across_every_directory"],
    "g3.io_size_bytes": ["tests/pool/g3/test_g3_pool.py::test_adjacent_slots_and_striping"],
    "g3.engine": ["tests/pool/g3/test_g3_pool.py::test_engine_setting_picks_the_io_engine",
                  "tests/gpu/test_gpu_path.py::test_real_g3_pool_through_device_loader"],
    "g3.o_direct": ["tests/pool/g3/test_g3_pool.py::test_o_direct_setting_forces_o_direct_off_and_on",
                    "tests/pool/g3/test_g3_o_direct_reads.py::"
                    "test_o_direct_off_makes_device_and_layerwise_loads_read_buffered"],
    "g3.io_threads": ["tests/pool/g3/test_g3_pool.py::test_io_threads_bounds_the_engine_ops_in_flight"],
    "g3.write_queue_blocks": ["tests/pool/g3/test_g3_pool.py::test_queue_overflow_drops_without_blocking"],
    "g3.min_free_fraction": ["tests/pool/g3/test_g3_enospc.py::test_min_free_fraction_zero_fills_its_filesystem_and_keeps_working"],
    "g3.fsync": ["tests/pool/g3/test_g3_pipeline.py::test_fsync_setting_decides_whether_slab_files_are_fdatasynced"],
    "g3.group_commit_ms": ["tests/pool/g3/test_g3_group_commit.py::test_group_commit_ms_groups_pieces_under_one_barrier",
                           "tests/pool/g3/test_g3_group_commit.py::test_group_commit_ms_bounds_the_wait_for_pieces_in_flight"],
    "g3.group_commit_bytes": ["tests/pool/g3/test_g3_group_commit.py::test_group_commit_bytes_starts_the_barrier_without_waiting"],
    "g3.admission.policy": ["tests/pool/g3/test_g3_pool.py::test_admission_second_sighting",
                            "tests/core/test_config.py::test_dynamo_kvbm_disable_disk_offload_filter_env"],
    "g3.admission.min_sightings": ["tests/pool/g3/test_g3_pool.py::test_admission_second_sighting"],
    "g3.admission.tracker_entries": ["tests/pool/g3/test_g3_pool.py::test_admission_tracker_entries_bounds_the_sightings_remembered"],
    "g3.load_timeout_s": ["tests/pool/g3/test_g3_pool.py::test_load_timeout_is_a_miss_and_slot_stays_pinned"],
    "g3.device_path": ["tests/integrations/vllm/test_worker_device_path.py::test_device_path_setting_reaches_the_reader"],
    "g3.device_io_threads": ["tests/integrations/vllm/test_worker_device_path.py::"
                             "test_device_io_threads_size_a_cuda_load_and_io_threads_a_cpu_load",
                             "tests/gpu/test_gpu_path.py::test_device_io_threads_size_the_kvikio_pool_of_a_cuda_load",
                             "tests/pool/g3/test_g3_layerwise.py::test_layerwise_reader_threads_are_the_devices_setting"],
    "g3.device_checksum": ["tests/integrations/vllm/test_worker_device_path.py::test_device_checksum_setting_decides_the_frame_flags"],
    "g3.layerwise_load": ["tests/integrations/vllm/test_layerwise_units.py::test_layerwise_load_setting_makes_g3_hits_sync",
                          "tests/e2e/test_layerwise_e2e.py::test_layerwise_on_off_and_no_connector_agree",
                          "tests/integrations/vllm/test_connector_wiring.py::"
                          "test_layerwise_loads_are_not_offered_under_async_scheduling"],
    "g4.enabled": ["tests/pool/test_pool_conformance.py::test_open_tiers_opens_only_the_enabled_tiers",
                   "tests/pool/test_pool_conformance.py::test_open_pool_opens_the_tier_its_config_section_names"],
    "g4.url": ["tests/pool/g4/test_g4_factory.py::test_the_scheme_picks_the_store_and_the_config_its_options",
               "tests/pool/g4/test_g4_factory.py::test_unknown_scheme_is_a_value_error_naming_the_field_and_the_scheme",
               "tests/core/test_config.py::test_g4_url_typos_refused_at_load_naming_the_field"],
    "g4.endpoint_url": ["tests/pool/g4/test_g4_factory.py::test_the_scheme_picks_the_store_and_the_config_its_options",
                        "tests/core/test_config.py::test_g4_endpoint_url_typos_refused_at_load",
                        "tests/pool/g4/test_operator_logs.py::test_store_unavailable_at_start_logged_once"],
    "g4.region": ["tests/pool/g4/test_g4_factory.py::test_the_scheme_picks_the_store_and_the_config_its_options"],
    "g4.encrypt": ["tests/pool/g4/test_g4_pool.py::test_unencrypted_only_when_explicit_and_stats_say_so"],
    "g4.keyring.path": ["tests/crypto/test_crypto_keyring.py::test_keyring_config_read_only_auto_create_and_reload_interval"],
    "g4.keyring.kek_env": ["tests/crypto/test_crypto_keyring.py::test_kek_env_and_kek_file_choose_the_key_encryption_key"],
    "g4.keyring.kek_file": ["tests/crypto/test_crypto_keyring.py::test_kek_env_and_kek_file_choose_the_key_encryption_key"],
    "g4.keyring.rotate_after_uses": ["tests/crypto/test_crypto_keyring.py::test_keyring_config_read_only_auto_create_and_reload_interval",
                                     "tests/crypto/test_crypto_keyring.py::test_automatic_rotation_before_nonce_limit"],
    "g4.keyring.auto_create_tenants": ["tests/crypto/test_keyring_revocation.py::test_auto_create_tenants_off_drops_counts_and_logs_once"],
    "g4.keyring.max_auto_tenants": ["tests/crypto/test_keyring_revocation.py::test_max_auto_tenants_bounds_the_tenants_a_flood_creates"],
    "g4.keyring.read_only": ["tests/crypto/test_keyring_revocation.py::test_forced_read_only_keyring_never_writes",
                             "tests/crypto/test_keyring_reload.py::test_read_only_keyring_write_key_sees_operator_created_tenant_at_once"],
    "g4.keyring.reload_interval_s": ["tests/crypto/test_keyring_revocation.py::test_revocation_reaches_running_pool_within_reload_interval",
                                     "tests/crypto/test_crypto_keyring.py::test_keyring_config_read_only_auto_create_and_reload_interval"],
    "g4.timeout_s": ["tests/pool/g4/test_g4_outage.py::test_server_frozen_killed_and_restarted",
                     "tests/e2e/test_connector_e2e.py::test_stopped_g4_costs_at_most_its_timeout"],
    "g4.retries": ["tests/pool/g4/test_g4_outage.py::test_slow_answer_to_a_put_then_412_on_the_retry_counts_as_written",
                   "tests/pool/g4/test_g4_factory.py::test_the_scheme_picks_the_store_and_the_config_its_options"],
    "g4.max_inflight": ["tests/pool/g4/test_g4_fs_reads.py::test_g4_pool_reads_file_objects_through_its_bounce_buffers_and_reports_overflow",
                        "tests/pool/g4/test_g4_factory.py::test_the_scheme_picks_the_store_and_the_config_its_options"],
    "g4.put_timeout_s": ["tests/pool/g4/test_g4_obstore_s3.py::test_a_slow_uplink_is_not_an_outage_obstore_puts_finish_past_timeout_s",
                         "tests/pool/g4/test_g4_obstore_s3.py::test_a_put_answered_too_late_counts_landed_and_a_lost_one_unavailable"],
    "g4.write_queue_blocks": ["tests/pool/g4/test_g4_pool.py::test_offload_queue_bound_drops_and_counts"],
    "g4.breaker_failures": ["tests/pool/g4/test_g4_outage.py::test_server_frozen_killed_and_restarted",
                            "tests/pool/g4/test_operator_logs.py::test_outage_later_logs_open_once_and_closed_once"],
    "g4.breaker_reset_s": ["tests/pool/g4/test_operator_logs.py::test_store_unavailable_at_start_logged_once",
                           "tests/pool/g4/test_g4_outage.py::test_hung_shared_mount_reads_are_bounded_and_recover"],
    "g4.dir_fanout": ["tests/pool/g4/test_g4_pool.py::test_roundtrip_lookup_and_names"],
    "g4.s3_client": ["tests/pool/g4/test_g4_obstore_s3.py::test_s3_client_picks_the_store_class"],
    "g4.layout": ["tests/pool/g4/test_g4_canonical.py::test_per_rank_and_canonical_blocks_never_read_as_each_other",
                  "tests/e2e/test_anytp_e2e.py::test_tp1_g4_blocks_load_in_a_tp2_engine"],
    "g4.announce": ["tests/e2e/test_dynamo_router.py::test_router_credits_a_worker_with_g4_blocks_another_worker_wrote",
                    "tests/integrations/vllm/test_connector_wiring.py::test_wire_g4_announce_runs_kv_events_without_g3"],
    "g4.announce_interval_s": ["tests/pool/g4/test_g4_announce.py::test_the_background_thread_flushes_and_polls_every_interval"],
    "g4.announce_ttl_s": ["tests/pool/g4/test_g4_announce.py::test_expired_announcements_are_withdrawn_and_deleted"],
    "g4.fsync": ["tests/pool/g4/test_g4_factory.py::test_g4_fsync_decides_whether_file_objects_and_their_directories_are_fsynced"],
    "load_gil_switch_ms": ["tests/integrations/vllm/test_load_priority.py::test_the_interval_is_shortened_while_a_worker_load_is_in_flight_and_restored_after",
                           "tests/integrations/vllm/test_load_priority.py::test_the_default_shortens_it_and_null_leaves_the_interpreter_alone"],
    "metrics.enabled": ["tests/core/test_metrics.py::test_dynamo_metrics_env_names"],
    "metrics.port": ["tests/core/test_metrics.py::test_metrics_port_serves_kvbm_series_when_tiers_open",
                     "tests/core/test_metrics.py::test_metrics_port_in_use_is_one_error_and_the_tiers_still_open"],
    "metrics.addr": ["tests/core/test_metrics.py::test_metrics_port_serves_kvbm_series_when_tiers_open",
                     "tests/core/test_metrics.py::test_dynamo_metrics_env_names",
                     "tests/core/test_metrics.py::test_metrics_addr_must_be_an_ip_address_or_a_host_name"],
}


def config_fields(model: type[BaseModel] = KvbmBackendConfig, prefix: str = "") -> list[str]:
    """Dotted names of the leaf fields of ``model`` (sections recurse: ``g3.admission.policy``)."""
    out = []
    for name, f in model.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out += config_fields(f.annotation, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def readme_fields() -> list[str]:
    """Field names in the first cell of each row of the configuration reference's (docs/configuration.md)
    ``| field | default | meaning |`` table."""
    lines = (ROOT / "docs" / "configuration.md").read_text().splitlines()
    start = lines.index("| field | default | meaning |")
    names = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        names += re.findall(r"`([^`]+)`", ln.split("|")[1])
    return names


def test_readme_table_names_exactly_the_config_fields():
    documented, fields = readme_fields(), config_fields()
    assert len(documented) == len(set(documented)), "a field has two rows in docs/configuration.md"
    assert sorted(set(fields) - set(documented)) == [], "config fields missing from docs/configuration.md"
    assert sorted(set(documented) - set(fields)) == [], "docs/configuration.md rows for fields the config does not have"


def test_every_field_has_a_test_in_the_ledger():
    assert sorted(set(config_fields()) - set(FIELD_TESTS)) == [], "add the field's test to FIELD_TESTS"
    assert sorted(set(FIELD_TESTS) - set(config_fields())) == [], "FIELD_TESTS names fields that do not exist"


_SOURCES: dict[str, dict[str, str]] = {}


def _test_sources(path: str) -> dict[str, str]:
    """{test function name: its source, decorators included} of a test file."""
    if path not in _SOURCES:
        src = (ROOT / path).read_text()
        _SOURCES[path] = {
            n.name: "".join(ast.get_source_segment(src, d) or "" for d in n.decorator_list) + ast.get_source_segment(src, n)
            for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    return _SOURCES[path]


@pytest.mark.parametrize("field", sorted(FIELD_TESTS))
def test_the_named_tests_exist_and_use_the_field(field):
    leaf = field.rsplit(".", 1)[-1]
    uses = re.compile(rf"\b{leaf}\b")
    used = False
    for ref in FIELD_TESTS[field]:
        path, name = ref.split("::")
        sources = _test_sources(path)
        assert name in sources, f"{field}: {ref} does not exist"
        used |= bool(uses.search(sources[name]))
    assert used, f"{field}: none of {FIELD_TESTS[field]} names {leaf!r}"


def test_metrics_docs_say_one_endpoint_per_pod_and_port():
    """Review finding (metrics 6): docs/configuration.md's metrics row and MetricsConfig.port's docstring said
    "one server per process", while the code (kvbm_backend/metrics.py, metrics_mp.py) and docs/operations.md
    serve one endpoint per pod and port for every process. Each place says the same now."""
    from kvbm_backend import metrics
    row = next(ln for ln in (ROOT / "docs" / "configuration.md").read_text().splitlines()
               if ln.startswith("| `metrics.enabled`"))
    src = (ROOT / "kvbm_backend" / "config.py").read_text()
    cls = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == "MetricsConfig")
    body = cls.body
    port_doc = next(body[i + 1].value.value for i, n in enumerate(body[:-1])
                    if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "port")
    for where, text in (("docs/configuration.md", row), ("MetricsConfig.port", port_doc),
                        ("kvbm_backend/metrics.py", metrics.__doc__ or "")):
        text = " ".join(text.split())
        assert "one server per process" not in text, where
        assert "one endpoint per pod and port" in text.lower(), where


# docs/migrating.md's KVBM table: a value to set each variable to, and the field path -> value it must give
KVBM_SAMPLES = {"DYN_KVBM_DISK_CACHE_DIR": ("/a:/b", ("g3", "paths"), ["/a", "/b"]),
                "DYN_KVBM_DISK_CACHE_GB": ("7", ("g3", "capacity_gb"), 7),
                "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": ("true", ("g3", "admission", "policy"), "all"),
                "DYN_KVBM_DISK_DISABLE_O_DIRECT": ("true", ("g3", "o_direct"), "off"),
                "DYN_KVBM_METRICS": ("true", ("metrics", "enabled"), True),
                "DYN_KVBM_METRICS_PORT": ("9999", ("metrics", "port"), 9999)}


def test_migrating_table_maps_exactly_the_kvbm_variables_the_code_reads(caplog):
    """docs/migrating.md "From Dynamo KVBM" names exactly the ``DYN_KVBM_*`` variables the code reads or warns
    about (kvbm_backend/config_sources.py), and each does what its row says, live through
    :func:`~kvbm_backend.config_sources.env_overrides` and :func:`~kvbm_backend.config.load_config`: a mapped one
    sets the field its row names (the k-th variable of a row the k-th field), a "(warning)" one sets nothing and logs one WARNING naming it."""
    import logging

    from kvbm_backend import config_sources
    from kvbm_backend.config import load_config
    text = (ROOT / "docs" / "migrating.md").read_text()
    rows = re.findall(r"^\| (`DYN_KVBM_\w+`(?:, `DYN_KVBM_\w+`)*) \| (.+) \|$", text, re.M)
    documented = {n: right for names, right in rows for n in re.findall(r"DYN_KVBM_\w+", names)}
    position = {n: i for names, _ in rows for i, n in enumerate(re.findall(r"DYN_KVBM_\w+", names))}
    read = set(re.findall(r'"(DYN_KVBM_\w+)"', (ROOT / "kvbm_backend" / "config_sources.py").read_text()))
    assert set(documented) == read, (sorted(set(documented) - read), sorted(read - set(documented)))
    warned = {n for n, right in documented.items() if "(warning)" in right}
    assert warned == set(config_sources.KVBM_ONLY_ENV)
    assert set(documented) - warned == set(KVBM_SAMPLES)
    for name, (value, path, want) in KVBM_SAMPLES.items():
        # a row of several variables names their fields in the same order (`metrics.enabled`, `metrics.port`)
        field = re.findall(r"`((?:g3|g4|metrics)\.[a-z_.]+)", documented[name])[position[name]]
        assert tuple(field.split(".")) == path, (name, field)
        got = load_config({}, environ={name: value})
        for part in path:
            got = getattr(got, part)
        assert got == want, (name, got)
    config_sources._kvbm_only_warned.clear()
    with caplog.at_level(logging.WARNING, logger="kvbm_backend.config"):
        for name in sorted(warned):
            assert config_sources.env_overrides({name: "1"}) == {}, name
    for name in warned:
        assert sum(r.getMessage().startswith(f"{name} is Dynamo KVBM's setting") and "docs/migrating.md" in r.getMessage()
                   for r in caplog.records) == 1, name


def _name_fields(parts: list[str]) -> list[str]:
    """``{tenant_pseudonym_hex}`` / ``TENANT_PSEUDONYM`` -> ``tenant_pseudonym``."""
    return [re.sub(r"_hex$", "", p.strip("{}").lower()) for p in parts]


def test_g4_object_names_in_the_configuration_reference_are_the_code_s():
    """Review finding (docs 1): docs/configuration.md "G4 set-up" gave block names as
    ``PREFIX/NS_FINGERPRINT/TENANT_PSEUDONYM/RANK/FANOUT/SEQHASH``, the format 1 names (the sequence hash in clear)
    only ``g4 migrate`` reads; the code ends a name with the keyed block id. Its pattern, naming.py's and
    docs/format.md "G4 names"' name the same components, and a name the code makes ends with the keyed id."""
    from kvbm_backend.pool.g4 import naming
    conf = next(ln for ln in (ROOT / "docs" / "configuration.md").read_text().splitlines()
                if ln.startswith("- Names: `"))
    doc = re.search(r"`([^`]+)`", conf).group(1).split("/")
    code = re.search(r"``(\{ns_fingerprint\}/[^`]+)``", naming.__doc__ or "").group(1).split("/")
    fmt = (ROOT / "docs" / "format.md").read_text()
    section = fmt[fmt.index("## G4 names"):]
    spec = re.search(r"`(\{prefix\}/\{ns_fingerprint\}/\{tenant[^`]+)`", section).group(1).split("/")
    assert doc[0] == "PREFIX" and spec[0] == "{prefix}"
    assert _name_fields(doc[1:]) == _name_fields(code) == _name_fields(spec[1:]), (doc, code, spec)
    assert _name_fields(code)[-1] == "block_id"
    namer = naming.TenantNamer("0123456789abcdef", bytes(range(16)), bytes(32), 256)
    name = namer.name(3, 0x1234)
    assert naming.parse_block_name(name) == {"ns": "0123456789abcdef", "tenant": bytes(range(16)).hex(), "rank": 3,
                                             "fan": name.split("/")[3], "block_id": namer.block_id(3, 0x1234).hex(),
                                             "legacy": False}
    assert name.split("/")[-1] == namer.block_id(3, 0x1234).hex() != f"{0x1234:016x}"


def numeric_fields(model: type[BaseModel] = KvbmBackendConfig, prefix: str = ""):
    """(dotted name, section class, field name, field) of every int/float leaf field (``X | None`` too)."""
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from numeric_fields(ann, f"{prefix}{name}.")
            continue
        kinds = set(typing.get_args(ann)) - {type(None)} if typing.get_args(ann) else {ann}
        if kinds and kinds <= {int, float}:
            yield prefix + name, model, name, f


def upper_bound(section: type[BaseModel], name: str, f) -> tuple[float, bool]:
    """The field's upper bound from its pydantic constraints, and whether the bound itself is allowed; checked
    against validation (the bound, or just below an exclusive one, is accepted, just beyond it refused), so a
    validator that bounds it lower fails here."""
    import annotated_types as at
    from pydantic import ValidationError
    les = [m.le for m in f.metadata if isinstance(m, at.Le)]
    lts = [m.lt for m in f.metadata if isinstance(m, at.Lt)]
    assert len(les) + len(lts) == 1, f"{section.__name__}.{name}: no upper bound (le= or lt=)"
    bound, inclusive = (les[0], True) if les else (lts[0], False)
    is_int = int in (set(typing.get_args(f.annotation)) or {f.annotation})
    below = bound - 1 if is_int else math.nextafter(bound, -math.inf)
    beyond = bound + 1 if is_int else math.nextafter(bound, math.inf)
    section.model_validate({name: bound if inclusive else below})
    for refused in ([beyond] if inclusive else [bound, beyond]):
        with pytest.raises(ValidationError):
            section.model_validate({name: refused})
    return bound, inclusive


def _bound_spellings(bound: float, field: str) -> set[str]:
    """How a row may write ``bound``: 1000000, 1,000,000; 2^26 (powers of two); 1 GiB (``_bytes`` fields)."""
    n = int(bound) if float(bound).is_integer() else bound
    out = {str(n), f"{n:,}"}
    if isinstance(n, int) and n >= 1024 and n & (n - 1) == 0:
        out.add(f"2^{n.bit_length() - 1}")
        if field.endswith("_bytes"):
            for k, unit in enumerate(("KiB", "MiB", "GiB", "TiB"), 1):
                if n % 1024 ** k == 0:
                    out.add(f"{n // 1024 ** k} {unit}")
    return out


def _meaning(row: str) -> str:
    """A table row's third cell on (the meaning), backticks dropped."""
    return "|".join(row.replace("\\|", "\x00").split("|")[3:]).replace("\x00", "|").replace("`", "")


def test_every_numeric_field_s_upper_bound_is_in_its_row():
    """Review finding (docs 3): docs/configuration.md promises every number has an upper bound stated; nine
    fields (g3.files_per_path, g3.io_threads, g4.max_inflight, g4.dir_fanout, g4.retries,
    g4.keyring.reload_interval_s, g4.announce_interval_s, g4.announce_ttl_s, load_gil_switch_ms) stated theirs
    nowhere. Each numeric field's bound, taken from the model, is in its row as "at most B", "A to B", "A-B"."""
    lines = (ROOT / "docs" / "configuration.md").read_text().splitlines()
    rows = {}
    for ln in lines[lines.index("| field | default | meaning |") + 2:]:
        if not ln.startswith("|"):
            break
        for name in re.findall(r"`([^`]+)`", ln.split("|")[1]):
            rows[name] = ln
    fields = list(numeric_fields())
    assert len(fields) >= 20
    missing = []
    for dotted, section, name, f in fields:
        bound, _ = upper_bound(section, name, f)
        alts = "|".join(re.escape(s) for s in sorted(_bound_spellings(bound, name), key=len, reverse=True))
        if not re.search(rf"(?:at most|up to|below|\bto|-)\s*(?:{alts})(?![\d^]|[.,]\d)", _meaning(rows[dotted])):
            missing.append(f"{dotted} <= {bound}")
    assert not missing, f"docs/configuration.md rows that do not state the field's upper bound: {missing}"
