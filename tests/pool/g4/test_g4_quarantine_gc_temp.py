"""A file store's quarantine swap (``pool/g4/fs_quarantine.py``) against a concurrent gc's temp pass (2026-12-03).

A reader that proved bytes bad (or gc deleting what it listed) renames the object to a quarantine name, compares,
and puts a file that is not the one to delete back under its name by ``link``. Quarantine names have the shape of
writer temp files, which gc's temp pass deletes by name once their mtime is ``temp_grace_s`` old, and a rename
keeps the mtime: a good block written long ago, quarantined because the name no longer held the bytes proven bad,
was deleted by a gc running between the rename and the link back, and the block was lost (the link back found
nothing). Now the file's mtime is set to now before the rename, so gc leaves the quarantine name alone.

Deterministic: gc's real temp pass (:func:`~kvbm_backend.pool.g4.gc.run_gc`) runs inside the window, from the
store's own open of the quarantined file (a subclass of the real file store) or from the comparison step itself.
"""
from __future__ import annotations

import os

from kvbm_backend.pool.g4.fs_quarantine import _swap_out
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.gc import run_gc

NAME = f"{'0123456789abcdef'}/{'ab' * 16}/0/00/{7:032x}"  # a block name: its directory is one gc's temp pass owns
GOOD, BAD = b"good-block" * 100, b"bad-bytes!" * 100
OLD = 1_700_000_000.0  # the good block's mtime: written long before gc's temp_grace_s


class _GcWhileQuarantined(FsStore):
    """A file store where gc's temp pass runs once, when the quarantined file is opened to be compared (between
    the rename to the quarantine name and the link back)."""

    gc_result: dict | None = None

    def _open_file(self, name, direct, blocking=True):
        if ".quarantine." in name and self.gc_result is None:
            self.gc_result = run_gc(self, temp_grace_s=3600.0)
        return super()._open_file(name, direct, blocking)


def _quarantined(root) -> list[str]:
    return [f for _, _, fs in os.walk(root) for f in fs if ".quarantine." in f]


def test_a_gc_temp_pass_during_the_quarantine_keeps_an_old_good_block(tmp_path):
    """The reader proved ``BAD`` at the name; the name now holds ``GOOD`` (written long ago: mtime ``OLD``). Old
    code: gc deleted the quarantine name (``deleted_by["temp"] == 1``) and the block was gone. Now it stays."""
    root = tmp_path / "g4"
    st = _GcWhileQuarantined(root, fsync=False)
    assert st.put_if_absent(NAME, GOOD)
    os.utime(root / NAME, (OLD, OLD))
    assert st.delete_if_matches(NAME, BAD, len(BAD)) is False  # other bytes: put back
    assert st.gc_result is not None, "gc never ran inside the window"
    assert st.gc_result["deleted_by"]["temp"] == 0, st.gc_result
    assert bytes(st.get(NAME) or b"") == GOOD  # the good block, back under its name
    assert _quarantined(root) == []


def test_a_gc_temp_pass_during_gcs_own_conditional_delete_keeps_the_other_file(tmp_path):
    """gc deletes a listed block only while the name holds the listed file (``delete_if_listed``); the name holds
    another, old file by then. A second gc's temp pass runs at the comparison step. Old code: the other file went
    with the quarantine name. Now it is put back; the listed file is still deleted when it is the one there."""
    root = tmp_path / "g4"
    st = FsStore(root, fsync=False)
    assert st.put_if_absent(NAME, BAD)
    listed = next(iter(st.list("")))
    st.delete(NAME)
    assert st.put_if_absent(NAME, GOOD)
    os.utime(root / NAME, (OLD, OLD))
    seen: list[dict] = []

    def same_after_gc(dfd, q, *before):  # the comparison, with gc's temp pass run first
        seen.append(run_gc(st, temp_grace_s=3600.0))
        return False  # another file than listed: goes back

    assert _swap_out(st, NAME, same_after_gc) is False
    assert seen and seen[0]["deleted_by"]["temp"] == 0, seen
    assert bytes(st.get(NAME) or b"") == GOOD and _quarantined(root) == []
    assert st.delete_if_listed(listed) is False and bytes(st.get(NAME) or b"") == GOOD  # not the listed one
    now = next(iter(st.list("")))
    assert st.delete_if_listed(now) is True and st.get(NAME) is None  # the listed one (stat from before the touch)
