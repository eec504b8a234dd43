"""Connector pieces without an engine, tiering, hybrid units, mirror, handoff, device/GPU paths, I/O engines, examples, doctor, bench CLI."""
