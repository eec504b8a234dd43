"""``kvbm-backend g4 migrate``: rename G4 blocks stored under format 1 names (the sequence hash in clear,
:func:`.naming.legacy_block_name`) to keyed names (:class:`.naming.TenantNamer`).

Workers look blocks up under keyed names only (a second HEAD/GET per miss under the old name would double
the store requests of every miss, the common case of a cold prefix): after an upgrade, old-named blocks
are misses (recomputed, never wrong) until this step renames them. It is safe while workers run and can
be repeated: each old object is read, its header checked against its name, the object read and verified
(length; GCM tag under the keyring's data key, or xxh3), published under the new name create-exclusive (an
existing new object is kept: losing the race is success) and only then deleted. Before 2026-11-30 only the
header was checked: a read that came back damaged with its header intact (an S3 endpoint or proxy answering 200
with a short body) was published under the new name and the good source deleted, losing the block. A read that
does not verify now renames and deletes nothing: an error (the run exits 1; run it again), or
``skipped_invalid`` when the store confirms it holds those very bytes (:meth:`~.store.ObjectStore.stored_matches`:
a damaged object, left for gc). An object already under the new name (a worker's, or an earlier run's) counts
``already_present`` and the old one is deleted only when that copy is one the workers serve (its header names the
block, its payload verifies under a key the keyring holds, sealed where they encrypt); otherwise the old object,
the only good copy, stays (``kept_name_taken``): a worker drops a damaged copy on its first load, gc one sealed
under a revoked key or a plaintext one, and a later run renames it. Before 2026-11-30 it was deleted whatever
the new name held, and the block was lost once that copy was dropped.
The old object is deleted only while its name still holds the very bytes read and verified
(:meth:`~.store.ObjectStore.delete_if_matches`: S3 ``If-Match`` their MD5 ETag, a file store a quarantine rename and
a re-read): one rewritten meanwhile (a worker of the old version, in a rolling upgrade, writing the block again
under the old name after gc or a load dropped it) stays for the next run, counted ``changed_since_read`` (its copy
counts ``migrated`` or ``already_present`` as usual). Before 2026-12-03 it was deleted by name: that new object went
unread. Where that delete fails and the listing gave the object a version (S3 its ETag, a file store its inode, mtime
and size), it is sent again conditional on that version (:meth:`~.store.ObjectStore.delete_if_listed`); only when both
fail is the source kept, counted ``changed_since_read``. S3 buckets whose ETags are not the MD5 of the bytes (SSE-KMS
or SSE-C encryption, multipart uploads: ``"<md5 of the parts' md5s>-<n>"``) answer every ``If-Match`` MD5 with 412:
before 2026-12-03 every such source stayed, on every run (the migration never completed, the old objects doubled the
store). Safe: the listing came before the read, so an object written under the old name after it (what the first
delete guards against) is never the listed one: S3 gives it a new ETag, a file store's writers link a new inode (and
the failed quarantine swap of the first delete touched the mtime of the file it put back, so on a file store the second
delete only goes where that touch was not permitted); the listed object still there at the delete is the one read,
verified and published (or, on S3, a later one with the same ETag: the same bytes), and the new name holds a copy the
workers serve either way. A store that lists no version (None: that delete would be by name) never gets the second
delete.
Reads are bounded: an object (and the copy under its new name) is read up to the frame its header names and one
byte more (``skipped_invalid`` when longer), and a header naming a payload over :data:`MAX_FRAME_PAYLOAD_BYTES` is
not read on; before 2026-12-02 each was read whole, so an object grown or planted to gigabytes at a block's name
took the run's memory with it.
Objects whose header does not match their name, of revoked or unknown tenants (with a keyring), are not
renamed and are left for ``kvbm-backend gc``; so are encrypted frames whose data key is not their tenant's now
(``skipped_revoked``): a tenant revoked and then re-created by ``keys create`` keeps its pseudonym, so renaming
its shredded generation would put unreadable objects under the very names its new blocks take, with a fresh
mtime that hides them from gc's revoked-tenant rule (found 2026-11-29: the new writes lost every create-exclusive
PUT and every load missed until ``--max-age-s``).

Plaintext objects with a keyring need the workers' ``g4.encrypt`` (``encrypted``; the names cannot tell: a keyring
names the blocks of plaintext and encrypted pools alike). An encrypted pool never serves a plaintext frame: before
2026-11-30 migrate renamed them into its keyed names regardless, where each then held its name against the
encrypted copy (workers now delete such frames on their first load: one miss each). ``encrypted=True`` leaves them
(``skipped_plaintext``, for ``gc --max-age-s``), ``False`` renames them; unsaid, a plaintext object refuses the run
before anything is renamed.

A store that refuses a write for room (:class:`~.store.StoreFull`: no space, over quota, read-only) stops the run at
that object (``stopped_full`` says where and why; the run exits 3): the refused object and every one after it stay
under their old names, untouched, and a run after room is made renames them (those renamed are gone from the old
names). Before 2026-12-03 each refused write was counted as an error and the run went on through every remaining
object: thousands of failing writes on a full mount, each reported, for nothing renamed.

A store that stops answering (:class:`~.store.StoreUnavailable`: S3 5xx or no answer after the retries, a file mount
gone: EIO, ESTALE, ENOTCONN...) once the run has sent its first write stops it too (``stopped_unavailable``; the
run exits 4): the object it hit and every one after it stay under their old names (the one hit may already have its
copy under the new name, or its DELETE may have reached the store before the answer was lost: a later run settles
either), and a run once the store is back renames them. Before the first write (the listing, the header checks,
a dry run) it refuses the run, nothing written (exit 2). Before 2026-12-03 it refused the run at any point: exit 2
with no report, though objects had been renamed.

A store that answers "slow down" (:class:`~.store.StoreThrottled`: S3 ``503 SlowDown``, 429, ``Throttling``...) is
answered as the G4 pool answers it (:mod:`.throttle`): the same request is sent again after a full-jitter exponential
backoff (50 ms doubling to 1 s), up to ``throttle_attempts`` tries (:data:`THROTTLE_ATTEMPTS`: ~5 s at most), in every
part of the run (the listing's pages, the header checks, the renames, a dry run's reads). A request still throttled
after that stops the run there (``stopped_throttled``, how far it got; the run exits 5): the object it was at and every
one after it stay under their old names (the one it was at may have its copy under the new name already: a later run
counts it ``already_present``), and a run once the store has room for the load renames them. Before 2026-12-03 each
throttled request was one error and the run went on with the next object at once: a store that asked for fewer
requests got the run's full rate, and the run ended with a partial rename and an error per throttled object.
"""
from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ...crypto.aead import AeadError, key_check_differs, open_into
from ...crypto.names import UNKEYED_PSEUDONYM_KEY, derive_name_key
from ...model.frame import FLAG_CHECKSUM, FLAG_ENCRYPTED, HEADER_BYTES, FrameError, FrameHeader, payload_checksum
from .naming import TenantNamer, fanout_width, parse_block_name
from .store import ObjectStore, StoreFull, StoreThrottled, StoreUnavailable, listing
from .throttle import call_throttled

