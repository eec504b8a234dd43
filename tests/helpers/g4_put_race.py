"""Real G4 stores (file, SeaweedFS S3) whose create-exclusive PUTs of a chosen name race another writer and a
deleter, in the order of the race and with no sleeps (tests/pool/g4/test_g4_put_gone_race.py: a copy gone before
the writer's check; test_g4_settle_gone_race.py: a late settle, ``namespace.json``). A file store never leaves a PUT
unsettled: :class:`RaceFs` raises PutUnsettled after the real PUT and settles by the MD5 of the file, as an S3 store
does by the ETag."""
from __future__ import annotations

import hashlib
import os
import sys
import threading

import numpy as np

from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.pool.g4.s3_obstore import ObstoreS3Store
from kvbm_backend.pool.g4.store import PutUnsettled
from tests.helpers.g4_writer import namespace, payload

HANG_S = 600.0  # a hang guard only
#: ``kvbm_backend.pool.g4.writer.SETTLE_BOUNDS`` of a test whose late settle must come before the settle bound but whose
#: subject is not that bound (:func:`wide_settle_bound`): 40 PUT bounds, 80 s at ``timeout_s`` 2 (the product's 4:
#: 8 s), while the first check stays due a quarter of a PUT bound after the PUT (0.5 s). The republish must start with
#: a PUT's bound left, so a check may now run 77.5 s late (was 5.5 s: the busy CI VM froze threads for 13-31 s,
#: 2026-11-29); a test that waits for the bound keeps the product's.
WIDE_SETTLE_BOUNDS = 40
NS = namespace()
BPB = NS.layout.bytes_per_block
B_COPY = b"worker B's copy" * 64


class TakenThenGone:
    """A store mixin: store operations on ``target``, in the order of the race (each kind counted down, each race
    in ``raced``):

    * ``unsettled``: B publishes its copy, this pool's real PUT meets it (False), and its answer is lost
      (raises PutUnsettled with the MD5 of the bytes sent);
    * ``lost_answers``: this pool's real PUT lands (True), its answer is lost (PutUnsettled);
    * ``gone``: B publishes its copy, this pool's PUT meets it, a deleter removes it right after the answer
      (before the writer's check);
    * ``delete_at_settle``: a settle that found other bytes under ``target`` has them deleted right after it."""

    target: str | None = None
    unsettled = lost_answers = gone = delete_at_settle = 0
    raced = 0

    def put_if_absent(self, name, data):
        if name != self.target or not (self.unsettled or self.lost_answers or self.gone):
            return super().put_if_absent(name, data)  # type: ignore[misc]
        self.raced += 1
        if self.lost_answers and not self.unsettled:
            self.lost_answers -= 1
            assert super().put_if_absent(name, data)  # type: ignore[misc]  # landed; the answer never came
            raise PutUnsettled("no answer (test)", name, hashlib.md5(bytes(data)).hexdigest())
        assert super().put_if_absent(name, B_COPY)  # type: ignore[misc]  # worker B publishes first
        created = super().put_if_absent(name, data)  # type: ignore[misc]  # this pool's PUT: the name is taken
        if self.unsettled:
            self.unsettled -= 1
            raise PutUnsettled("no answer (test)", name, hashlib.md5(bytes(data)).hexdigest())
        self.gone -= 1
        self.delete(name)  # type: ignore[attr-defined]  # gc, or another worker's load dropping it
        return created

    def settle(self, name, md5_hex):
        landed = super().settle(name, md5_hex)  # type: ignore[misc]
        if landed is False and name == self.target and self.delete_at_settle:
            self.delete_at_settle -= 1
            self.delete(name)  # type: ignore[attr-defined]  # the deleter, before the writer's header GET
        return landed


class FsSettles(FsStore):
    """A file store that settles as an S3 store does (the MD5 of what the name holds against the PUT's)."""

    def settle(self, name, md5_hex):
        body = self.get(name)
        return None if body is None else hashlib.md5(bytes(body)).hexdigest() == md5_hex


class RaceFs(TakenThenGone, FsSettles):
    pass


class RaceS3(TakenThenGone, ObstoreS3Store):
    pass


def wide_settle_bound(monkeypatch) -> None:
    """Pools opened from now on in this test settle within :data:`WIDE_SETTLE_BOUNDS` PUT bounds (restored after it)."""
    from kvbm_backend.pool.g4 import writer
    monkeypatch.setattr(writer, "SETTLE_BOUNDS", WIDE_SETTLE_BOUNDS)


def racing(request, tmp_path, **g4):
    """Generator for a fixture: yields ``(store, G4Config kwargs)`` of a :class:`TakenThenGone` store of kind
    ``request.param`` (``"file"``: ``tmp_path / "g4"``, no fsync; ``"s3"``: the ``seaweed`` fixture's bucket under
    the ``s3_prefix`` fixture's prefix, store timeout 30 s, closed after the test). ``g4``: more G4Config kwargs
    (``timeout_s``, ``retries``); the keyring is ``tmp_path / "keys" / "kr.json"``."""
    kr = {"keyring": {"path": str(tmp_path / "keys" / "kr.json")}, **g4}
    if request.param == "file":
        yield RaceFs(tmp_path / "g4", fsync=False), {"url": f"file://{tmp_path / 'g4'}", "fsync": False, **kr}
        return
    sw, prefix = request.getfixturevalue("seaweed"), request.getfixturevalue("s3_prefix")
    st = RaceS3(sw.bucket, prefix, endpoint_url=sw.endpoint, timeout_s=30.0)
    yield st, {"url": sw.url(prefix), "endpoint_url": sw.endpoint, **kr}
    st.close()


def read_hit(p: G4Pool, seq: int) -> bool:
    """Get block ``seq`` of tenant ``t`` from ``p``: whether it was served (hang guard :data:`HANG_S` s),
    asserting a block served holds its :func:`~tests.helpers.g4_writer.payload`."""
    out = [np.full(BPB, 0xEE, np.uint8)]
    ok = p.get(NS.keys([seq], tenant="t"), out).result(timeout=HANG_S).ok[0]
    assert not ok or np.array_equal(out[0], payload(seq, "t", BPB)), "a hit with wrong bytes"
    return ok


def waits_in_settler_close(t: threading.Thread) -> bool:
    """Whether ``t`` is blocked in a condition wait inside ``LateSettler.close``."""
    f = sys._current_frames().get(t.ident or -1)
    frames = []
    while f is not None:
        frames.append((f.f_code.co_name, os.path.basename(f.f_code.co_filename)))
        f = f.f_back
    return bool(frames) and frames[0] == ("wait", "threading.py") and ("close", "settle.py") in frames
