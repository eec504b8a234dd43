"""The layering rules of docs/architecture.md, checked on the source with ``ast`` (nothing is imported):

* the library (everything under ``kvbm_backend/`` outside ``apps/``) never imports ``kvbm_backend.apps``;
* only ``kvbm_backend/integrations/`` imports vLLM or Dynamo (at module level or inside a function);
* nothing below the integrations (pools, transfer, io, gpu, model, crypto, config...) imports them;
* ``gpu/`` (device primitives) never imports ``pool/`` (the G3 device loader lives in ``pool/g3/read``);
* no import cycle between packages (``pool``, ``gpu``, ``io``, ``model``... and top-level modules such as
  ``config`` or ``deadlines``), at module level or inside a function;
* no module is over ~500 lines.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "kvbm_backend"
ENGINE_PACKAGES = ("vllm", "dynamo")
MAX_LINES = 520


def _modules():
    for p in sorted(ROOT.rglob("*.py")):
        yield p, p.relative_to(ROOT.parent).with_suffix("").parts


def _imports(path: Path, parts: tuple[str, ...]):
    """Every module an ``import`` or ``from ... import`` in ``path`` names (relative ones resolved), with
    the line: ``from a import b`` yields ``a`` and ``a.b`` (``b`` may be a submodule)."""
    pkg = list(parts[:-1])  # the package a relative import starts from (for __init__, the package itself)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, node.lineno
            for a in node.names:
                yield f"{mod}.{a.name}", node.lineno


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _where(parts) -> str:
    return parts[1] if len(parts) > 2 else ""


def test_resolves_relative_imports():
    # the checker itself: a relative import out of a subpackage resolves to the absolute name
    got = dict(_imports(ROOT / "apps" / "bench" / "g3.py", ("kvbm_backend", "apps", "bench", "g3")))
    assert "kvbm_backend.apps.bench.BenchOptions" in got


def test_library_never_imports_apps():
    bad = [f"{p.relative_to(ROOT.parent)}:{ln}: {name}" for p, parts in _modules() if _where(parts) != "apps"
           for name, ln in _imports(p, parts) if _under(name, "kvbm_backend.apps")]
    assert not bad, "library modules import kvbm_backend.apps:\n" + "\n".join(bad)


def test_only_integrations_import_vllm_or_dynamo():
    bad = [f"{p.relative_to(ROOT.parent)}:{ln}: {name}" for p, parts in _modules() if _where(parts) != "integrations"
           for name, ln in _imports(p, parts) if name.split(".")[0] in ENGINE_PACKAGES]
    assert not bad, "vLLM/Dynamo imported outside kvbm_backend/integrations/:\n" + "\n".join(bad)


def test_nothing_below_integrations_imports_them():
    bad = [f"{p.relative_to(ROOT.parent)}:{ln}: {name}" for p, parts in _modules()
           if _where(parts) not in ("integrations", "apps")
           for name, ln in _imports(p, parts) if _under(name, "kvbm_backend.integrations")]
    assert not bad, "library modules import kvbm_backend.integrations (data flows downward only):\n" + "\n".join(bad)


def test_modules_stay_small():
    """Issue 11: no module over ~500 lines, library and apps alike (split by job instead)."""
    big = [f"{p.relative_to(ROOT.parent)}: {n} lines" for p, parts in _modules()
           for n in [len(p.read_text().splitlines())] if n > MAX_LINES]
    assert not big, "modules over ~500 lines (split them by job):\n" + "\n".join(big)


def _package(parts) -> str | None:
    """The package (or top-level module) a module belongs to: ``pool`` for kvbm_backend/pool/g3/pool.py,
    ``config`` for kvbm_backend/config.py; None for kvbm_backend/__init__.py."""
    return None if parts[1:] == ("__init__",) else parts[1]


def _package_edges() -> dict:
    """{(from package, to package): [where, ...]} over every import between two packages."""
    edges: dict = {}
    for p, parts in _modules():
        src = _package(parts)
        for name, ln in _imports(p, parts):
            bits = name.split(".")
            if src is None or bits[0] != "kvbm_backend" or len(bits) < 2 or bits[1] == src:
                continue
            edges.setdefault((src, bits[1]), []).append(f"{p.relative_to(ROOT.parent)}:{ln}: {name}")
    return edges


def _cycles(edges: dict) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan), each sorted."""
    graph: dict = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict = {}
    low: dict = {}
    stack: list = []
    on: set = set()
    out: list = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_cycles():
    # the checker itself: a -> b -> c -> a is one cycle, d hangs off it
    assert _cycles({("a", "b"): [], ("b", "c"): [], ("c", "a"): [], ("c", "d"): []}) == [["a", "b", "c"]]
    assert _cycles({("a", "b"): [], ("b", "c"): []}) == []


