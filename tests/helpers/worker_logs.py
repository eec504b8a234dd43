"""Our WARNING/ERROR lines in an engine worker's log (for test failure messages).

A worker's log rarely says ``kvbm_backend``: the package's records go out through vLLM's logger
(``kvbm_backend/integrations/vllm/plugin.py``), whose format names the file, not the logger --
``(EngineCore_DP0 pid=7) WARNING 11-26 10:00:00 [breaker.py:134] G4 s3://...: store unavailable, circuit
breaker OPEN ...`` -- and Dynamo's formatter names ``module.function`` (``WARNING breaker._fail: ...``),
both possibly wrapped in ANSI colours. CI once printed ``prefill_warnings: []`` for a worker whose breaker
had opened. :func:`kvbm_warnings` knows the package's module file names instead.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LEVEL = re.compile(r"\b(WARN|WARNING|ERROR|CRITICAL)\b")
_VLLM_FILE = re.compile(r"\[(\w+)\.py:\d+\]")  # vLLM: [fileinfo:lineno], a bare file name outside vLLM's tree
_TARGET = re.compile(r"\b(?:WARN|WARNING|ERROR|CRITICAL)\s+(\w+)(?:\.[\w<>]+)?:\s")  # Dynamo: LEVEL module.func:


@lru_cache(maxsize=1)
def package_modules() -> frozenset[str]:
    """File stems of the ``kvbm_backend`` package's modules (``breaker``, ``pool``, ...; not ``__init__``)."""
    import kvbm_backend
    root = Path(kvbm_backend.__file__).parent
    return frozenset(p.stem for p in root.rglob("*.py") if not p.stem.startswith("__"))


def is_kvbm_warning(line: str) -> bool:
    """True for a WARNING/ERROR line that the package wrote: it names ``kvbm_backend``, or (vLLM's and
    Dynamo's formats) one of the package's module files."""
    ln = _ANSI.sub("", line)
    if "kvbm_backend" in ln and ("WARN" in ln or "ERROR" in ln):
        return True
    if not _LEVEL.search(ln):
        return False
    m = _VLLM_FILE.search(ln) or _TARGET.search(ln)
    return bool(m and m.group(1) in package_modules())


def kvbm_warnings(log: Path | str, n: int = 10) -> list[str]:
    """The last ``n`` of the package's WARNING/ERROR lines (:func:`is_kvbm_warning`) in the log file
    ``log``, each cut to its last 300 characters, ANSI colours removed."""
    lines = [_ANSI.sub("", ln) for ln in Path(log).read_text(errors="replace").splitlines() if is_kvbm_warning(ln)]
    return [ln[-300:] for ln in lines[-n:]]
