"""G3 warm restart whatever the order of ``g3.paths`` (invariant 6; docs/format.md "Where the journal is").

Before, the journal lived in the first directory of ``g3.paths`` and its file indexes were positions in that
list: a restart with the list reordered (config management sorting it, a drive inserted first) started cold,
silently, and left the old journal behind, restored stale if the order went back. Now the journal is found in
whichever configured directory holds it and its version-3 header names each directory by its real path, so
file indexes map to the same files. Real pools, real slab files in tmp_path, the real posix engine.
"""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import xxhash

from tests.helpers.crash_writer import LAYOUT, NS, open_pool, payload
from kvbm_backend.memory import aligned_empty
from kvbm_backend.model.namespace import tenant_tag

HANG_S = 600.0  # a hang guard, not a bound: waits for results that must come; returns as soon as they do

BB = LAYOUT.bytes_per_block
JOURNAL = f"journal-{NS.fingerprint}.log"
GEN_MARKER = f"journal-{NS.fingerprint}.gen"


def _open(dirs, **kw):
    """A pool on ``dirs`` (in that order); runs of 6 slots (64 KiB I/Os), so blocks spread over every file."""
    return open_pool(dirs[0], paths=[str(d) for d in dirs], **{"io_size_bytes": 64 << 10, **kw})


def _put(pool, seqs):
    keys = NS.keys(seqs)
    res = pool.put(keys, [payload(k.seq_hash) for k in keys]).result(timeout=HANG_S)
    assert res.written + res.skipped == len(keys), res
    return keys


def _served(pool, keys) -> list[bool]:
    """Which ``keys`` the pool serves; every served block must hold exactly the bytes written for its key."""
    out = [aligned_empty(BB) for _ in keys]
    got = pool.get(keys, out).result(timeout=HANG_S)
    for k, ok, o in zip(keys, got.ok, out):
        if ok:
            assert np.array_equal(o, payload(k.seq_hash)), f"wrong bytes served for {k}"
    return list(got.ok)


def _where(pool, keys) -> dict:
    """key -> the directory of the slab file holding it."""
    return {k: pool.slabs.by_index[pool.index.get(k)[0]].directory for k in keys}


def _journals(dirs) -> list:
    return [d for d in dirs if (d / JOURNAL).exists()]


@pytest.fixture
def dirs(tmp_path):
    out = [tmp_path / n for n in ("a", "b", "c", "new")]
    for d in out:
        d.mkdir(mode=0o700)
    return out


def test_reversed_paths_restore_every_block_and_going_back_restores_the_new_state(dirs):
    a, b = dirs[:2]
    with _open([a, b]) as pool:
        keys = _put(pool, range(1, 101))
        assert set(_where(pool, keys).values()) == {str(a), str(b)}  # blocks in both directories
    with _open([b, a]) as pool:  # the list reversed
        st = pool.stats()
        assert st["restored_blocks"] == 100 and st["restore_dropped"] == 0, st
        assert pool.lookup_prefix(keys).result(timeout=HANG_S) == 100
        assert _served(pool, keys) == [True] * 100
        new = _put(pool, range(200, 260))  # the reordered run changes the state
        assert pool.delete(keys[:10]).result(timeout=HANG_S) == 10
        assert pool.slot_accounting()["leaked"] == 0
    assert _journals(dirs) == [a]  # the journal stayed where it was; none anywhere else
    with _open([a, b]) as pool:  # back to the first order: the new state, not the old one
        st = pool.stats()
        assert st["restored_blocks"] == 150 and st["restore_dropped"] == 0, st
        assert _served(pool, keys[:10]) == [False] * 10
        assert _served(pool, keys[10:] + new) == [True] * 150
        _put(pool, range(300, 340))  # new writes take free slots, never restored ones
        assert _served(pool, keys[10:] + new) == [True] * 150
        assert pool.slot_accounting()["leaked"] == 0


