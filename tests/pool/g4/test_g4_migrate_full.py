"""``kvbm-backend g4 migrate`` on a ``file://`` store that refuses writes for room (2026-12-03). Before, each refused
write (ENOSPC, EDQUOT, EROFS: :class:`~kvbm_backend.pool.g4.store.StoreFull`) was counted as an error and the run went
on through every remaining object: on a full mount, one failing write per object, exit 1, nothing renamed. Now the
run stops at the first refused write (exit 3, ``stopped_full`` naming the store, its mount and the reason), every
object not renamed is left where it was, byte for byte, and a run after room is made renames the rest.

Real full filesystems: a small tmpfs mounted for the test (root needed; skipped with the reason otherwise), filled
with a plain file, remounted read-only, or out of inodes; the real CLI (the library call where the CLI refuses the
store before it starts: read-only)."""
from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest
from typer.testing import CliRunner

from kvbm_backend.apps.cli import app
from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.factory import open_store
from kvbm_backend.pool.g4.migrate import run_migrate
from kvbm_backend.pool.g4.naming import parse_block_name
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from tests.helpers.pools import G4_TIMEOUT_S
from tests.helpers.tmpfs import fill_filesystem, mounted_tmpfs

N = 30  # blocks under format 1 names
FANOUT = 256  # the keyed names' fan-out directories mostly differ from the old names': renames need new ones


def _cli(*args):
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def _legacy_store(tmp_path, mnt) -> tuple[str, dict[str, bytes]]:
    """Write ``N`` plaintext blocks (no keyring) with a pool on ``tmp_path / "src"`` and copy each under its format 1
    name into a store at ``mnt / "g4"``: ``(that store's URL, {old name: bytes})``."""
    ns, seqs = namespace(), list(range(N))
    with G4Pool(G4Config(url=f"file://{tmp_path / 'src'}", encrypt=False, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S),
                ns) as p:
        assert put_blocks(p, seqs, "alice").written == N
        objs = {p.legacy_object_name(k): bytes(p.store.get(p.object_name(k))) for k in ns.keys(seqs, tenant="alice")}
    url = f"file://{mnt / 'g4'}"
    dst = open_store(url)
    for name, data in objs.items():
        dst.put(name, data)
    return url, objs


def _left(url: str, objs: dict[str, bytes]) -> list[str]:
    """The old names still in the store at ``url``, each checked to hold its bytes as written."""
    store = open_store(url)
    left = sorted(o.name for o in store.list("") if (parse_block_name(o.name) or {}).get("legacy"))
    for name in left:
        assert bytes(store.get(name)) == objs[name], f"{name}: source changed"
    return left


def _temps(root) -> list[str]:
    return [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".tmp")]



def _remount(mnt, mode: str) -> None:
    p = subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs {mode} here ({p.stderr.strip() or p.returncode})")


def _migrate(url):
    return _cli("g4", "migrate", "--url", url, "--unkeyed", "--dir-fanout", str(FANOUT), "--json")


def _readable(url) -> list[bool]:
    with G4Pool(G4Config(url=url, encrypt=False, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S), namespace()) as p:
        return read_checked(p, list(range(N)), "alice")


def test_migrate_into_a_full_store_stops_at_once_and_keeps_every_source(tmp_path):
    """A mount with no room left (ENOSPC). Old code: exit 1 with ``errors`` 30 (each of the 30 writes tried and
    refused). Now: exit 3 at the first refused write, ``migrated`` 0, ``errors`` 0, ``stopped_full`` naming the store,
    the mount, the errno and the reason, one error line; all 30 sources as they were, no temp file left; once the
    filler is removed a run renames all 30."""
    with mounted_tmpfs(tmp_path / "mnt", "4M", "mode=0700") as mnt:
        url, objs = _legacy_store(tmp_path, mnt)
        fill_filesystem(mnt)
        code, out, err = _migrate(url)
        res = json.loads(out)
        assert code == 3, (code, out, err)
        assert (res["migrated"], res["errors"], res["legacy_objects"]) == (0, 0, N), out
        stop = res["stopped_full"]
        assert (stop["url"], stop["mount"], stop["errno"], stop["reason"], stop["not_renamed"]) == (
            url, str(mnt), "ENOSPC", "full", N), stop
        line = " ".join(err.split())
        assert f"{url} refuses writes: full (ENOSPC, mount {mnt})" in line, err
        assert "0 renamed before it" in line and f"{N} left under their old names" in line, err
        assert err.count("error:") == 1, err  # one line, not one per object
        assert _left(url, objs) == sorted(objs)  # every source where it was, byte for byte
        assert _temps(mnt / "g4") == []

        (mnt / "filler").unlink()
        code, out, err = _migrate(url)
        res = json.loads(out)
        assert code == 0 and (res["migrated"], res["errors"], res["stopped_full"]) == (N, 0, None), (out, err)
        assert _left(url, objs) == [] and _readable(url) == [True] * N


