"""Retention for G4: remove blocks by age and/or down to a capacity target (oldest first), per tenant
too, plus blocks of revoked tenants (crypto-shredded) and stale writer temp files.

Only block names of this store (five components under its prefix, :func:`.naming.parse_block_name`) are blocks:
another fleet's store nested below this one's root is never deleted from; its blocks are counted ``nested_blocks``.
Before 2026-11-30 the outer fleet's age and capacity passes deleted them. Likewise only writer temp files in a
directory this store's writers write to (:func:`own_temp`: ``{ns}/``, ``{ns}/announce/{tenant}/``,
``{ns}/{tenant}/{rank}/{fan}/``, ``gc-clock-probe/``) are removed once stale; the others (a nested store's, in
flight or not) are counted ``nested_temps`` and left (before 2026-11-30 the outer gc removed the nested fleet's
temp files older than ``temp_grace_s``: with a short grace, its writes in flight failed).

Safe while workers run: only published objects are deleted (a concurrent reader gets a miss, never
wrong bytes: every read verifies), and writer temp files only once older than ``temp_grace_s``.

**Time base.** Ages come from the store (S3 ``LastModified``, POSIX ``mtime``) and are measured against
the store's own clock, never ours alone: ``store_now`` is the earlier of the time the store states (S3: the
``Date`` header, :meth:`~.store.ObjectStore.server_time`) and the mtime of an empty probe object written now
and removed (:func:`probe_clock`: the clock that stamps every object; an NFS server, not this host, stamps a
file's mtime), whichever of the two works, else this host's clock. A block is old when
``store_now - mtime >= max_age_s``; 0 means every block. Objects stamped later than ``store_now`` (a writer
whose clock runs ahead, a restored file) are young, and counted (``future_objects``). Before (2026-11-29),
``store_now`` was never earlier than the newest mtime of the listing: one object stamped a day ahead made every
block a day older, so ``--max-age-s 3600`` deleted blocks written seconds before and every writer's temp file in
flight. The stated ``Date`` need not come from the clock that stamps ``LastModified``: a reverse proxy in front of
the store (nginx by default sends its own ``Date``, not the upstream's) or a load balancer over gateways stamps it
on its own host's clock. Before 2026-12-03 gc took the stated time alone where there was one: a proxy whose clock
ran 2 h ahead made ``--max-age-s 3600`` delete blocks written seconds before. Now the probe is written on every
pass (a dry run writes none: its time base is the stated time alone), the earlier clock wins (the later one can
only make blocks look older), and a difference of more than :data:`CLOCK_AGREE_S` is a ``warnings`` line. The
probe is empty (before 2026-12-03 one byte): a full store (ENOSPC, block quota), where the one-byte probe failed
and gc fell back to this host's clock, takes an empty file (an inode, no data block), so a host clock running ahead
of the file server no longer ages every block on the full store gc was run to free.

**Throttling.** A LIST page or DELETE the store answers "slow down" (S3 ``503 SlowDown``, 429...) is
retried after the pool's full-jitter backoff (:mod:`.throttle`), up to :data:`THROTTLE_ATTEMPTS` tries
(~5 s at most): a still-throttled DELETE is an error, a still-throttled LIST ends the pass (raised; what the
pages before it decided stays done). Before (2026-11-29) one "slow down" on any LIST page aborted the pass and
every throttled DELETE was an error.

**Memory.** Revoked and age deletions are decided while the store is listed, so such a pass keeps ~16 bytes per
block it deletes, to count each once (:class:`.gc_once.NameSet`: repeats, below), and nothing per other object; a
capacity target (``target_bytes``) keeps one ``(mtime, size, name)`` tuple per block it may still
delete, by name (repeats: below), to delete oldest first. Before (2026-11-29) every listed block's ObjectInfo and parsed name were kept
first (~870 B each: ~40 GiB for 50M objects). An S3 listing remembers which keys it named, ~1.5-1.7 bytes per key,
up to ~3.3 just after its filter grows (~106 MiB at 50M keys: a scalable Bloom filter, :class:`.s3_list.SeenKeys`;
before 2026-12-03 documented as ~1 byte), to tell a listing that stopped advancing from one in another key order.

**Repeated listings.** A listing may name an object twice: an S3-compatible server that repeats a page (a
continuation token answered with the previous page again), a file store's directory read while it changes (NFS
``readdir``). A capacity pass keeps one entry per name (the latest listed), so its total is each block once and
it deletes oldest blocks only down to ``target_bytes``; every further entry of a kept name is counted
``listed_duplicates`` (not in ``scanned_*``). Before 2026-12-01 each entry counted: a listing naming every
object twice made a pass with a target of 8 of 10 blocks delete 6 good blocks, not 2. A block an age or revoked
pass deletes is remembered (:mod:`.gc_once`): a further entry of it is counted ``listed_duplicates`` too, never
again in ``scanned_*`` or ``deleted_*``, dry run or not. Before 2026-12-03 such a pass kept nothing per object: a dry
run counted a repeated block twice (objects and bytes), a real run found it gone (``changed_since_listed``, its
bytes twice in ``scanned_bytes`` and ``remaining_bytes``; on a store that lists no versions deleted again, a no-op
counted again in ``deleted_*``). A block no pass deletes or keeps (young, without a capacity target) is not
remembered (memory: a pass keeps nothing per such object): each entry of it counts in ``scanned_*``.

**Deleting what was listed.** Every block and announcement is deleted only while its name still holds the object
listed (:meth:`~.store.ObjectStore.delete_if_listed`: S3 ``If-Match:`` the listed ETag, file stores a quarantine
rename and the listed inode, mtime and size compared): when another process deleted it and a worker wrote the
block again between the listing and the delete, the new copy is kept. Such a listed object, or one gone by the
delete, is counted ``changed_since_listed`` (not ``deleted_*``); a capacity pass counts its bytes as gone (it
never deletes more because of it). Writer temp files have unique names: deleted by name. Before 2026-12-01 gc
deleted by name: that race deleted the good new copy (a block lost, never wrong bytes).

**Revoked tenants.** Every block under a revoked tenant's pseudonym sealed under a revoked key is reclaimed
whatever its age or mtime (its data keys are gone: it can never be read again). gc tells such blocks apart by
their frame header, whether or not the keyring it was given shows the tenant re-created (``keys create`` after
``revoke``: the same pseudonym, a new key id).

*Not re-created* (as far as gc's keyring knows): when the revocation record names key ids, gc reads every block's
frame header (4 KiB, ``headers_read``) and deletes the block when its ``key_id`` is one of them. A block sealed
under another key id is kept and counted (``revoked_kept``, plus a ``warnings`` line per pseudonym): only a
re-created tenant's current key seals such blocks, so the keyring copy gc was given predates the re-creation (a
CronJob's Secret volume not yet synced, a copy taken between ``revoke`` and ``create``). A frame naming no key
(plaintext, unparsable) is deleted when modified up to ``revoked_at`` + :data:`LATE_WRITE_S` (moved onto the
store's clock, below): until then a worker that had not re-read the keyring may have written it for the revoked
tenant, and it is reclaimed as before; a later one can only be a re-created tenant's (a pool with a keyring,
plaintext too, writes nothing for a revoked tenant once it re-read the file): kept, counted ``revoked_kept``. A
block gc could not read is kept (``errors``). Kept blocks are read again on every pass until gc is given a
keyring that shows the re-creation. A record naming no key ids (written before 2026-11-30) has every block
deleted unread, as before. Before 2026-12-01 every block under the pseudonym was deleted unread: such a stale
pass deleted the re-created tenant's current blocks, good blocks every worker serves.

*Re-created* (gc's keyring holds a tenant of that pseudonym again): gc reads the header (``headers_read``) of
each block last modified up to ``revoked_at`` (the keyring writer's clock, moved onto the store's by the measured
skew ``store_now - now``) + :data:`LATE_WRITE_S` and deletes the block when its ``key_id`` is one the revocation recorded (a record from before 2026-11-30 names
none: then any key id but the tenant's current one). A block of the tenant's current key, or one gc could not
read (``errors``), is kept; an unparsable or plaintext frame (it names no key) is deleted when modified up to
``revoked_at`` + 1 s, kept when later. Late writes: a worker seals under the revoked key until it re-reads the
keyring (``g4.keyring.reload_interval_s``, plus the Secret's propagation on Kubernetes), and such a block held
the re-created tenant's name for ever (its offloads ``skipped_exists``, loads ``miss_no_key``): before
(2026-11-30) gc kept every block newer than ``revoked_at`` + 1 s. Also before (2026-11-30), blocks modified up
to ``revoked_at`` + 1 s were deleted unread; ``revoked_at`` is the clock of the host that ran ``keys revoke``,
so where that clock ran ahead of the store's (and gc's host's) the re-created tenant's blocks of its current key
written within the lead were deleted: good blocks every worker serves. A block of a revoked key is read once
(then deleted); the current key's blocks up to ``revoked_at`` + :data:`LATE_WRITE_S`, on every pass. Blocks
modified later are not read (their headers would be read on every pass, for ever): a worker seals under a
revoked key only until its next keyring check (``reload_interval_s`` <= 300 s, plus the Secret's propagation),
and the window is on the block's mtime, so any later pass finds a late write. Loads never delete such a block
(a reader's keyring may be another fleet's copy: ``miss_no_key``).

**Impossible sizes.** An object at a block name whose size cannot be a block of its namespace (:mod:`.gc_sizes`:
not the one frame size the namespace's ``namespace.json`` gives; without that file, negative or over 1 GiB), by
its listing and by a look at the object itself (S3 HEAD, ``stat``), is no block: counted ``invalid_size``, never
in ``scanned_*`` nor in a capacity total. Where its namespace's size is known it is junk no reader serves, deleted
on every pass (``deleted_by["invalid_size"]``, a key there only when there are; a dry run deletes nothing); else it
is kept (a ``warnings`` line). An object the age or revoked pass deletes whatever its size is looked at all the
same: a block whose listing misstated its size is deleted for that reason at its true size; one that is no block
counts ``invalid_size`` as above (junk deleted as ``invalid_size``, any other for the pass's reason). Deleted
objects that are no block count in ``deleted_bytes`` at the size the look found where a block of some layout could
have it, else 0 (:meth:`.gc_sizes.BlockSizes.freed`). One whose look failed is deleted for the pass's reason at 0
bytes, not counted ``invalid_size`` (its size was never checked; before, the first version of 2026-12-03 counted it,
and the "left alone" warning below could name it); one the look finds gone, or its name holding another object
(:func:`.gc_sizes.same_version`: written again since), counts ``changed_since_listed``, as the delete would, and is
kept (before, in that version: gone, counted nowhere; written again, deleted for the pass's reason although its own
mtime may be young: the age pass deleted a block written seconds before). Before 2026-12-03 the age and revoked
passes counted an object that is no block at its listed size (an S3 listing stating 1 TiB, a 1 TiB sparse file:
"1 TiB freed", ``invalid_size`` 0), and junk deleted by any pass at the size it stated (1 TiB for a sparse file). A repeated listing
entry of a kept block stating an impossible size is ignored, and one of an object judged no block is skipped: it
counts (and is deleted) once (before 2026-12-03 each entry counted, a dry run's ``deleted_bytes`` twice). A look
that fails (the store unavailable, still throttled: :meth:`.gc_sizes.BlockSizes.judge` ``unchecked``) leaves the
object alone, out of the capacity total, counted ``invalid_size`` (by its listing) and in ``errors``, with a
``warnings`` line naming the failure (before 2026-12-03: no error, and a warning that the namespace's
``namespace.json`` was missing); so does one whose size is impossible for any layout where the read of its
namespace's ``namespace.json`` failed (a get that raised, not a missing file: the warning names that read; before
2026-12-03 ``kept``, no error). Before 2026-12-03 the listed size counted as it came: a block-named file truncated
to 1 TiB (sparse: 4 KiB on disk) or an S3 listing stating a block at 1 TiB or a negative size made a capacity pass
delete every good block. The capacity total is of the blocks' sizes (a file's ``st_size``, not the space it takes:
a block is written whole, and a sparse or compressed file of a block's size is counted as the block it is, a sparse
one of another size is junk).
Keys an S3 listing names outside the store's prefix (a server or proxy that ignores ``Prefix``) are skipped by the
store and counted ``outside_prefix``; a listing that loops (a continuation token handed out again, pages that
list nothing new) ends as an ``unlisted`` error (:mod:`.s3_list`).

**Announcements** (``{ns}/announce/``, :mod:`.announce`): a batch at least ``announce_ttl_s`` old by its
mtime on the store's clock is deleted, as an announcing worker would (a batch sealed earlier than its mtime is
older still for pollers: gc, which does not open batches, deletes it no sooner than they); so is any object
under ``announce/`` whose name is not an announcement's. Only on a measured store clock (``time_base``
``"server"``), never on this host's alone; counted ``deleted_by["announce"]``, not in ``scanned_*``. Before
(2026-11-30) gc never deleted them: a fleet that turned announcements off kept them for ever.

**Directories** (file stores): after the pass, each directory gc deleted an object from (a block, a temp file,
an announcement batch) is removed if it is now empty, then its parent if that is now empty, and so on
(:meth:`~.store.ObjectStore.prune_dirs`, :mod:`.fs_prune`): ``rmdir`` only, which refuses a directory a
writer has just put anything in, and never the store root or a namespace's own directory (the root's
subdirectories); a put whose directory went meanwhile makes it again. Counted ``pruned_dirs``; a dry run
removes none. Before (2026-11-30) gc left every emptied fan-out, rank and tenant directory for ever: a
long-lived shared mount's tree (inodes, walk time of every later gc and listing) grew without bound. gc keeps
one entry per directory it deleted from (at most the fan-out directories of the store). Directories left empty
before this, under which nothing is deleted any more, stay.
"""
from __future__ import annotations

