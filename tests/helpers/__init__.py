"""Shared test helpers (``from tests.helpers.seaweed import ...``); some also run as child processes
(``python tests/helpers/seaweed.py start DIR``, ``tests/helpers/crash_writer.py``, ``tests/helpers/g4_writer.py``)."""
