"""``kvbm-backend g4 migrate --dry-run`` stopped by a store still throttling (``stopped_throttled``, exit 5) in its
rename phase (the dry run's look at the new name) says it wrote nothing (2026-12-03). Before, the error line was a real
run's: "(the one it stopped at may have its copy under the new name already)", and docs/cli.md said nothing was
written only "in ``list`` and ``check``", though a dry run writes and deletes nothing in any phase.

A real file store whose reads of keyed (new) names are answered "slow down" (a documented store subclass: the only way
to throttle exactly the dry run's look at the new name without an S3 proxy), the real run_migrate and the CLI's real
report function."""
from __future__ import annotations

import pytest
import typer

from kvbm_backend.apps.g4_cli import EXIT_STORE_THROTTLED, _report
from kvbm_backend.config import G4Config
from kvbm_backend.crypto.keyring import Keyring
from kvbm_backend.pool.g4.fs_store import FsStore
from kvbm_backend.pool.g4.migrate import run_migrate
from kvbm_backend.pool.g4.naming import parse_block_name
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.pool.g4.store import StoreThrottled
from tests.helpers.g4_writer import namespace, put_blocks

FANOUT = 16
SEQ = 9400


class _ThrottlesKeyedReads(FsStore):
    """Every read of a keyed (new) name is answered "slow down": the dry run's look at the new name."""

    def get(self, name, offset=0, length=None):
        meta = parse_block_name(name)
        if meta is not None and not meta["legacy"]:
            raise StoreThrottled(f"slow down: {name}")
        return super().get(name, offset, length)


def test_a_dry_run_stopped_throttled_in_rename_says_it_wrote_nothing(tmp_path, capfd):
    kr = str(tmp_path / "kr.json")
    cfg = G4Config(url=f"file://{tmp_path / 'g4'}", keyring={"path": kr}, dir_fanout=FANOUT)
    ns = namespace()
    k = ns.key(SEQ, tenant="alice")
    with G4Pool(cfg, ns) as p:
        assert put_blocks(p, [SEQ], "alice").written == 1
        sealed = bytes(p.store.get(p.object_name(k)))
        p.store.delete(p.object_name(k))
        p.store.put(p.legacy_object_name(k), sealed)
    st = _ThrottlesKeyedReads(tmp_path / "g4", fsync=False)
    res = run_migrate(st, keyring=Keyring.from_config(cfg.keyring, create=False), dir_fanout=FANOUT,
                      encrypted=True, dry_run=True, throttle_attempts=1)
    assert res["dry_run"] and res["stopped_throttled"] and res["stopped_throttled"]["phase"] == "rename", res
    capfd.readouterr()
    with pytest.raises(typer.Exit) as ex:
        _report(res, True, "g4 migrate")
    assert ex.value.exit_code == EXIT_STORE_THROTTLED
    err = capfd.readouterr().err
    # a dry run writes nothing: no copy can be "under the new name already"
    assert "may have its copy under the new name" not in err, err
    assert "a dry run: nothing written" in err and "1 from it on not checked" in err, err
    plain = FsStore(tmp_path / "g4", fsync=False)
    assert plain.get(p.legacy_object_name(k)) is not None and plain.get(p.object_name(k)) is None  # nothing moved
