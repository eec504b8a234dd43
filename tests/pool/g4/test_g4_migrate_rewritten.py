"""``kvbm-backend g4 migrate`` deletes a format 1 object only while its name still holds the bytes it read, verified
and published under the keyed name (2026-12-03). Before, it deleted the old name by name: when the object was
rewritten between the read and the delete (a worker of the old version, in a rolling upgrade, writing the block
again under its old name after gc or a load dropped it), the new object went unread. Now the delete is conditional
(``ObjectStore.delete_if_matches``: S3 ``If-Match`` the MD5 ETag of the bytes read, a file store a quarantine rename
and a re-read): the rewritten object stays, counted ``changed_since_read``, and the next run deals with it.

The interleaving is made deterministic by a real store (file, SeaweedFS S3) whose first delete of a source name
first runs the other processes' real operations: one deletes the object, the old-version worker writes the block
again create-exclusive (a fresh sealing: other bytes). No sleeps."""
from __future__ import annotations

import pytest

from kvbm_backend.config import G4Config
from kvbm_backend.crypto.keyring import Keyring
from kvbm_backend.pool.g4.migrate import run_migrate
from kvbm_backend.pool.g4.naming import parse_block_name
from kvbm_backend.pool.g4.pool import G4Pool
from tests.helpers.g4_writer import namespace, put_blocks, read_checked
from tests.helpers.pools import G4_TIMEOUT_S
from tests.helpers.race_store import race_store

FANOUT = 16
SEQ = 9300


@pytest.fixture(params=["file", "s3"])
def setup(request, tmp_path):
    """``(pool config, racing store, old name, first sealing, second sealing)``: block ``SEQ`` of tenant alice,
    encrypted, under its format 1 name (the first sealing); the second is the same block sealed again (another
    nonce), what the old-version worker writes."""
    kr = str(tmp_path / "kr.json")
    if request.param == "file":
        cfg = G4Config(url=f"file://{tmp_path / 'g4'}", keyring={"path": kr}, dir_fanout=FANOUT, timeout_s=G4_TIMEOUT_S)
    else:
        sw, prefix = request.getfixturevalue("seaweed"), request.getfixturevalue("s3_prefix")
        cfg = G4Config(url=sw.url(prefix), endpoint_url=sw.endpoint, keyring={"path": kr}, dir_fanout=FANOUT,
                       timeout_s=30.0)
    ns = namespace()
    k = ns.key(SEQ, tenant="alice")
    sealings = []
    with G4Pool(cfg, ns) as p:
        for _ in range(2):
            assert put_blocks(p, [SEQ], "alice").written == 1
            sealings.append(bytes(p.store.get(p.object_name(k))))
            p.store.delete(p.object_name(k))
        old_name = p.legacy_object_name(k)
        p.store.put(old_name, sealings[0])
    assert sealings[0] != sealings[1]
    st = race_store(request, tmp_path)
    try:
        yield cfg, st, old_name, sealings[0], sealings[1]
    finally:
        st.close()


def _legacy(st) -> list[str]:
    return [o.name for o in st.list("") if (parse_block_name(o.name) or {}).get("legacy")]


def test_a_source_rewritten_between_read_and_delete_is_kept_for_the_next_run(setup):
    cfg, st, old_name, first, second = setup
    kr = Keyring.from_config(cfg.keyring, create=False)
    st.target, st.rewrite = old_name, second
    res = run_migrate(st, keyring=kr, dir_fanout=FANOUT, encrypted=True)
    assert st.raced == 1
    assert bytes(st.get(old_name) or b"") == second, res  # the rewritten object, never read, stays
    assert (res["migrated"], res.get("changed_since_read"), res["errors"]) == (1, 1, 0), res
    with G4Pool(cfg, namespace()) as p:
        assert bytes(p.store.get(p.object_name(namespace().key(SEQ, tenant="alice")))) == first
        assert read_checked(p, [SEQ], "alice") == [True]
    res = run_migrate(st, keyring=kr, dir_fanout=FANOUT, encrypted=True)  # the next run: a served copy is there
    assert (res["already_present"], res["changed_since_read"], res["errors"]) == (1, 0, 0), res
    assert _legacy(st) == []