def test_migrate_on_a_read_only_store_stops_with_the_reason(tmp_path):
    """A mount read-only (EROFS). The CLI refuses such a store before reading it (exit 2: it checks the directory is
    writable); one remounted read-only after that check stops the run as a full one does (the library call, on the
    real store): old code counted ``errors`` 30; now ``stopped_full`` says ``read-only`` / ``EROFS`` and every source
    stays. Remounted read-write, a run renames all 30."""
    with mounted_tmpfs(tmp_path / "mnt", "4M", "mode=0700") as mnt:
        url, objs = _legacy_store(tmp_path, mnt)
        store = open_store(url)
        _remount(mnt, "ro")
        code, out, err = _migrate(url)
        assert code == 2 and "read-only" in err and out == "", (code, out, err)
        res = run_migrate(store, unkeyed=True, dir_fanout=FANOUT)
        assert (res["migrated"], res["errors"]) == (0, 0), res
        stop = res["stopped_full"]
        assert (stop["errno"], stop["reason"], stop["not_renamed"], stop["mount"]) == ("EROFS", "read-only", N,
                                                                                        str(mnt)), stop
        assert _left(url, objs) == sorted(objs)
        _remount(mnt, "rw")
        code, out, err = _migrate(url)
        assert code == 0 and json.loads(out)["migrated"] == N, (out, err)
        assert _left(url, objs) == [] and _readable(url) == [True] * N


def test_migrate_stopped_part_way_reports_what_it_renamed_and_a_rerun_finishes(tmp_path):
    """A mount that runs out of inodes part way (each keyed name's new fan-out directory takes one): the objects
    renamed before the refusal are counted and served under their keyed names, the rest stay under their old names
    untouched (``not_renamed``), and a run after inodes are freed renames exactly those. Old code: exit 1 and an
    error for every object after the refusal."""
    with mounted_tmpfs(tmp_path / "mnt", "4M", "mode=0700,nr_inodes=400") as mnt:
        url, objs = _legacy_store(tmp_path, mnt)
        spare = mnt / "spare"
        spare.mkdir()
        made = 0
        try:
            while True:  # take every inode left
                (spare / str(made)).touch()
                made += 1
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        for i in range(made - 6, made):  # leave room for a few new directories
            (spare / str(i)).unlink()

        code, out, err = _migrate(url)
        res = json.loads(out)
        stop = res.get("stopped_full")
        assert code == 3 and stop is not None and stop["errno"] == "ENOSPC", (code, out, err)
        assert 0 < res["migrated"] < N and res["errors"] == 0, out
        assert res["migrated"] + stop["not_renamed"] == N, out
        assert f"{res['migrated']} renamed before it, {stop['not_renamed']} left" in " ".join(err.split()), err
        assert len(_left(url, objs)) == stop["not_renamed"]
        assert _temps(mnt / "g4") == []
        assert sum(_readable(url)) == res["migrated"]

        for f in spare.iterdir():
            f.unlink()
        code, out, err = _migrate(url)
        rerun = json.loads(out)
        assert code == 0 and (rerun["migrated"], rerun["legacy_objects"]) == (stop["not_renamed"],) * 2, (out, err)
        assert _left(url, objs) == [] and _readable(url) == [True] * N