import math
import time
import uuid
from typing import TYPE_CHECKING, Any

from ...model.frame import FLAG_ENCRYPTED, HEADER_BYTES, FrameError, FrameHeader
from .announce import ANNOUNCE_DIR, batch_prefix, parse_batch_name
from .gc_once import NameSet
from .gc_sizes import BlockSizes
from .naming import parse_block_name
from .store import ObjectInfo, ObjectStore, listing
from .throttle import call_attempts

if TYPE_CHECKING:
    from ...crypto.keyring import Keyring

ANNOUNCE_TTL_S = 3600.0  # g4.announce_ttl_s's default: the age gc deletes announcement batches at
CLOCK_PROBE_PREFIX = "gc-clock-probe/"  # probe objects of probe_clock (never block names)
THROTTLE_ATTEMPTS = 10  # a LIST page or DELETE the store throttles ("slow down"): tries, backoff between
LATE_WRITE_S = 3600.0  # a re-created tenant's blocks up to revoked_at + this: frame header read (module doc)
PROBE_STALE_S = 86400.0  # a probe object this old (a crashed gc's or announce poller's) is removed
CLOCK_AGREE_S = 30.0  # stated time and probe mtime further apart than this: a warnings line (module doc)


def own_temp(name: str) -> bool:
    """Whether the writer temp file ``name`` (store-relative) lies in a directory this store's own writers write
    to: ``{ns}/`` (namespace.json), ``{ns}/announce/{tenant}/`` (announcements), ``{ns}/{tenant}/{rank}/{fan}/``
    (blocks: the five-component rule of :func:`.naming.parse_block_name`) or ``gc-clock-probe/``
    (:func:`probe_clock`). A temp file deeper down, or elsewhere, is another store's (one nested below this
    store's root): False."""
    d = name.split("/")[:-1]
    if len(d) == 1:
        return _hexn(d[0], 16) or d[0] + "/" == CLOCK_PROBE_PREFIX
    if len(d) == 3:
        return _hexn(d[0], 16) and d[1] == ANNOUNCE_DIR and _hexn(d[2], 32)
    return (len(d) == 4 and _hexn(d[0], 16) and _hexn(d[1], 32) and d[2].isdigit()
            and _hexn(d[3], len(d[3])) and bool(d[3]))


