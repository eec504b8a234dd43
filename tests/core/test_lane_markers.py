"""The lane markers of tests/conftest.py (docs/testing.md "Markers"): a module's declared ``pytestmark`` is read
without importing it, and a module is skipped at collection only when ``-m`` deselects every test it can hold."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import _MARKERS, _module_always_deselected, _static_marks

TESTS = Path(__file__).resolve().parents[1]
UNIT = "not slow and not vllm and not s3 and not gpu"
LANES = {"unit": UNIT, "side": f"not ({UNIT}) and side", "engine": f"not ({UNIT}) and not side"}


class _Config:
    """What the two hooks read of pytest's config: the ``-m`` expression."""

    def __init__(self, expr: str):
        self.expr = expr

    def getoption(self, name, default=None):
        assert name == "markexpr"
        return self.expr


@pytest.mark.parametrize("src, marks", [
    ("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]\n", {"slow", "vllm"}),
    ("import pytest\npytestmark = pytest.mark.side\n", {"side"}),
    ("import pytest\npytestmark = (pytest.mark.vllm,)\npytestmark += [pytest.mark.slow]\n", {"vllm", "slow"}),
    ("import pytest\npytestmark = [pytest.mark.slow]\npytestmark.append(pytest.mark.skip(reason='x'))\n", {"slow"}),
    ("import pytest\npytestmark = pytest.mark.skipif(True, reason='x')\n", set()),        # a call, not a lane marker
    ("import pytest\nif True:\n    pytestmark = [pytest.mark.slow]\n", set()),               # conditional: not read
    ("import pytest\npytestmark = [pytest.mark.slow]\npytestmark = [pytest.mark.vllm]\n", {"vllm"}),  # the last wins
    ("import pytest\npytestmark = [pytest.mark.flaky, pytest.mark.gpu]\n", {"gpu"}),       # only lane markers
    ("def broken(:\n", set()),                                                           # unreadable: nothing
])
def test_static_marks_reads_the_module_level_pytestmark(tmp_path, src, marks):
    f = tmp_path / "test_x.py"
    f.write_text(src)
    assert _static_marks(f) == frozenset(marks)


def test_a_module_is_left_unimported_only_when_every_test_it_can_hold_is_deselected(tmp_path):
    def skipped(src: str, expr: str) -> bool:
        f = tmp_path / "test_y.py"
        f.write_text("import pytest\n" + src)
        return _module_always_deselected(_Config(expr), f)

    vllm = "pytestmark = [pytest.mark.vllm]\n"
    assert skipped(vllm, LANES["unit"])
    assert not skipped(vllm, LANES["engine"]) and not skipped(vllm, LANES["side"])  # a test in it may add side
    side = "pytestmark = [pytest.mark.slow, pytest.mark.side]\n"
    assert skipped(side, LANES["unit"]) and skipped(side, LANES["engine"]) and not skipped(side, LANES["side"])
    assert not skipped("", LANES["unit"]) and not skipped("", LANES["engine"])      # nothing declared: imported
    assert not skipped(vllm, "")                                                    # no -m: everything collected
    assert not skipped(vllm, "not (")                                               # a bad -m: pytest reports it


def test_no_test_declares_a_marker_that_takes_a_lane_marker_away():
    """Markers are only ever added (the static skip above relies on it): a test that must leave a lane out
    of a module's markers is written with its own markers instead (tests/e2e/test_connector_e2e.py marks its
    side tests one by one), never with a not_side / no_slow marker."""
    for f in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(f.read_text(), str(f))
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
                 and n.value.attr == "mark"}
        assert not {n for n in names if n.startswith(("not_", "no_")) and n.split("_", 1)[1] in _MARKERS}, f


