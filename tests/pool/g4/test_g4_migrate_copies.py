"""``kvbm-backend g4 migrate`` never deletes the only copy the workers serve (review 2026-12-02, both reproduced
through the CLI): a plaintext copy under the keyed name does not stand in for an encrypted source when the run was
not told the workers' ``g4.encrypt``; and an S3 object grown past its frame is left for gc (``skipped_invalid``),
not an error that fails every run. Real file stores; real SeaweedFS."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from kvbm_backend.apps.cli import app
from kvbm_backend.config import G4Config
from kvbm_backend.pool.g4.naming import parse_block_name
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from tests.helpers.pools import G4_TIMEOUT_S

FANOUT = 16


def _cli(*args):
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.output


def _to_legacy(p, ns, s, tenant) -> tuple[str, bytes]:
    """Move block ``s``'s object to its format 1 name; ``(legacy name, bytes)``."""
    k = ns.key(s, tenant=tenant)
    data = bytes(p.store.get(p.object_name(k)))
    p.store.put(p.legacy_object_name(k), data)
    p.store.delete(p.object_name(k))
    return p.legacy_object_name(k), data


def _legacy(p) -> int:
    return sum(1 for o in p.store.list("") if (parse_block_name(o.name) or {}).get("legacy"))


def test_a_plaintext_copy_does_not_replace_the_encrypted_source_unless_told_the_workers_are_plaintext(tmp_path):
    """An encrypted format 1 source; under its keyed name a plaintext copy of the same block (a worker with
    ``g4.encrypt: false`` wrote it). Run with ``--keyring`` and neither ``--encrypted`` nor ``--plaintext`` (the
    source is encrypted, so migrate does not ask). Old code: ``already_present`` 1 and the encrypted source deleted;
    the encrypting workers never serve a plaintext block, so the block was gone for them. Now the source stays
    (``kept_name_taken``) and encrypting workers still load it once it is renamed over the plaintext copy's removal;
    with ``--plaintext`` the copy is one the workers serve, and the source goes."""
    ns = namespace()
    kr = str(tmp_path / "kr.json")
    enc = G4Config(url=f"file://{tmp_path / 'store'}", keyring={"path": kr}, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    plain = G4Config(url=enc.url, encrypt=False, keyring={"path": kr}, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    with G4Pool(enc, ns) as p:
        assert put_blocks(p, [9500], "alice").written == 1
        src, data = _to_legacy(p, ns, 9500, "alice")
    with G4Pool(plain, ns) as p:
        assert put_blocks(p, [9500], "alice").written == 1  # the plaintext copy at the keyed name
        copy = p.object_name(ns.key(9500, tenant="alice"))
    base = ["g4", "migrate", "--url", enc.url, "--keyring", kr, "--dir-fanout", str(FANOUT), "--json"]
    for dry in (["--dry-run"], []):
        code, out = _cli(*base, *dry)
        res = json.loads(out)
        assert (code, res["already_present"], res["kept_name_taken"], res["migrated"]) == (0, 0, 1, 0), out
    with G4Pool(enc, ns) as p:
        assert bytes(p.store.get(src)) == data  # the encrypted source kept
        assert read_checked(p, [9500], "alice") == [False]  # an encrypting worker refuses the plaintext copy
        p.store.delete(copy)
    code, out = _cli(*base)
    assert code == 0 and json.loads(out)["migrated"] == 1, out
    with G4Pool(enc, ns) as p:
        assert read_checked(p, [9500], "alice") == [True] and _legacy(p) == 0
    with G4Pool(plain, ns) as p:  # told the workers are plaintext: their copy serves, the source may go
        assert put_blocks(p, [9501], "alice").written == 1
    with G4Pool(enc, ns) as p:
        src2, _ = _to_legacy(p, ns, 9501, "alice")
    with G4Pool(plain, ns) as p:
        assert put_blocks(p, [9501], "alice").written == 1
    code, out = _cli(*base, "--plaintext")
    assert code == 0 and json.loads(out)["already_present"] == 1, out
    with G4Pool(plain, ns) as p:
        assert p.store.head(src2) is None and read_checked(p, [9501], "alice") == [True]


def test_an_s3_object_grown_past_its_frame_is_left_for_gc_not_an_error(seaweed, s3_prefix, tmp_path):
    """A format 1 object on S3 whose frame is followed by 4 KiB more (tampered, or a runaway writer), beside a good
    one. Old code: migrate read the frame and a byte, found it invalid, asked the store whether it holds those very
    bytes (an S3 HEAD compares the whole object's length and MD5: never for a prefix) and counted ``errors``: exit 1
    on every run, the object never left for gc. Now the object's listed size past its frame is the proof:
    ``skipped_invalid``, exit 0, the grown object left in place and the good one renamed."""
    ns = namespace()
    kr = str(tmp_path / "kr.json")
    cfg = G4Config(url=seaweed.url(s3_prefix), endpoint_url=seaweed.endpoint, keyring={"path": kr},
                   dir_fanout=FANOUT, timeout_s=10.0)
    with G4Pool(cfg, ns) as p:
        assert put_blocks(p, [9600, 9601], "alice").written == 2
        name, data = _to_legacy(p, ns, 9600, "alice")
        _to_legacy(p, ns, 9601, "alice")
        p.store.delete(name)
        p.store.put(name, data + bytes(4096))
    code, out = _cli("g4", "migrate", "--url", cfg.url, "--endpoint-url", seaweed.endpoint, "--keyring", kr,
                     "--dir-fanout", str(FANOUT), "--json")
    res = json.loads(out)
    assert (code, res["migrated"], res["skipped_invalid"], res["errors"]) == (0, 1, 1, 0), out
    with G4Pool(cfg, ns) as p:
        assert p.store.head(name) == len(data) + 4096  # left in place, for gc
        assert read_checked(p, [9601], "alice") == [True]