if TYPE_CHECKING:
    from ...crypto.keyring import Keyring

T = TypeVar("T")

#: bytes of payload a frame's header may name and still be read (1 GiB: the largest KV block of a published layout
#: is a few tens of MiB); a larger claim is ``skipped_invalid`` without reading it
MAX_FRAME_PAYLOAD_BYTES = 1 << 30
#: the reason a run stopped by :class:`~.store.StoreFull` names, by errno (:data:`.fs_put.FULL_ERRNOS`)
FULL_REASONS = {errno.ENOSPC: "full", errno.EDQUOT: "over quota", errno.EROFS: "read-only"}
#: tries of a request the store answers "slow down" before the run stops (``stopped_throttled``); the waits between
#: them are :func:`.throttle.backoff_s` (full jitter, 50 ms doubling to 1 s: at most ~5 s over 10 tries), as gc's
THROTTLE_ATTEMPTS = 10


def run_migrate(store: ObjectStore, *, keyring: Keyring | None = None, unkeyed: bool = False,
                dir_fanout: int = 256, dry_run: bool = False, encrypted: bool | None = None,
                throttle_attempts: int = THROTTLE_ATTEMPTS) -> dict[str, Any]:
    """Rename every format 1 block object of ``store`` to its keyed name, under the same prefix.

    Two passes: every candidate's header is read and checked first (nothing is written before all passed
    the checks that refuse the run), then each is read (up to its frame and a byte more), published under its new
    name and deleted.

    Args:
        keyring: the workers' :class:`~kvbm_backend.crypto.keyring.Keyring` (names are keyed by it, also
            for an unencrypted pool that has one).
        unkeyed: the workers have no keyring (names keyed by the public constant). One of ``keyring`` and
            ``unkeyed`` is required: renaming a keyring pool's blocks unkeyed puts them where no worker
            looks (before 2026-11-30 a plaintext pool with a keyring lost every block that way).
        dir_fanout: the workers' ``g4.dir_fanout`` (checked against the old names' fan-out directories).
        dry_run: count only, writing and deleting nothing: every object is read and verified as the run
            would, and an object already under the new name checked as the run would (``migrated``: would be
            renamed; ``already_present``: the new name holds a copy the workers serve; ``kept_name_taken``: it
            holds one they would not). Before 2026-11-30 it counted ``already_present`` for any object under
            the new name and ``migrated`` for sources the run would leave (``skipped_invalid``, errors).
        encrypted: the workers' ``g4.encrypt``: True leaves plaintext objects where they are (an encrypted pool
            never serves them: ``skipped_plaintext``), False renames them; None (not known) refuses the run when
            a plaintext object is found with ``keyring``, and a plaintext copy under a sealed source's new name
            is then not one the workers serve (``kept_name_taken``). Without a keyring the pool is plaintext.
        throttle_attempts: tries of each store request the store answers "slow down" (>= 1), a full-jitter backoff
            (:func:`.throttle.backoff_s`, seconds) before each retry; still throttled after that, the run stops.
    Returns:
        dict: ``legacy_objects`` found, ``migrated``, ``already_present`` (the new name existed: the old
        object was deleted: it held a copy the workers serve), ``kept_name_taken`` (the new name held an
        object the workers would not serve: the old object was kept), ``changed_since_read`` (of those renamed or
        already present: the old name held neither the bytes read nor the object listed, or nothing, by the delete:
        left for the next run; module doc),
        ``skipped_invalid`` (header does not match
        the name, the stored payload does not verify, or the object is longer than its frame), ``skipped_revoked``,
        ``skipped_unknown_tenant``, ``skipped_plaintext``, ``errors`` (a read that did not verify, the
        store not confirming it holds those bytes, is one); ``unlisted``: one line per part of the store that could not
        be listed (a directory of a file store), each counted in ``errors``. ``stopped_full``: None, or (the store
        refused a write for room: the run stopped there, renaming and deleting nothing more) a dict: ``url`` (the
        store), ``mount`` (a file store's mount point, else None), ``errno`` (``ENOSPC``, ``EDQUOT``, ``EROFS``),
        ``reason`` (``full``, ``over quota``, ``read-only``), ``error`` (the store's message) and ``not_renamed``
        (objects left under their old names by the stop, the refused one included: none of them touched).
        ``stopped_unavailable``: None, or (the store became unavailable after the run's first write: it stopped
        there) a dict: ``url``, ``error`` (the store's message), ``at`` (the old name it was renaming),
        ``renamed`` (``migrated`` before the stop) and ``not_renamed`` (sources left under their old names:
        the one hit (its copy may have landed, or its delete) and every one after it).
        ``stopped_throttled``: None, or (a request was still answered "slow down" after ``throttle_attempts`` tries:
        the run stopped there) a dict: ``url``, ``error`` (the store's last answer), ``phase`` (``list``: the listing,
        ``legacy_objects`` then counts those listed before it; ``check``: the header checks, nothing written yet;
        ``rename``), ``at`` (the old name it was at; None in ``list``), ``attempts``, ``renamed`` (``migrated``
        before the stop) and ``not_renamed`` (sources it would still have renamed: the one it was at (in ``rename``
        its copy may have landed) and every one after it; None in ``list``: not all were listed). ``throttled``:
        "slow down" answers to the run's object requests (each retried after a backoff, or the last one, which
        stopped it; the listing's pages are retried by :meth:`~.store.ObjectStore.list_patient`, uncounted).
    Raises:
        ValueError before anything is written when neither or both of ``keyring`` / ``unkeyed`` are given,
        ``dir_fanout`` does not match the old names, an encrypted object is found without ``keyring``, a
        plaintext one with ``keyring`` and ``encrypted`` None, or ``encrypted`` is True with ``unkeyed``;
        StoreUnavailable when the store is down before the run's first write (nothing written); ValueError when
        ``throttle_attempts`` < 1.
    """
    if not 1 <= dir_fanout <= 4096:
        raise ValueError(f"--dir-fanout: must be in [1, 4096] (got {dir_fanout})")
    if (keyring is None) == (not unkeyed):
        raise ValueError("--keyring: give the workers' keyring, or --unkeyed when they have none (not both): "
                         "names are keyed by it, even in an unencrypted pool")
    if unkeyed and encrypted:
        raise ValueError("--encrypted: an encrypted pool has a keyring: give it with --keyring, not --unkeyed")
    if throttle_attempts < 1:
        raise ValueError(f"--throttle-attempts: must be >= 1 (got {throttle_attempts})")
    throttled = 0  # "slow down" answers to the run's object requests

    def patient(fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` (one store request), sent again after a backoff while throttled: ``throttle_attempts``
        tries; then the last StoreThrottled is raised."""
        tries = 0

        def met() -> None:
            nonlocal throttled, tries
            throttled += 1
            tries += 1
        return call_throttled(lambda: fn(*args), float("inf"), met, lambda: tries >= throttle_attempts)
    legacy = []
    unlisted: list[str] = []  # parts of the store not listed (errors, named)
    try:
        for o in listing(store.list_patient("", throttle_attempts), unlisted):
            meta = parse_block_name(o.name, nested=True)  # renamed in place: under its own prefix
            if meta is not None and meta["legacy"]:
                legacy.append((o, meta))
    except StoreThrottled as e:  # nothing examined: say so, no refusal (exit 5, as a stop later in the run)
        res = _report(store, dry_run, legacy, unlisted, 0)
        res["stopped_throttled"] = _throttle_stop(store, e, "list", None, throttle_attempts, 0, None)
        return res
    w = fanout_width(dir_fanout)
    for o, meta in legacy:
        if meta["fan"] != f"{meta['seq_hash'] % dir_fanout:0{w}x}":
            raise ValueError(f"--dir-fanout {dir_fanout}: {o.name} was written with another g4.dir_fanout "
                             "(give the workers' value)")
    res = _report(store, dry_run, legacy, unlisted, throttled)
    known: set[str] | None = None
    revoked: set[str] = set()
    if keyring is not None:
        revoked = set(keyring.revoked())
        known = {r["pseudonym"] for r in keyring.info()}
    todo: list[tuple[Any, dict[str, Any], int]] = []  # (listed object, its name parsed, bytes to read)
    for j, (o, meta) in enumerate(legacy):  # pass 1: headers only; refusals happen here
        ps = meta["tenant"]
        if known is not None and ps not in known:
            res["skipped_revoked" if ps in revoked else "skipped_unknown_tenant"] += 1
            continue
        try:
            head = patient(store.get, o.name, 0, HEADER_BYTES)
        except StoreUnavailable:
            raise
        except StoreThrottled as e:  # nothing written yet: this one and the rest (checked or not) stay
            res["throttled"] = throttled
            res["stopped_throttled"] = _throttle_stop(store, e, "check", o.name, throttle_attempts, 0,
                                                      len(todo) + len(legacy) - j)
            return res
        except OSError:
            res["errors"] += 1
            continue
        if head is None:  # deleted meanwhile (gc, a reader dropping it)
            continue
        hdr = _matching_header(head, meta)
        if hdr is None:
            res["skipped_invalid"] += 1
            continue
        if keyring is None and hdr.flags & FLAG_ENCRYPTED:
            raise ValueError(f"--keyring: {o.name} is encrypted: its keyed name needs the workers' keyring")
        if keyring is not None and hdr.flags & FLAG_ENCRYPTED and not _key_of(keyring, hdr.key_id, ps):
            res["skipped_revoked"] += 1  # sealed under a revoked generation of a re-created tenant (module doc)
            continue
        if keyring is not None and not hdr.flags & FLAG_ENCRYPTED:
            if encrypted is None:
                raise ValueError(f"--encrypted / --plaintext: {o.name} is plaintext and the workers have a keyring: "
                                 "say whether they encrypt (g4.encrypt); an encrypted pool never serves a plaintext "
                                 "block (--encrypted leaves them for gc, --plaintext renames them)")
            if encrypted:
                res["skipped_plaintext"] += 1
                continue
        if hdr.stored_len > MAX_FRAME_PAYLOAD_BYTES:  # no KV block is near it: never read whole
            res["skipped_invalid"] += 1
            continue
        todo.append((o, meta, HEADER_BYTES + hdr.stored_len + 1))
    namers: dict[tuple[str, str], TenantNamer] = {}  # (namespace hex, tenant pseudonym hex)
    wrote = False  # a PUT or DELETE was sent: a StoreUnavailable from then on stops the run with the report
    for i, (o, meta, want) in enumerate(todo):  # pass 2: rename; reads ask for the frame its header names + 1 byte
        ps = meta["tenant"]
        namer = namers.get((meta["ns"], ps))
        if namer is None:
            pb = bytes.fromhex(ps)
            key = keyring.name_key(pb) if keyring is not None else derive_name_key(UNKEYED_PSEUDONYM_KEY, pb)
            namer = namers[(meta["ns"], ps)] = TenantNamer(meta["ns"], pb, key, dir_fanout)
        # the store's prefix above the namespace stays (a --url above the pool's root must not move blocks out)
        parts = o.name.split("/")
        new = "/".join(parts[:-5] + [namer.name(meta["rank"], meta["seq_hash"])])
        try:
            data = patient(store.get, o.name, 0, want)
            if data is None:
                continue
            hdr = _matching_header(memoryview(data)[:HEADER_BYTES], meta)
            if hdr is None:  # replaced since pass 1
                res["skipped_invalid"] += 1
                continue
            why = _unverified(hdr, data, keyring)  # never publish (and delete the source) unverified bytes
            if why == "revoked":  # its data key went since pass 1
                res["skipped_revoked"] += 1
                continue
            if why is not None:  # the store holds these very bytes: damaged, left for gc; else a bad read: error.
                # An object listed longer than its frame, read past it, is one too: an S3 HEAD compares the whole
                # object (length and MD5), never a prefix, so asking it counted an error on every run (2026-12-02)
                grown = o.size > HEADER_BYTES + hdr.stored_len and len(data) > HEADER_BYTES + hdr.stored_len
                res["skipped_invalid" if grown or patient(store.stored_matches, o.name, data, o.size)
                    else "errors"] += 1
                continue
            if dry_run:  # what the run would do, writing and deleting nothing
                there = patient(store.get, new, 0, want)
                res["migrated" if there is None else
                    "already_present" if _serves(there, meta, keyring, encrypted) else "kept_name_taken"] += 1
                continue
            wrote = True
            created = patient(store.put_if_absent, new, data)
            if not created and not _serves(patient(store.get, new, 0, want), meta, keyring, encrypted):
                res["kept_name_taken"] += 1  # the old object stays: the only good copy (module doc)
                continue
            # only the very bytes read; else (an ETag that is no MD5) only the very object listed: module doc
            if not patient(store.delete_if_matches, o.name, data, len(data)) and not (
                    o.version is not None and patient(store.delete_if_listed, o)):
                res["changed_since_read"] += 1
        except StoreUnavailable as e:
            if not wrote:  # nothing written yet: a refused run (exit 2)
                raise
            res["stopped_unavailable"] = {"url": store.url, "error": str(e), "at": o.name,
                                          "renamed": res["migrated"], "not_renamed": len(todo) - i}
            break
        except StoreFull as e:  # no room: every later write is refused too; this source and the rest stay
            res["stopped_full"] = _full_stop(store, e, len(todo) - i)
            break
        except StoreThrottled as e:  # still "slow down" after the backoffs: stop sending; this source and the rest stay
            res["stopped_throttled"] = _throttle_stop(store, e, "rename", o.name, throttle_attempts, res["migrated"],
                                                      len(todo) - i)
            break
        except OSError:
            res["errors"] += 1
            continue
        res["migrated" if created else "already_present"] += 1
    res["throttled"] = throttled
    return res


def _report(store: ObjectStore, dry_run: bool, legacy: list[Any], unlisted: list[str],
            throttled: int) -> dict[str, Any]:
    """:func:`run_migrate`'s report before its passes: every count 0 but ``legacy_objects`` and ``errors``."""
    return {"dry_run": dry_run, "url": store.url, "legacy_objects": len(legacy), "migrated": 0, "already_present": 0,
            "skipped_invalid": 0, "skipped_revoked": 0, "skipped_unknown_tenant": 0, "skipped_plaintext": 0,
            "kept_name_taken": 0, "changed_since_read": 0, "errors": len(unlisted), "unlisted": unlisted,
            "stopped_full": None, "stopped_unavailable": None, "stopped_throttled": None, "throttled": throttled}


def _throttle_stop(store: ObjectStore, e: StoreThrottled, phase: str, at: str | None, attempts: int, renamed: int,
                   not_renamed: int | None) -> dict[str, Any]:
    """``stopped_throttled`` of :func:`run_migrate`'s report: the store still throttled after ``attempts`` tries."""
    return {"url": store.url, "error": str(e), "phase": phase, "at": at, "attempts": attempts, "renamed": renamed,
            "not_renamed": not_renamed}


def _full_stop(store: ObjectStore, e: StoreFull, not_renamed: int) -> dict[str, Any]:
    """``stopped_full`` of :func:`run_migrate`'s report for the refusal ``e`` of ``store``."""
    return {"url": store.url, "mount": e.mount, "errno": errno.errorcode.get(e.errno or 0, str(e.errno)),
            "reason": FULL_REASONS.get(e.errno or 0, "refuses writes"), "error": str(e), "not_renamed": not_renamed}


def _serves(data: Any, meta: dict[str, Any], keyring: "Keyring | None", encrypted: bool | None) -> bool:
    """Whether ``data`` (the object found under a block's keyed name; None: gone since) is a copy of the block
    ``meta`` names that the workers serve: its header names that block, its payload verifies under a key the
    keyring holds (:func:`_unverified`), and it is sealed where the workers encrypt. With a keyring and ``encrypted``
    None (the run was not told ``g4.encrypt``: its sources were all sealed) a plaintext copy is not known to be served:
    an encrypting worker refuses it, so it never stands in for a sealed source (before 2026-12-02 it did, and the only
    copy those workers serve was deleted)."""
    if data is None:
        return False
    hdr = _matching_header(memoryview(data)[:HEADER_BYTES], meta)
    if hdr is None or _unverified(hdr, data, keyring) is not None:
        return False
    plaintext_refused = encrypted or (encrypted is None and keyring is not None)
    return not (plaintext_refused and not hdr.flags & FLAG_ENCRYPTED)


def _unverified(hdr: FrameHeader, data: Any, keyring: "Keyring | None") -> str | None:
    """None when ``data`` (an object read up to the frame its header names and a byte more) is exactly the frame
    ``hdr`` describes and its payload verifies (the GCM tag under the data key the keyring holds for it, or a
    plaintext frame's xxh3); ``"revoked"`` when the keyring no longer holds that key (or holds other key material
    under its id); ``"invalid"`` otherwise (a wrong length, a tag or checksum that fails)."""
    mv = memoryview(data).cast("B")
    if len(mv) != HEADER_BYTES + hdr.stored_len or hdr.stored_len != hdr.payload_len:
        return "invalid"
    payload = mv[HEADER_BYTES:]
    if hdr.flags & FLAG_ENCRYPTED:
        dkey = keyring.read_key(hdr.key_id, hdr.key_version) if keyring is not None else None
        if dkey is None or key_check_differs(hdr.key_check, dkey):
            return "revoked"
        try:
            open_into(dkey, hdr.nonce, hdr.identity_bytes(), hdr.integrity, payload, bytearray(len(payload)))
        except (AeadError, ValueError):
            return "invalid"
        return None
    return None if hdr.flags & FLAG_CHECKSUM and payload_checksum(payload) == hdr.integrity else "invalid"


def _key_of(keyring: "Keyring", key_id: int, pseudonym_hex: str) -> bool:
    """Whether data key ``key_id`` belongs to the tenant whose pseudonym is ``pseudonym_hex`` now."""
    owner = keyring.key_owner(key_id)
    return owner is not None and keyring.pseudonym(owner).hex() == pseudonym_hex


def _matching_header(head: Any, meta: dict[str, Any]) -> FrameHeader | None:
    """The frame header in ``head`` (its first HEADER_BYTES bytes) if it names the block ``meta`` (from the
    object's name) names, else None."""
    try:
        hdr = FrameHeader.unpack(memoryview(head)[:HEADER_BYTES])
    except FrameError:
        return None
    if (hdr.ns_fp.hex() != meta["ns"] or hdr.tenant_tag.hex() != meta["tenant"] or hdr.rank != meta["rank"]
            or hdr.seq_hash != meta["seq_hash"]):
        return None
    return hdr