def test_gpu_never_imports_pool():
    """Issue 23: ``gpu/`` holds device primitives (checksum, probe, staging, host path); what reads pool
    slots (the G3 device loader) lives in ``pool/g3/read``, so ``pool`` may use ``gpu`` and never the reverse."""
    bad = [w for (a, b), ws in _package_edges().items() if (a, b) == ("gpu", "pool") for w in ws]
    assert not bad, "kvbm_backend/gpu imports kvbm_backend.pool:\n" + "\n".join(bad)


def test_no_import_cycle_between_packages():
    """Issue 23: data flows one way (docs/architecture.md); no two packages import each other, directly
    or through others."""
    edges = _package_edges()
    cycles = _cycles(edges)
    lines = []
    for comp in cycles:
        lines.append(" <-> ".join(comp) + ":")
        lines += [f"  {w}" for (a, b), ws in sorted(edges.items()) if a in comp and b in comp for w in ws[:3]]
    assert not cycles, "import cycles between packages:\n" + "\n".join(lines)


def _derived_classes(pkg: Path) -> tuple[list[str], list[tuple[str, ast.ClassDef]]]:
    """Classes under ``pkg`` named ``*Mixin`` or deriving from another class of ``pkg`` (exception classes
    aside: an error hierarchy is not shared state), as ``"file: class C(Bases)"``; and every class."""
    classes = []
    for p in sorted(pkg.rglob("*.py")):
        classes += [(str(p.relative_to(pkg)), n) for n in ast.walk(ast.parse(p.read_text(), str(p)))
                    if isinstance(n, ast.ClassDef)]
    errors = {"Exception", "ValueError", "RuntimeError", "OSError", "KeyError", "TypeError"}
    grew = True
    while grew:  # classes deriving (through others of pkg) from an exception class
        new = {n.name for _, n in classes if any(isinstance(b, ast.Name) and b.id in errors for b in n.bases)}
        grew = not new <= errors
        errors |= new
    ours = {n.name for _, n in classes} - errors
    bad = [f"{rel}: class {n.name}({', '.join(ast.unparse(b) for b in n.bases)})" for rel, n in classes
           if n.name.endswith("Mixin") or any(isinstance(b, ast.Name) and b.id in ours for b in n.bases)]
    return bad, classes


def test_g3_pool_is_a_facade_over_parts_not_mixins():
    """Issue 23: G3Pool, its reader and its index are built from parts (slot catalog, writer, reader,
    device loader's pass reader / verifier; the index's entries, hash table, LRU log, owners and slot pins)
    that each own their state, not from mixin classes sharing private attributes across files: no class
    under pool/g3 derives from another class of pool/g3."""
    bad, classes = _derived_classes(ROOT / "pool" / "g3")
    assert not bad, "classes under pool/g3 built from other pool/g3 classes (make them parts):\n" + "\n".join(bad)
    for rel, name in (("pool.py", "G3Pool"), ("compact_index.py", "CompactLruIndex"), ("index.py", "LruIndex")):
        cls = next(n for r, n in classes if r == rel and n.name == name)
        assert not cls.bases, f"{name} derives from {[ast.unparse(b) for b in cls.bases]}"