def test_a_directory_inserted_first_restores_every_block(dirs):
    a, b, _, new = dirs
    with _open([a, b], files_per_path=2) as pool:
        keys = _put(pool, range(1, 101))
    with _open([new, a, b], files_per_path=2) as pool:
        st = pool.stats()
        assert st["restored_blocks"] == 100 and st["restore_dropped"] == 0, st
        assert _served(pool, keys) == [True] * 100
        more = _put(pool, range(500, 600))
        assert str(new) in set(_where(pool, more).values())  # the new directory is used
    assert _journals(dirs) == [a]
    with _open([new, a, b], files_per_path=2) as pool:
        assert pool.stats()["restored_blocks"] == 200
        assert _served(pool, keys + more) == [True] * 200


def test_a_directory_left_out_drops_only_its_blocks(dirs):
    a, b, c, _ = dirs
    with _open([a, b, c]) as pool:
        keys = _put(pool, range(1, 151))
        where = _where(pool, keys)
    in_b = [k for k in keys if where[k] == str(b)]
    rest = [k for k in keys if where[k] != str(b)]
    assert in_b and rest and {where[k] for k in rest} == {str(a), str(c)}
    with _open([c, a]) as pool:  # b left out, and the others reordered
        st = pool.stats()
        assert st["restored_blocks"] == len(rest), st
        assert st["restore_dropped"] == len(in_b) and st["restore_dropped_by_reason"] == {"path_removed": len(in_b)}
        assert _served(pool, rest) == [True] * len(rest)
        assert _served(pool, in_b) == [False] * len(in_b)
        assert pool.slot_accounting()["leaked"] == 0


def test_a_directory_moved_keeps_its_blocks(dirs, tmp_path):
    """A G3 directory copied to another path (a cache moved to a new node, a volume mounted elsewhere) and
    configured there, beside one that stayed: its blocks are restored and served (the journal's directory not
    configured now is paired with the configured one it does not name). Before, the journal's real path did not
    match and every block of the moved directory was dropped (found by tests/e2e/test_layerwise_e2e.py, which
    copies a writer's G3 directory to each reader)."""
    import shutil
    a, b, _, _ = dirs
    with _open([a, b]) as pool:
        keys = _put(pool, range(1, 101))
    moved = tmp_path / "moved-b"
    shutil.copytree(b, moved)
    shutil.rmtree(b)
    with _open([moved, a]) as pool:  # moved, and the list reordered too
        st = pool.stats()
        assert st["restored_blocks"] == 100 and st["restore_dropped"] == 0, st
        assert _served(pool, keys) == [True] * 100
    alone = tmp_path / "alone"
    shutil.copytree(a, alone)  # a one-directory pool copied whole (the journal's home moved too)
    with _open([alone, moved]) as pool:
        assert pool.stats()["restored_blocks"] == 100
        assert _served(pool, keys) == [True] * 100


def test_lowering_files_per_path_over_several_paths_keeps_the_remaining_files_blocks(dirs):
    """File indexes follow ``d * files_per_path + k``: the journal's table maps them to (directory, k), so
    blocks of file 0 of the second directory (index 2 with 2 files per path, 1 with 1) stay."""
    a, b = dirs[:2]
    with _open([a, b], files_per_path=2) as pool:
        keys = _put(pool, range(1, 121))
        kept = [k for k in keys if pool.slabs.by_index[pool.index.get(k)[0]].path.endswith("-0.slab")]
        assert len(kept) < len(keys) and set(_where(pool, kept).values()) == {str(a), str(b)}
    with _open([a, b], files_per_path=1) as pool:
        st = pool.stats()
        assert st["restored_blocks"] == len(kept), st
        assert st["restore_dropped_by_reason"] == {"capacity": len(keys) - len(kept)}
        assert _served(pool, kept) == [True] * len(kept)


