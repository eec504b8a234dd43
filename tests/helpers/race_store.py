"""Real G4 stores (file, SeaweedFS S3) on which a chosen object is deleted and written again right before a delete
of it runs: the race between a delete by name and another process's write made deterministic, with no sleeps
(tests/pool/g4/test_g4_gc_race.py: gc's conditional delete; test_g4_migrate_rewritten.py: migrate's)."""
from __future__ import annotations

from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.s3_store import S3Store
from kvbm_backend.pool.g4.store import ObjectInfo


class RewrittenBeforeDelete:
    """A store mixin: right before the first delete of ``target`` (``delete``, ``delete_if_listed`` or
    ``delete_if_matches``), another process deletes the object and another writes ``rewrite`` under its name
    create-exclusive (real store operations, in the order of the race): once, counted in ``raced``."""

    target: str | None = None
    rewrite: bytes = b""
    raced = 0

    def _race(self, name: str) -> None:
        if name == self.target:
            self.target = None
            super().delete(name)  # type: ignore[misc]  # gc, or a load dropping it
            assert self.put_if_absent(name, self.rewrite)  # type: ignore[attr-defined]  # the other writer
            self.raced += 1

    def delete(self, name: str) -> None:  # the unconditional delete (gc before 2026-12-01, migrate before 12-03)
        self._race(name)
        super().delete(name)  # type: ignore[misc]

    def delete_if_listed(self, info: ObjectInfo) -> bool:
        self._race(info.name)
        return super().delete_if_listed(info)  # type: ignore[misc,no-any-return]

    def delete_if_matches(self, name: str, data, size: int) -> bool:
        self._race(name)
        return super().delete_if_matches(name, data, size)  # type: ignore[misc,no-any-return]


class RaceFs(RewrittenBeforeDelete, FsStore):
    pass


class RaceS3(RewrittenBeforeDelete, S3Store):
    pass


def race_store(request, tmp_path) -> RaceFs | RaceS3:
    """A :class:`RewrittenBeforeDelete` store of kind ``request.param`` (``"file"``: ``tmp_path / "g4"``, no fsync;
    ``"s3"``: the ``seaweed`` fixture's bucket under the ``s3_prefix`` fixture's prefix, 30 s timeout). Close it."""
    if request.param == "file":
        return RaceFs(tmp_path / "g4", fsync=False)
    sw, prefix = request.getfixturevalue("seaweed"), request.getfixturevalue("s3_prefix")
    return RaceS3(sw.bucket, prefix, endpoint_url=sw.endpoint, timeout_s=30.0)