def test_keyring_owns_its_parts_not_mixins():
    """Issue 23: the keyring owns its use counts and their background persist as a part
    (crypto/keyring_persist.py's UseCounts), not as a mixin sharing its private attributes: no class under
    crypto is a ``*Mixin`` or derives from another crypto class (its exception hierarchy aside)."""
    bad, classes = _derived_classes(ROOT / "crypto")
    assert not bad, "classes under crypto built from other crypto classes (make them parts):\n" + "\n".join(bad)
    kr = next(n for r, n in classes if r == "keyring.py" and n.name == "Keyring")
    assert not kr.bases, f"Keyring derives from {[ast.unparse(b) for b in kr.bases]}"


def test_g4_pool_is_a_facade_over_parts_not_mixins():
    """Issue 23: G4Pool is a facade over parts (writer, reader, lookups, tenant names, throttle watch,
    counters) that each own their state and get what they use handed in, not mixin classes sharing the
    pool's private attributes across files: no class under pool/g4 is a mixin or derives from a pool/g4
    class other than the store interface (``ObjectStore``, and ``S3Store`` for its obstore subclass; its error
    ``StoreUnavailable``, which ``PutUnsettled`` refines: an exception, not a part), and
    no part reads the pool's public attributes through ``self`` (``self.cfg``, ``self.keyring``,
    ``self.breaker``...: a part gets what it uses as arguments and keeps it privately)."""
    g4 = ROOT / "pool" / "g4"
    classes = []
    for p in sorted(g4.glob("*.py")):
        classes += [(p.name, n) for n in ast.walk(ast.parse(p.read_text(), str(p))) if isinstance(n, ast.ClassDef)]
    ours = {n.name for _, n in classes} - {"ObjectStore", "S3Store", "StoreUnavailable"}
    bad = [f"{rel}: class {n.name}({', '.join(ast.unparse(b) for b in n.bases)})" for rel, n in classes
           if n.name.endswith("Mixin") or any(isinstance(b, ast.Name) and b.id in ours for b in n.bases)]
    assert not bad, "classes under pool/g4 built from other pool/g4 classes (make them parts):\n" + "\n".join(bad)
    pool = next(n for rel, n in classes if rel == "pool.py" and n.name == "G4Pool")
    assert not pool.bases, f"G4Pool derives from {[ast.unparse(b) for b in pool.bases]}"
    # the pool's own shared state, read through ``self`` in a part, is what a mixin did
    pool_only = {"cfg", "keyring", "breaker", "metrics", "where", "encrypt", "_io", "_io_put", "_bounce"}
    reach = [f"{name}:{n.lineno}: self.{n.attr}" for name in ("writer.py", "reader.py", "lookup.py", "throttle.py")
             for n in ast.walk(ast.parse((g4 / name).read_text())) if isinstance(n, ast.Attribute)
             and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr in pool_only]
    assert not reach, "parts reading the pool's attributes (hand them in instead):\n" + "\n".join(reach)


def test_o_direct_reads_open_through_io_files():
    """Issue 23 item 1: one O_DIRECT open / probe / fallback rule, in ``io/`` (``io.files.open_for_read``,
    ``refuses_direct``, ``io.probe``). Outside ``io/``, ``os.O_DIRECT`` is named only where a file is opened
    for writing (G3's read-write slab files, G4's temp files); every O_DIRECT read-only open goes through
    ``io.files``."""
    writes = {("pool/g3/slabs.py", "_open"), ("pool/g4/fs_store.py", "_write_temp")}
    found = []
    for p, parts in _modules():
        rel = "/".join(parts[1:]) + ".py"
        if rel.startswith("io/"):
            continue
        tree = ast.parse(p.read_text(), str(p))
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(fn):
                    if isinstance(n, ast.Attribute) and n.attr == "O_DIRECT" and (rel, fn.name) not in writes:
                        found.append(f"{rel}:{n.lineno} in {fn.name}")
    assert not found, "O_DIRECT opened outside io/ (use io.files.open_for_read):\n" + "\n".join(sorted(set(found)))