def _hexn(s: str, n: int) -> bool:
    return len(s) == n and all(c in "0123456789abcdef" for c in s)


def probe_clock(store: ObjectStore) -> float | None:
    """The mtime (epoch s, the store's clock: what stamps every object) of an empty probe object written under
    :data:`CLOCK_PROBE_PREFIX` and removed; None when it cannot be written or read back. Empty: a full store takes
    it (module doc, "Time base"). Read back by :meth:`~.store.ObjectStore.stat` (S3 HEAD, a file's ``stat``) where
    the store's stat knows the object (a version and an mtime), else from a listing of the prefix, which also
    removes probes a crashed gc left, older than a day (gc's own pass removes those too: no listing of its own,
    so a proxy's list page is never spent on it). Never raises."""
    name = f"{CLOCK_PROBE_PREFIX}{uuid.uuid4().hex}"
    try:
        store.put_if_absent(name, b"")
    except OSError:  # refused (read-only...) or unanswered: it may have landed all the same, removed below
        _delete_quiet(store, name)
        return None
    except Exception:  # noqa: BLE001 - a store that cannot write at all: nothing written
        return None
    t = None
    try:
        info = store.stat(name)
        if info is not None and info.version is not None and info.mtime > 0:
            t = info.mtime
        else:  # a store whose stat gives no mtime (the default: 0.0): its listing does
            probes = list(store.list(CLOCK_PROBE_PREFIX))
            t = next((o.mtime for o in probes if o.name == name), None)
            for o in probes:
                if t is not None and o.name != name and t - o.mtime > PROBE_STALE_S:
                    store.delete(o.name)
    except Exception:  # noqa: BLE001 - no clock from the store: the caller uses another
        t = None
    _delete_quiet(store, name)
    return t