def test_no_side_test_runs_a_tensor_parallel_engine():
    """A TP>1 engine pins one rank to each of the 2 cores, so a TP>1 test is never ``side`` (run at nice 10
    beside the engine lane): the MLA TP=2 test, marked side by mistake, ran past its hang guard in CI
    (2026-11-28). Read from the source: a test whose body passes ``tensor_parallel_size`` other than 1."""
    found = []
    for f in sorted((TESTS / "e2e").rglob("test_*.py")):
        tree = ast.parse(f.read_text(), str(f))
        module_side = "side" in _static_marks(f)
        module_two = any(isinstance(n, ast.Attribute) and n.attr == "two_cores" for a in tree.body
                         if isinstance(a, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in a.targets)
                         for n in ast.walk(a))
        for fn in tree.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
                continue
            tp = [k for k in ast.walk(fn) if isinstance(k, ast.keyword) and k.arg == "tensor_parallel_size"
                  and not (isinstance(k.value, ast.Constant) and k.value.value == 1)]
            side = module_side or any(isinstance(d, ast.Attribute) and d.attr == "side" for d in fn.decorator_list)
            two = module_two or any(isinstance(d, ast.Attribute) and d.attr == "two_cores" for d in fn.decorator_list)
            found.append((f.name, fn.name, bool(tp)))
            assert not (tp and side), f"{f.name}::{fn.name} runs a TP>1 engine and is marked side"
            # run last in the engine lane (tests/conftest.py two_cores_last), when both cores are free
            assert not tp or two, f"{f.name}::{fn.name} runs a TP>1 engine and is not marked two_cores"
    assert sum(tp for _, _, tp in found) >= 4, found  # the check sees the TP=2 tests it guards


def test_two_cores_tests_run_last_in_their_collected_order():
    from tests.conftest import two_cores_last

    def item(name: str, *marks: str) -> _Item:
        it = _Item(name=name)
        it.marks |= set(marks)
        return it

    items = [item("a"), item("tp1", "two_cores", "slow"), item("b", "side"), item("tp2", "two_cores"), item("c")]
    assert [i.originalname for i in two_cores_last(items)] == ["a", "b", "c", "tp1", "tp2"]
    assert [i.originalname for i in two_cores_last(items[:1])] == ["a"] and two_cores_last([]) == []


@pytest.mark.slow  # a collection of the e2e folder: 28 s on the idle 2-core VM
@pytest.mark.side
def test_the_engine_lane_collects_its_tensor_parallel_tests_last():
    """The real collection of the engine lane (ci/test.sh's -m expression, the e2e folder): every
    ``two_cores`` test comes after every other test, and there are some."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-m", LANES["engine"], str(TESTS / "e2e")],
                       capture_output=True, text=True, cwd=TESTS.parent, timeout=600)
    ids = [ln for ln in r.stdout.splitlines() if "::" in ln]
    assert ids, r.stdout[-2000:] + r.stderr[-2000:]
    two = {"test_tensor_parallel_two_ranks_save_and_load_their_slices", "test_tp1_g4_blocks_load_in_a_tp2_engine",
           "test_mla_tensor_parallel_two_ranks_share_one_g4_copy_of_the_replicated_latent",
           "test_native_tiers_tensor_parallel_two_ranks"}
    tail = [i.split("::")[-1] for i in ids[-len(two):]]
    assert set(tail) == two, ids


class _Item:
    """What ``pytest_collection_modifyitems`` reads of a test item: its fixtures, parameters and name."""

    def __init__(self, fixtures=(), params=None, name="test_x"):
        self.fixturenames = list(fixtures)
        self.callspec = None if params is None else type("CallSpec", (), {"params": params})()
        self.originalname = name
        self.marks: set = set()

    def add_marker(self, m):
        self.marks.add(m.name)

    def get_closest_marker(self, name):
        return name if name in self.marks else None


def test_s3_is_applied_to_tests_that_name_seaweed_or_take_an_s3_store_parameter():
    """A store parametrisation ("file" / "s3") whose SeaweedFS fixture is requested dynamically
    (``request.getfixturevalue("seaweed")``) names no S3 fixture, yet starts the server: its "s3" cases are
    marked s3 (out of the unit lane) like the tests that name the fixture. Nine such cases of
    test_g4_host_load, test_g4_hostile and test_g4_canonical ran in the unit lane before."""
    from tests.conftest import pytest_collection_modifyitems
    items = [_Item(["seaweed", "tmp_path"]), _Item(["request"], {"store": "s3", "encrypt": True}),
             _Item(["request"], {"store": "file"}), _Item(["request"], {"where": "s3"}), _Item(["tmp_path"]),
             _Item(["s3_prefix"])]
    pytest_collection_modifyitems(None, items)
    assert [("s3" in it.marks) for it in items] == [True, True, False, True, False, True]