def _marker(d) -> int:
    """The generation recorded in directory ``d``'s marker (journal_gen.py)."""
    from kvbm_backend.pool.g3 import journal_gen as jg
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return jg.read_marker(fd, str(d), NS.fingerprint)
    finally:
        os.close(fd)


def _strip_generation(path) -> None:
    """Make the journal at ``path`` what a version before 2026-12-01 wrote: no generation record (the first
    record after the version-3 header, journal_gen.py) and no generation markers beside it."""
    data = path.read_bytes()
    h = int.from_bytes(data[16:20], "little")
    assert data[h] == 2 and data[h + 35 - 16:h + 35] == b"KVBM-journal-gen", "no generation record to strip"
    path.write_bytes(data[:h] + data[h + 43:])
    (path.parent / GEN_MARKER).unlink(missing_ok=True)


@pytest.mark.parametrize("gens", ["with", "without", "mixed"])
@pytest.mark.parametrize("newest", ["current", "stale", "tie"])
def test_journals_in_two_directories_the_newest_valid_wins_and_the_other_is_removed(dirs, newest, gens):
    """A directory that held the journal is left out for a run (which starts a new journal) and comes back:
    two journals. The newest is used and the other removed: by generation (journal_gen.py), whatever the
    modification times say (a run whose clock was behind; review 2026-12-01, finding 6: before, the stale
    journal won on an mtime set back and every block of the run without it was lost); journals of an earlier
    version (``gens`` "without": no generation; "mixed": one without) by modification time as before (a tie:
    the earlier path); the directory holding the journal that lost is scanned, so even a wrong pick (a clock
    behind with a journal of an earlier version) loses no intact block (before: every block of b's run).
    Whichever is used, no served block holds wrong bytes. The run without the journal found its directory's
    blocks by their slot headers (scan.py), and when the newest journal does not name the directory that
    came back, that directory's blocks are found the same way: nothing intact is lost."""
    a, b = dirs[:2]
    with _open([a, b]) as pool:
        old = _put(pool, range(1, 101))
        in_a = [k for k, d in _where(pool, old).items() if d == str(a)]
    assert 0 < len(in_a) < 100
    # a left out: no journal; b's slot headers are scanned. A capacity below b's files' size, so the run's
    # writes take b's slots from slot 0 and overwrite the blocks the journal in a still names there
    with _open([b], capacity_gb=0.002) as pool:
        st = pool.stats()
        found = _served(pool, old)
        assert st["restored_blocks"] == st["restored_by_scan"] == sum(found) > 0, st
        assert st["restore_scanned_slots"] > 0 and not any(f for k, f in zip(old, found) if k in in_a)
        cur = _put(pool, range(1000, 1150))
    assert _journals(dirs) == [a, b]
    if gens != "with":  # "mixed": a's journal from an earlier version, b's from this one
        _strip_generation(a / JOURNAL)
    if gens == "without":
        _strip_generation(b / JOURNAL)
    t = 1_700_000_000 * 10**9
    os.utime(a / JOURNAL, ns=(t, t + (10**9 if newest == "stale" else 0)))
    os.utime(b / JOURNAL, ns=(t, t + (10**9 if newest == "current" else 0)))
    current_wins = gens == "with" or newest == "current"
    with _open([a, b]) as pool:
        st = pool.stats()
        got_old, got_cur = _served(pool, old), _served(pool, cur)  # bytes checked for every hit
        if current_wins:  # b's journal names b only: a's blocks come back by a scan of a's files
            assert got_cur == [True] * 150 and st["restored_by_scan"] == len(in_a), st
            assert all(f for k, f in zip(old, got_old) if k in in_a), got_old
            assert st["restored_blocks"] == 150 + sum(got_old), st
        else:  # a's journal (the stale one, or the earlier path on a tie): its blocks b's run overwrote drop,
            # and b, which holds the journal that lost, is scanned: b's run's blocks are found by their headers
            assert got_cur == [True] * 150 and st["restored_by_scan"] == 150, st
            assert 0 < sum(got_old) < 100 and st["restored_blocks"] == sum(got_old) + 150, st
            assert st["restore_dropped"] == 100 - sum(got_old)
        home = b if current_wins else a
    assert _journals(dirs) == [home]  # exactly one journal left
    with _open([b, a]) as pool:  # and it is the one a later restart uses, in any order
        assert pool.stats()["restored_blocks"] == st["restored_blocks"]
        assert _served(pool, old + cur) == got_old + got_cur


