"""Which configured G3 directory holds the pool's journal (its *home*), whatever the order of ``g3.paths``.

Before, the journal was always in the first directory of ``g3.paths``: after the list changed order (config
management sorting it, a drive inserted first) a restart found no journal and started cold, and the old
journal stayed behind, to be restored stale if the order ever went back.

At open (:func:`find_home`) every configured directory is searched for ``journal-<fingerprint>.log``. The
journal stays where it is found; with none found, its home is the first directory. More than one directory
can hold one: a directory that held the journal was left out of ``g3.paths`` for a run (that run started a new
journal) and came back, a crash came between a rewrite and the removal below, or an older version left one
behind when the order changed. Then the newest valid one wins: one whose header this version reads (a
known version of this namespace), then the highest generation (:mod:`.journal_gen`: one more at every open,
and recorded in every configured directory first, so no clock is trusted), then the latest modification time
(its last append or rewrite), then the earlier position in ``g3.paths``. Generations are compared only when
every valid journal found has one; a journal of an earlier version (none) makes the modification time decide,
as it did before 2026-12-01 (then a run whose clock was behind lost its blocks to a stale journal). The others are stale and are removed once the winner has been rewritten at
open (:func:`remove_stale`), so no later restart can restore them: after a successful open exactly one
directory of ``g3.paths`` holds a journal of the namespace.

Why pick instead of refusing to open: the journal is a hint. Every entry is checked against its slot's frame
header before it is indexed and every payload on every read (invariant 1), so restoring from the older of
two journals can cost hits, never serve wrong bytes; a refusal would turn a restart of a cache tier into an
outage needing an operator, for a state an older version creates by itself. Both files are named in the log.
Slab files the winner's file table does not name (a directory that only the stale journal named), those of a
directory holding a journal that lost (whichever won: a wrong pick then costs no blocks), and every file when no
journal is found, are scanned for their slot headers instead (:mod:`.scan`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from . import journal as jr
from . import journal_gen as jg
from .slabs import SlabSet

log = logging.getLogger(__name__)


@dataclass
class Home:
    """Where the journal is (:func:`find_home`)."""
    directory: str  # the journal's home: the directory the pool reads and writes it in
    stale: list[str] = field(default_factory=list)  # other configured directories holding one (to remove)
    generation: int = 1  # this run's journal generation: one more than any configured directory showed


def probe(dir_fd: int, directory: str, fingerprint: str) -> tuple[bool, int, int | None] | None:
    """Whether ``directory`` holds a journal of namespace ``fingerprint``: None when not, else ``(valid,
    st_mtime_ns, generation)``, ``valid`` when its header is one :func:`.journal.parse_header` accepts,
    ``generation`` its generation record's (None: none, :mod:`.journal_gen`). Reads the header and one record.

    Raises:
        JournalPathError: the journal name holds a directory, a symbolic link or another non-file.
        OSError: the read failed.
    """
    name = f"journal-{fingerprint}.log"
    got = jr.read_journal(dir_fd, directory, name, jr.HDR3.size)
    if got is None:
        return None
    head, mtime = got
    if head[:8] == jr.FILE_MAGIC and len(head) == jr.HDR3.size:  # version 3: read the whole header
        size = min(jr.HDR3.unpack_from(head, 0)[2], jr.MAX_HEADER_BYTES)
        got = jr.read_journal(dir_fd, directory, name, size + jg.RECORD_BYTES)
        if got is None:
            return None
        head, mtime = got
    parsed = jr.parse_header(head, fingerprint)
    gen = jg.parse_record(head[parsed[1]:]) if parsed is not None and parsed[0] == 3 else None
    return parsed is not None, mtime, gen


def find_home(slabs: SlabSet, fingerprint: str, sync: bool = True) -> Home:
    """Find the journal of namespace ``fingerprint`` among ``slabs``' directories (see the module docstring),
    pick this run's generation and record it in every directory (:func:`.journal_gen.write_marker`; ``sync``:
    fdatasync it, and fsync a directory when its marker was created, as ``g3.fsync`` says).

    Raises:
        JournalPathError: a directory holds a directory, a symbolic link or another non-file under the
            journal's name (it is never followed or replaced).
        OSError: a journal could not be read.
    """
    got = {d: probe(slabs.dir_fd(d), d, fingerprint) for d in slabs.paths}
    marks = {d: jg.read_marker(slabs.dir_fd(d), d, fingerprint) for d in slabs.paths}
    gen = 1 + max([m for m in marks.values()] + [g[2] or 0 for g in got.values() if g is not None])
    for d in slabs.paths:  # first: a journal written with ``gen`` implies every directory it names knows it
        jg.write_marker(slabs.dir_fd(d), d, fingerprint, gen, sync)
    by_gen = all(g[2] is not None for g in got.values() if g is not None and g[0])
    found = [(g[0], (g[2] or 0) if by_gen else 0, g[1], -pos, d)  # (valid, generation, mtime, -position, dir)
             for pos, (d, g) in enumerate(got.items()) if g is not None]
    if not found:
        held = sum(f.size_slots for f in slabs.files)
        if held:
            log.warning("G3: no journal-%s.log in any of g3.paths (%s), but its slab files hold %d slots: the "
                        "index is rebuilt from their slot headers (was the directory holding the journal left out "
                        "of g3.paths?)", fingerprint, ", ".join(slabs.paths), held)
        return Home(slabs.paths[0], generation=gen)
    best = max(found)
    home = Home(best[4] if best[0] else slabs.paths[0], [d for *_, d in found], gen)
    if home.directory in home.stale:
        home.stale.remove(home.directory)
    if home.stale:
        log.warning("G3: journals of namespace %s in %d directories: %s; using %s (%s), the other(s) are removed "
                    "once it is rewritten", fingerprint, len(found),
                    ", ".join(os.path.join(d, f"journal-{fingerprint}.log") for *_, d in found),
                    os.path.join(home.directory, f"journal-{fingerprint}.log"),
                    ("the newest valid one (generation)" if by_gen else "the newest valid one (modification "
                     "time: one has no generation)") if best[0] else "none is valid: the slot headers are scanned")
    if home.directory != slabs.paths[0]:
        log.info("G3: journal found in %s, not the first of g3.paths (the list changed); it stays there",
                 home.directory)
    return home


def remove_stale(slabs: SlabSet, fingerprint: str, home: Home) -> list[str]:
    """Remove the stale journals of ``home`` (call once the home's journal was rewritten: it is durable and
    holds the restored index), fsyncing each directory. Returns the paths removed; a failure is logged, never
    raised (the next open removes it: the home's journal, just rewritten, is the newest)."""
    out = []
    name = f"journal-{fingerprint}.log"
    for d in home.stale:
        fd = slabs.dir_fd(d)
        try:
            os.unlink(name, dir_fd=fd)
            os.fsync(fd)
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("G3: cannot remove the stale journal %s (%s)", os.path.join(d, name), e)
            continue
        out.append(os.path.join(d, name))
    home.stale = []
    if out:
        log.info("G3: removed stale journal(s) %s", ", ".join(out))
    return out
