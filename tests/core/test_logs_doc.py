"""docs/operations.md quotes the log lines an operator sees (``INFO `...```, ``WARNING `...```, ``ERROR `...```,
``log line `...```): the fixed text of each quote is text the code logs. A quote is split at its placeholders (``...``, ``<url>``,
one-letter or upper-case names such as ``P``, ``N``, ``ADDR``, alternatives ``a | b``, and at parentheses,
colons, semicolons and quotes, where a quote spells out a ``%s``); every piece of 10 or more
characters must occur in a string literal of kvbm_backend (implicitly joined literals joined, f-strings split at
their fields), so a reworded log line whose quote the docs keep fails here (a change inside a piece shorter than 10
characters is not seen)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# placeholders, alternatives, an OS error's own text, and the punctuation around a %s / %r the docs spell out
PLACEHOLDER = r"\.\.\.|<[^>]+>|\b(?:[A-Z]|ADDR|URL|DIR|PATH|NAMESPACE)\b|\||\[Errno \d+\][^)]*|[();:'\"]"


def _literals() -> list[str]:
    out = []
    for f in (ROOT / "kvbm_backend").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                out += [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return out


def test_quoted_log_lines_are_what_the_code_logs():
    text = (ROOT / "docs" / "operations.md").read_text()
    quotes = [" ".join(q.split()) for q in re.findall(r"\b(?:INFO|WARNING|ERROR|log line) `([^`]+)`", text)]
    assert len(quotes) >= 10, quotes  # the Logs and Metrics sections quote at least this many
    code = "\n".join(" ".join(s.split()) for s in _literals()).replace("`", "")  # `aws s3 mb ...` in the log
    missing = []
    for q in quotes:
        pieces = [p.strip(" ;:,()") for p in re.split(PLACEHOLDER, q)]
        missing += [(q, p) for p in pieces if len(p) >= 10 and p not in code]
    assert missing == [], "quoted log text the code does not log"
