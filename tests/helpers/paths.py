"""Where things are, independent of how deep a test file sits under ``tests/``: ``REPO`` (the repository
root), ``HELPERS`` (this folder, for child processes run as ``python tests/helpers/<name>.py``)."""
from __future__ import annotations

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
REPO = HELPERS.parents[1]
