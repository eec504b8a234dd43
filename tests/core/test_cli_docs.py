"""docs/cli.md against the real command tree of ``kvbm-backend`` (``kvbm_backend/apps``).

Every command an operator can run (each leaf of the typer/click tree ``kvbm-backend --help`` walks) has a row in
docs/cli.md's command table, and every option docs/cli.md gives a command (in a row's synopsis, or in a
```CMD --option``` span of the text) exists on that command; the other operator docs' spans are checked
the same way. A command that hands its arguments to a parser of
its own (``config effective``: argparse, no click parameters) is asked through the CLI: its ``--help``, and the
modes its help does not list (:data:`OWN_MODES`) are run.

Review finding (docs 2): docs/cli.md had no row for ``config effective`` (the command examples/README.md and
docs/migrating.md send operators to) and gave ``keys rewrap`` a ``--tenant`` it does not have, without the
``--new-kek-file`` / ``--new-kek-env`` it needs."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import typer.main
from typer.testing import CliRunner

from kvbm_backend.apps.cli import app

ROOT = Path(__file__).resolve().parents[2]
CLI_MD = ROOT / "docs" / "cli.md"

# options a passthrough command takes that its --help does not list: option -> (arguments after it, the start of
# what the command prints); the test runs each, so a mode that went away fails here
OWN_MODES: dict[tuple[str, ...], dict[str, tuple[list[str], str]]] = {
    ("config", "effective"): {"--dry-run": (["true", "x"], "kvbm-backend dry run: exec true x")},
}


def _tree() -> Any:
    return typer.main.get_command(app)


def _leaves(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, command) of every runnable command (typer vendors click: groups are told by ``commands``)."""
    for name, sub in sorted(cmd.commands.items()):
        if sub.hidden:
            continue
        if hasattr(sub, "commands"):
            yield from _leaves(sub, (*path, name))
        else:
            yield (*path, name), sub


def _passthrough(cmd: Any) -> bool:
    return not cmd.params and bool(cmd.context_settings.get("ignore_unknown_options"))


def real_options(path: tuple[str, ...], cmd: Any) -> set[str]:
    """The long options ``kvbm-backend PATH`` takes."""
    if not _passthrough(cmd):
        opts = {"--help"}
        for p in cmd.params:
            if p.param_type_name == "option":
                opts |= {o for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
        return opts
    r = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, (path, r.output)
    # argparse's options section: "  -h, --help ...", "  --for {dynamo,vllm} ..." (not the help texts' words)
    opts = set(re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z0-9-]*)", r.output, re.M))
    assert "--help" in opts, (path, r.output)
    for opt, (args, start) in OWN_MODES.get(path, {}).items():
        r = CliRunner().invoke(app, [*path, opt, *args])
        assert r.exit_code == 0 and r.output.startswith(start), (path, opt, r.output)
        opts.add(opt)
    return opts


def _resolve(tree: Any, tokens: list[str]) -> tuple[list[tuple[str, ...]], list[str]] | None:
    """The commands a span's leading words name (``keys create|rotate`` names two) and the words after them;
    None when its first word names no command."""
    paths: list[tuple[str, ...]] = [()]
    nodes = [tree]
    i = 0
    while i < len(tokens) and all(hasattr(n, "commands") for n in nodes):
        alts = tokens[i].split("|")
        if not all(a in n.commands for n in nodes for a in alts):
            break
        paths = [(*p, a) for p in paths for a in alts]
        nodes = [n.commands[a] for n in nodes for a in alts]
        i += 1
    return (paths, tokens[i:]) if i else None


def _spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text.replace("\\|", "|"))