def _delete_quiet(store: ObjectStore, name: str) -> None:
    try:
        store.delete(name)
    except Exception:  # noqa: BLE001 - never written, or the store went away: nothing to remove
        pass


def _tenant_pseudonym(tenant: str, keyring: Keyring | None) -> tuple[str, str | None]:
    """``(pseudonym hex, warning or None)`` of gc's ``--tenant``. With a keyring: a tenant id it knows
    (active, or revoked: its pseudonym is recorded) wins, else a 32-hex value is a pseudonym (``keys list``
    shows revoked tenants by pseudonym only), else it is a tenant id the keyring does not know (a typo?
    warned). Before 2026-11-29 a pseudonym given with ``--keyring`` was hashed again as a tenant id: it
    matched nothing. Without a keyring only a pseudonym can be mapped (ValueError)."""
    is_hex = len(tenant) == 32 and all(c in "0123456789abcdef" for c in tenant)
    if keyring is None:
        if not is_hex:
            raise ValueError(f"--tenant {tenant!r}: needs --keyring to map a tenant id to its pseudonym "
                             "(or pass the 32-hex pseudonym)")
        return tenant, None
    known = {r["pseudonym"] for r in keyring.info()} | set(keyring.revoked())
    ps = keyring.pseudonym(tenant).hex()
    if ps in known:
        return ps, None
    if is_hex:
        return tenant, None if tenant in known else (f"--tenant {tenant}: taken as a pseudonym; the keyring "
                                                     "has no tenant of that id or pseudonym")
    return ps, f"--tenant {tenant!r}: not a tenant of the keyring (active or revoked): a typo?"