def test_the_generation_is_one_more_than_any_directory_showed_and_recorded_in_each(dirs):
    """Every open picks one more than the highest generation any configured directory shows (its journal's
    record, its marker) and records it in every configured directory before the journal is rewritten with it,
    so a run on a subset of the directories (here b alone) still picks a higher one than the journal it cannot
    see (in a). The journal's first record is the generation record (docs/format.md); an earlier version
    replays it as the delete of a key it never held."""
    from kvbm_backend.pool.g3 import journal_gen as jg
    a, b = dirs[:2]
    with _open([a, b]) as pool:
        keys = _put(pool, range(1, 41))
        assert pool.cat.journal_home.generation == 1
    assert [_marker(d) for d in (a, b)] == [1, 1]
    data = (a / JOURNAL).read_bytes()
    h = int.from_bytes(data[16:20], "little")
    assert jg.parse_record(data[h:]) == 1
    from kvbm_backend.pool.g3 import journal as jr
    ents, info = jr.Journal(str(a), NS.fingerprint).load()  # the replay every version runs: a DEL of no key held
    assert len(ents) == 40 and info["generation"] == 1 and info["records"] == 41 and info["torn_bytes"] == 0
    with _open([b]) as pool:  # b's marker says 1: this run's journal (in b) gets 2
        assert pool.cat.journal_home.generation == 2
    assert [_marker(d) for d in (a, b)] == [1, 2]
    data = (b / JOURNAL).read_bytes()
    assert jg.parse_record(data[int.from_bytes(data[16:20], "little"):]) == 2
    with _open([a, b]) as pool:
        assert pool.cat.journal_home.generation == 3 and pool.cat.journal_home.directory == str(b)
        assert _served(pool, keys) == [True] * 40
    assert _journals(dirs) == [b]


def test_a_damaged_journal_never_wins_over_a_valid_one(dirs):
    """A newer file under the journal's name whose header does not check loses to an older valid journal,
    and is removed with it rewritten."""
    a, b = dirs[:2]
    with _open([a, b]) as pool:
        keys = _put(pool, range(1, 61))
    data = bytearray((a / JOURNAL).read_bytes())
    data[30] ^= 0xFF  # a byte of the header's path table: its check fails
    (b / JOURNAL).write_bytes(bytes(data))
    t = 1_700_000_000 * 10**9
    os.utime(a / JOURNAL, ns=(t, t))
    os.utime(b / JOURNAL, ns=(t, t + 10**9))
    with _open([b, a]) as pool:
        assert pool.stats()["restored_blocks"] == 60
        assert _served(pool, keys) == [True] * 60
    assert _journals(dirs) == [a]


def test_a_version_2_journal_restores_positionally_and_is_rewritten_as_version_3(dirs):
    a, b = dirs[:2]
    with _open([a, b]) as pool:
        keys = _put(pool, range(1, 41))
        where = {k: pool.index.get(k) for k in keys}
    recs = [b"KVBMJRN2" + bytes.fromhex(NS.fingerprint)]  # what an earlier version wrote: positions in g3.paths
    tag = tenant_tag("")
    for k in keys:
        body = struct.pack("<BHIQI16s", 1, where[k][0], where[k][1], k.seq_hash, k.rank, tag)
        recs.append(body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)))
    (a / JOURNAL).write_bytes(b"".join(recs))
    with _open([a, b]) as pool:
        assert pool.stats()["restored_blocks"] == 40
        assert _served(pool, keys) == [True] * 40
    data = (a / JOURNAL).read_bytes()
    assert data[:8] == b"KVBMJRN3" and os.fsencode(os.path.realpath(b)) in data
    with _open([b, a]) as pool:  # now the order may change
        assert pool.stats()["restored_blocks"] == 40
        assert _served(pool, keys) == [True] * 40