def _options(words: list[str]) -> set[str]:
    return {o for w in words for o in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", w)}


def _table_synopses(text: str) -> list[str]:
    """The first cell's span of each row of the ``| command | what |`` table."""
    lines = text.splitlines()
    start = lines.index("| command | what |")
    out = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cell = ln.replace("\\|", "\x00").split("|")[1].replace("\x00", "\\|")
        spans = _spans(cell)
        assert len(spans) == 1 and spans[0].startswith("kvbm-backend "), ln[:120]
        out.append(spans[0])
    return out


def _span_problems(text: str, tree: Any, leaves: dict, real: dict) -> list[str]:
    """Each ```kvbm-backend CMD ...``` or ```CMD --option``` span of ``text`` that gives a command an option it
    does not have (or names a group as a command)."""
    problems = []
    for span in _spans(text):
        words = span.split()
        if not words:
            continue
        explicit = words[0] == "kvbm-backend"
        got = _resolve(tree, words[1:] if explicit else words)
        if got is None or not (explicit or _options(got[1])):
            continue  # a span that names no command (a field, a file), or a bare command name
        paths, rest = got
        for path in paths:
            if path not in leaves:
                problems.append(f"`{span}`: kvbm-backend {' '.join(path)} is a group, not a command")
                continue
            for opt in sorted(_options(rest) - real[path]):
                problems.append(f"`{span[:80]}`: kvbm-backend {' '.join(path)} has no {opt}")
    return problems


def _real_tree() -> tuple[Any, dict, dict]:
    tree = _tree()
    leaves = dict(_leaves(tree))
    return tree, leaves, {p: real_options(p, c) for p, c in leaves.items()}


def check_cli_doc(text: str) -> list[str]:
    """What docs/cli.md (``text``) says wrong about the real command tree, one line each (empty: nothing)."""
    tree, leaves, real = _real_tree()
    problems: list[str] = []
    documented: dict[tuple[str, ...], set[str]] = {}
    for syn in _table_synopses(text):
        got = _resolve(tree, syn.split()[1:])
        if got is None or not all(p in leaves for p in got[0]):
            problems.append(f"table row {syn!r}: names no command of kvbm-backend")
            continue
        for p in got[0]:
            documented.setdefault(p, set()).update(_options(got[1]))
    for path in sorted(set(leaves) - set(documented)):
        problems.append(f"kvbm-backend {' '.join(path)}: no row in docs/cli.md")
    for path, opts in documented.items():
        for p in leaves[path].params:  # a required option is in the synopsis
            if p.param_type_name == "option" and p.required and p.opts[0] not in opts:
                problems.append(f"kvbm-backend {' '.join(path)}: required {p.opts[0]} not in its docs/cli.md row")
    return problems + _span_problems(text, tree, leaves, real)


def test_cli_doc_names_every_command_and_only_options_they_have():
    assert check_cli_doc(CLI_MD.read_text()) == []


def test_the_check_sees_a_missing_command_and_a_made_up_option():
    """The check itself: a row removed and an option added are each reported."""
    text = CLI_MD.read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| `kvbm-backend layouts "))
    assert check_cli_doc(text.replace(row + "\n", "")) == ["kvbm-backend layouts: no row in docs/cli.md"]
    bad = text.replace("| `kvbm-backend layouts [--page-size 16]", "| `kvbm-backend layouts [--pagesize 16]")
    assert check_cli_doc(bad) == ["`kvbm-backend layouts [--pagesize 16] [--tp 1]`: kvbm-backend layouts has no --pagesize"]
    bad = text.replace("`replay --g3-path`", "`replay --g3-dir`")
    assert check_cli_doc(bad) == ["`replay --g3-dir`: kvbm-backend replay has no --g3-dir"]
    assert set(OWN_MODES) <= {p for p, c in _leaves(_tree()) if _passthrough(c)}


def test_other_docs_give_commands_only_options_they_have():
    """The same span check over the other operator docs (docs/*.md, README.md, examples/)."""
    tree, leaves, real = _real_tree()
    files = sorted({*(ROOT / "docs").glob("*.md"), ROOT / "README.md", *(ROOT / "examples").rglob("*.md")} - {CLI_MD})
    assert len(files) > 5
    problems = [f"{f.relative_to(ROOT)}: {p}" for f in files for p in _span_problems(f.read_text(), tree, leaves, real)]
    assert problems == []