def run_gc(store: ObjectStore, *, keyring: Keyring | None = None, max_age_s: float | None = None, target_bytes: int | None = None,
           tenant: str | None = None, temp_grace_s: float = 3600.0, dry_run: bool = False,
           now: float | None = None, announce_ttl_s: float = ANNOUNCE_TTL_S) -> dict[str, Any]:
    """One gc pass over ``store``.

    Args:
        keyring: :class:`~kvbm_backend.crypto.keyring.Keyring`: maps ``tenant`` ids to pseudonyms and
            names revoked tenants whose blocks are reclaimed. Without it, ``tenant`` must be a
            32-hex pseudonym and revoked tenants are not known.
        max_age_s: delete blocks last modified at least this many seconds before ``store_now`` (0: all).
        target_bytes: then delete oldest blocks until the (tenant's) blocks total at most this.
        tenant: restrict everything to one tenant: its id (with ``keyring``) or its 32-hex pseudonym; with
            ``keyring``, a tenant id the keyring knows wins over a pseudonym (:func:`_tenant_pseudonym`).
        now: this host's clock (epoch s, finite; default ``time.time()``), used where the store's clock cannot be
            measured. Before 2026-12-03 it was not checked: ``inf`` there made every block old (all deleted).
        temp_grace_s: writer temp files older than this are removed (crashed writers).
        announce_ttl_s: announcement batches at least this old (store clock) are deleted (module doc).
        dry_run: report only (writes nothing: no clock probe either, so a store that states a time is measured on
            it alone, and one that states none on this host's clock, ``time_base: "local"``).
    Returns:
        dict of counts and bytes: scanned_* (blocks), deleted_* (blocks and temp files) and per-reason
        ``deleted_by``; ``remaining_bytes`` (blocks left: ``scanned_bytes`` less the blocks' deleted bytes); ``store_now`` (the
        time base, epoch s), ``time_base`` (``"server"``: the store's clock, stated or probed;
        ``"local"``: this host's; module doc, "Time base") and ``clock_skew_s`` (``store_now - now``); ``headers_read``: frame headers
        read to tell a revoked tenant's blocks under a revoked key from others (module doc); ``revoked_kept``:
        blocks of a tenant ``keyring`` shows revoked and not re-created kept because their header names no
        revoked key (module doc, "Revoked tenants"); ``warnings`` (only when there are: ``tenant`` unknown to
        ``keyring``, a pseudonym with ``revoked_kept`` blocks, a stated time and probe mtime apart); ``unlisted``: one line per
        part of the store that could not be listed (a directory of a file store), each counted in ``errors``
        (what was listed is still processed: nothing unlisted is deleted); ``pruned_dirs``: directories of a
        file store removed because the pass's deletions left them empty (module doc, "Directories");
        ``nested_blocks``: block names deeper below the store's root (another store nested in this one:
        never deleted); ``nested_temps``: writer temp files outside this store's own directories
        (:func:`own_temp`; never deleted); ``listed_duplicates``: listing entries naming a block a capacity
        target keeps, or the age or revoked pass deletes, that was listed already (module doc, "Repeated listings";
        each such block counts once);
        ``changed_since_listed``: listed objects not deleted because by the delete (or the size check before it of
        one the pass deletes) their name was gone or held another object (module doc, "Deleting what was listed");
        ``invalid_size``: objects at block names whose size
        cannot be a block's (module doc, "Impossible sizes"; deleted as ``deleted_by["invalid_size"]``, a key
        there only when there are, where the namespace's block size is known, else kept, or deleted by an age or
        revoked pass for its reason; never at an impossible size in ``deleted_bytes``); ``outside_prefix``: keys
        an S3 listing named outside the store's prefix, skipped (:mod:`.s3_list`).
    Raises:
        ValueError when ``tenant`` cannot be resolved or a threshold or ``now`` is negative, infinite or NaN
        (before anything is listed or deleted); StoreUnavailable when the store is down.
    """
    for name, v in (("max_age_s", max_age_s), ("target_bytes", target_bytes), ("temp_grace_s", temp_grace_s),
                    ("announce_ttl_s", announce_ttl_s), ("now", now)):  # now: an infinite one made every block old
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}: must be a finite number >= 0 (got {v})")
    now = time.time() if now is None else now
    want, warning = _tenant_pseudonym(tenant, keyring) if tenant is not None else (None, None)
    # the earlier of the stated time and a probe's mtime (module doc, "Time base"); a dry run writes nothing, not
    # even the probe: the store's stated time, else this host's
    stated = store.server_time()
    probed = None if dry_run else probe_clock(store)
    server_now = min((t for t in (stated, probed) if t is not None), default=None)
    revoked = keyring.revoked() if keyring is not None else {}
    # re-created after revocation (revoked is empty without a keyring): pseudonym -> its current key id
    active = {r["pseudonym"]: int(r["key_id"]) for r in keyring.info()} if keyring is not None and revoked else {}
    # revoked pseudonym -> the key ids its record names (empty: a record from before 2026-11-30)
    shredded = {ps: keyring.revoked_key_ids(ps) for ps in revoked} if keyring is not None else {}
    kept: dict[str, int] = {}  # revoked, not re-created pseudonym -> blocks kept (revoked_kept): warned
    base, store_now = ("server", server_now) if server_now is not None else ("local", now)
    skew = store_now - now
    unlisted: list[str] = []  # parts of the store not listed (errors, named)
    res: dict[str, Any] = {"dry_run": dry_run, "url": store.url, "scanned_objects": 0, "scanned_bytes": 0,
           "deleted_by": {"revoked": 0, "age": 0, "capacity": 0, "temp": 0, "announce": 0},
           "deleted_objects": 0, "deleted_bytes": 0, "errors": 0, "unlisted": unlisted, "store_now": store_now, "time_base": base,
           "clock_skew_s": skew, "future_objects": 0, "headers_read": 0, "pruned_dirs": 0, "nested_blocks": 0,
           "nested_temps": 0, "listed_duplicates": 0, "changed_since_listed": 0, "revoked_kept": 0,
           "invalid_size": 0, "outside_prefix": 0}
    warnings = res["warnings"] = [warning] if warning is not None else []
    if stated is not None and probed is not None and abs(stated - probed) > CLOCK_AGREE_S:
        warnings.append(f"the store's stated time (S3 Date header) is {stated - probed:+.0f} s from the mtime of a "
                        "probe object written now: a proxy or gateway in front of the store states another clock "
                        "than the one stamping objects; ages are measured on the earlier")

    def sealed_revoked(name: str, ps: str, keyless: bool) -> bool:
        """Whether block ``name`` of revoked pseudonym ``ps`` was sealed under a revoked key, by its frame header
        (module doc, "Revoked tenants"); ``keyless``: where a frame naming no key (unparsable, plaintext) goes. A
        block of a pseudonym not re-created (as far as ``keyring`` knows) that is kept counts ``revoked_kept``."""
        try:
            head = call_attempts(lambda: store.get(name, 0, HEADER_BYTES), THROTTLE_ATTEMPTS)
        except OSError:  # StoreUnavailable, StoreThrottled after THROTTLE_ATTEMPTS too: kept, counted (as drop)
            res["errors"] += 1
            return False
        if head is None:  # deleted since listed
            return False
        res["headers_read"] += 1
        try:
            hdr: FrameHeader | None = FrameHeader.unpack(head)
        except FrameError:
            hdr = None
        if hdr is None or not hdr.flags & FLAG_ENCRYPTED:
            gone = keyless
        else:
            ids = shredded[ps]
            gone = hdr.key_id in ids if ids else hdr.key_id != active[ps]
        if not gone and ps not in active:
            res["revoked_kept"] += 1
            kept[ps] = kept.get(ps, 0) + 1
        return gone

    emptied: set[str] = set()  # directories objects were deleted from (one name each): pruned at the end

    def drop(name: str, size: int, why: str, listed: ObjectInfo | None = None) -> None:
        """Delete ``name`` (``size`` bytes) for reason ``why``: only while it is the object ``listed``
        (module doc, "Deleting what was listed"); by name when None (writer temp files: unique names) or when
        the store listed no version."""
        if not dry_run:
            try:
                gone = call_attempts(lambda: store.delete(name) if listed is None or listed.version is None
                                     else store.delete_if_listed(listed), THROTTLE_ATTEMPTS)
            except OSError:  # StoreThrottled too, after THROTTLE_ATTEMPTS "slow down" answers
                res["errors"] += 1
                return
            if gone is False:  # the name is gone or holds another object since listed: kept, not deleted
                res["changed_since_listed"] += 1
                return
            if "/" in name:
                emptied.add(name.rsplit("/", 1)[0] + "/")
        res["deleted_by"][why] = res["deleted_by"].get(why, 0) + 1  # "invalid_size" only when there are
        res["deleted_objects"] += 1
        res["deleted_bytes"] += size

    # Decided while listing (module doc, "Memory"): only the blocks a capacity target may still delete are
    # kept, as name -> (mtime, size, name, version) (one entry per name: "Repeated listings"); an age or revoked
    # pass keeps nothing per object.
    keep: dict[str, tuple[float, int, str, str | None]] = {}
    block_bytes = 0  # deleted block bytes (not temp files): remaining_bytes
    sizes, invalid_kept, unchecked = BlockSizes(store, THROTTLE_ATTEMPTS), 0, 0  # module doc, "Impossible sizes"
    no_block: set[str] = set()  # names judged no block (invalid_size): a repeated entry is skipped, counted once
    counted = NameSet()  # blocks the age or revoked pass deletes: a repeated entry is counted (and deleted) once
    outside = getattr(store, "listed_outside_prefix", 0)  # S3 listings: keys outside the prefix, skipped
    for o in listing(store.list_patient("", THROTTLE_ATTEMPTS), unlisted):
        seen = keep.get(o.name)
        if seen is not None:  # listed again (a repeated page): one block, counted once, its latest entry kept
            res["listed_duplicates"] += 1
            if sizes.possible(o.name[:16], o.size):  # else the earlier entry stands (a lie about a block's size)
                res["scanned_bytes"] += o.size - seen[1]
                keep[o.name] = (o.mtime, o.size, o.name, o.version)
            continue
        if o.name in no_block:  # an invalid_size object listed again: counted (and deleted) once
            continue
        meta = parse_block_name(o.name)
        if meta is None and parse_block_name(o.name, nested=True) is not None:
            res["nested_blocks"] += 1  # another store's block below this one's root: never ours to delete
            continue
        if meta is None and o.name.startswith(CLOCK_PROBE_PREFIX):  # a clock probe a crashed gc (or poller) left
            if base == "server" and not dry_run and o.name.count("/") == 1 and store_now - o.mtime > PROBE_STALE_S:
                _delete_quiet(store, o.name)
            continue
        if meta is None and batch_prefix(o.name):  # an announcement, or junk under announce/
            ann = parse_batch_name(o.name)
            if base == "server" and ((ann is None and want is None) or (
                    ann is not None and (want is None or ann[0] == want) and store_now - o.mtime >= announce_ttl_s)):
                drop(o.name, o.size, "announce", o)
            continue
        if meta is None or (want is not None and meta["tenant"] != want):
            continue
        if o.name in counted:  # listed again, deleted (or to be: a dry run) by age or revocation: counted once
            res["listed_duplicates"] += 1
            continue
        res["scanned_objects"] += 1
        res["scanned_bytes"] += o.size
        res["future_objects"] += o.mtime > store_now
        ps, t_rev = meta["tenant"], revoked.get(meta["tenant"])
        if t_rev is None:
            gone = False
        elif ps in active:  # re-created: a revoked key's blocks, read up to revoked_at + LATE_WRITE_S
            gone = (o.mtime <= t_rev + skew + LATE_WRITE_S
                    and sealed_revoked(o.name, ps, o.mtime <= t_rev + skew + 1.0))
        else:  # not re-created as far as the keyring knows: every block read when the record names key ids
            gone = not shredded[ps] or sealed_revoked(o.name, ps, o.mtime <= t_rev + skew + LATE_WRITE_S)
        why = ("revoked" if gone
               else "age" if max_age_s is not None and (max_age_s == 0 or store_now - o.mtime >= max_age_s)
               else None)
        if why is not None:
            counted.add(o.name)
        # an impossible listed size is looked at whatever the pass decides (module doc, "Impossible sizes")
        verdict, judged = sizes.judge(o, meta["ns"], deleting=why is not None)
        if verdict != "block":  # no block: out of scanned_*, never in a capacity total
            res["scanned_objects"] -= 1
            res["scanned_bytes"] -= o.size
            res["future_objects"] -= o.mtime > store_now
            if verdict == "gone":  # since listed: one this pass deletes is counted as by the delete (drop)
                res["changed_since_listed"] += why is not None
                continue
            no_block.add(o.name)
            if verdict == "unchecked" and why is not None:  # deleted whatever its size, which was never checked:
                drop(o.name, 0, why, judged)  # not invalid_size, no bytes, not in the warning of those left alone
                continue
            res["invalid_size"] += 1
            if verdict == "junk" or why is not None:  # junk: as the capacity pass's
                drop(o.name, sizes.freed(verdict, judged), "invalid_size" if verdict == "junk" or why is None else why,
                     judged)
            elif verdict == "unchecked":  # its HEAD / stat or namespace.json read failed: left alone, an error
                unchecked += 1
                res["errors"] += 1
            invalid_kept += verdict == "kept" and why is None
            continue
        res["scanned_bytes"] += judged.size - o.size  # a listing's misstated size: what the object holds
        if why is not None:
            before = res["deleted_bytes"]
            drop(o.name, judged.size, why, judged)
            block_bytes += res["deleted_bytes"] - before
        elif target_bytes is not None:
            keep[o.name] = (judged.mtime, judged.size, o.name, judged.version)
    if target_bytes is not None:
        oldest = list(keep.values())  # the dict's tuples, not copies
        keep.clear()
        total = sum(e[1] for e in oldest)
        oldest.sort(key=lambda e: e[:3])  # names are unique: the version is never compared
        for mtime, size, name, version in oldest:
            if total <= target_bytes:
                break
            before = res["deleted_bytes"]
            drop(name, size, "capacity", ObjectInfo(name, size, mtime, version))
            block_bytes += res["deleted_bytes"] - before
            total -= size
    # blocks only, as scanned_bytes: before 2026-11-29 the temp files' bytes were subtracted too (negative)
    res["remaining_bytes"] = res["scanned_bytes"] - block_bytes
    res["outside_prefix"] = getattr(store, "listed_outside_prefix", 0) - outside
    if invalid_kept:
        warnings.append(f"{invalid_kept} object(s) at block names of an impossible size (negative, or over 1 GiB) "
                        "kept: their namespace's namespace.json is missing or is not that namespace's, so gc knows "
                        "no block size to tell junk by; not counted toward --target-gb (module doc, \"Impossible "
                        "sizes\")")
    if unchecked - sizes.unread:
        warnings.append(f"{unchecked - sizes.unread} object(s) at block names listed at a size no block of their "
                        f"namespace has could not be checked (HEAD / stat failed; first: {sizes.stat_error}): left "
                        "alone, not counted toward --target-gb, counted in errors; run gc again once the store answers")
    if sizes.unread:
        warnings.append(f"{sizes.unread} object(s) at block names of an impossible size (negative, or over 1 GiB) "
                        "left alone: the read of their namespace's namespace.json failed (first: "
                        f"{sizes.read_error}), so gc could not tell junk by its block size; not counted toward "
                        "--target-gb, counted in errors; run gc again once that file can be read")
    for o in listing(store.list_temps(""), unlisted):
        if not own_temp(o.name):
            res["nested_temps"] += 1  # another store's writer below this one's root: never ours to delete
        elif (want is None or f"/{want}/" in f"/{o.name}") and store_now - o.mtime > temp_grace_s:
            drop(o.name, o.size, "temp")
    res["errors"] += len(unlisted)
    res["pruned_dirs"] = store.prune_dirs(emptied) if emptied else 0
    warnings += [f"revoked tenant {ps}: {n} block(s) kept: their frame headers name no key its revocation "
                 "revoked (or no key, written after revoked_at + 1 h): the tenant was re-created after this "
                 "keyring copy was taken (`keys create`; a Secret not yet synced?): run gc with the current "
                 "keyring" for ps, n in sorted(kept.items())]
    if not warnings:
        del res["warnings"]
    return res