def test_a_version_2_journal_found_after_the_list_was_reordered_is_read_in_its_order(dirs):
    """Review finding (2026-11-29): a version-2 journal (an earlier version kept it in the first path, indexes are
    positions in that list) found in the second path after the list was reordered at the upgrade was read in the
    new order: nothing restored. Its home is position 0 of the list it was written with."""
    from kvbm_backend.pool.g3 import journal as jr
    a, b = dirs[:2]
    with _open([a, b]) as pool:
        keys = _put(pool, range(1, 201))
    data = (a / JOURNAL).read_bytes()
    start = jr.parse_header(data, NS.fingerprint)[1]
    (a / JOURNAL).write_bytes(jr.FILE_MAGIC_V2 + bytes.fromhex(NS.fingerprint) + data[start:])  # the same records
    with _open([b, a]) as pool:
        assert pool.stats()["restored_blocks"] == 200
        assert _served(pool, keys) == [True] * 200


def test_a_header_naming_more_files_than_a_record_can_is_damage(dirs):
    """Review finding (2026-11-29): a version-3 header with a valid check naming 65,535 paths of 65,535 files made
    restore build a 4.3e9-entry map (MemoryError or the OOM killer at every start). A record's file index is a u16,
    so a table of more than 65,536 files is damage: the journal is ignored (a cold start), never sized on."""
    from kvbm_backend.pool.g3 import journal as jr
    a = dirs[0]
    head = jr.encode_header(NS.fingerprint, ([os.path.realpath(a)] + [f"/x{i}" for i in range(299)], 256))
    assert jr.parse_header(head, NS.fingerprint) is None  # 300 x 256 = 76,800 files
    ok = jr.encode_header(NS.fingerprint, ([os.path.realpath(a)] + [f"/x{i}" for i in range(255)], 256))
    assert jr.parse_header(ok, NS.fingerprint) is not None  # 65,536: the most a u16 names
    (a / JOURNAL).write_bytes(head)
    with _open([a]) as pool:
        assert pool.stats()["restored_blocks"] == 0
        keys = _put(pool, range(1, 11))
    with _open([a]) as pool:  # the damaged journal was replaced
        assert pool.stats()["restored_blocks"] == 10 and _served(pool, keys) == [True] * 10


def test_a_directory_swapped_out_for_a_run_and_back_keeps_its_blocks(dirs):
    """A config change reverted: ``g3.paths`` [a, b] -> [a, c] (b swapped for a new drive c for a run) -> [a, b]
    again. In the last run the journal (written by the middle run) names a and c; c is not configured and b is
    not named, so c is read as moved to b. b's slab files still hold its blocks of the first run, intact: they are
    found by their slot headers (the journal names nothing in b that checks) and served. Before, b's files were
    taken as covered by the journal and not scanned: every block b held was dropped and its slots reused."""
    a, b, c, _ = dirs
    with _open([a, b]) as pool:
        keys = _put(pool, range(1, 151))
        where = _where(pool, keys)
    in_b = [k for k in keys if where[k] == str(b)]
    assert in_b and len(in_b) < len(keys)
    with _open([a, c]) as pool:  # b swapped for c: c's share is empty, b's blocks are not held
        assert pool.stats()["restored_blocks"] == len(keys) - len(in_b)
    with _open([a, b]) as pool:  # and back
        st = pool.stats()
        assert st["restored_blocks"] == len(keys), st
        assert st["restored_by_scan"] == len(in_b), st
        assert _served(pool, keys) == [True] * len(keys)
        assert pool.slot_accounting()["leaked"] == 0
