"""``kvbm-backend g4 migrate`` on an S3 bucket whose ETags are not the MD5 of the bytes (2026-12-03).

Since 2026-12-03 migrate deletes a source only while its name holds the very bytes it read
(``ObjectStore.delete_if_matches``: S3 ``If-Match`` the MD5 of those bytes). Where the ETag is no MD5 (SSE-KMS or
SSE-C encryption, multipart uploads: ``"<md5 of the parts' md5s>-<n>"``) that DELETE got 412 every time: every source
stayed, counted ``changed_since_read``, on every run (the migration never completed, the old objects doubled the
store). Now such a delete falls back to one conditional on the ETag the listing gave
(``ObjectStore.delete_if_listed``), which still keeps an object written under the old name after the listing.

A real SeaweedFS server; the format 1 objects are uploaded multipart (one part, with boto3, as a copy tool does), so
their ETags are ``"...-1"``. The rewrite race runs the other processes' real operations right before migrate's first
delete (as ``test_g4_migrate_rewritten.py``). No sleeps."""
from __future__ import annotations

import boto3

from kvbm_backend.config import G4Config
from kvbm_backend.crypto.keyring import Keyring
from kvbm_backend.pool.g4.migrate import run_migrate
from kvbm_backend.pool.g4.naming import parse_block_name
from kvbm_backend.pool.g4.pool import G4Pool
from kvbm_backend.pool.g4.s3_store import S3Store
from tests.helpers.g4_writer import namespace, put_blocks, read_checked

FANOUT = 16
SEQS = [9500, 9501, 9502]


class _RewrittenBeforeDelete(S3Store):
    """An S3 store where, right before migrate's first conditional delete of ``target``, another process deletes the
    object and an old-version worker writes ``rewrite`` under the name create-exclusive (single-part: an MD5 ETag)."""

    target: str | None = None
    rewrite: bytes = b""

    def delete_if_matches(self, name, data, size):
        if name == self.target:
            self.target = None
            self.delete(name)
            assert self.put_if_absent(name, self.rewrite)
        return super().delete_if_matches(name, data, size)


def _put_multipart(sw, key: str, data: bytes) -> str:
    """Upload ``data`` to ``key`` of the SeaweedFS bucket as a one-part multipart upload; returns its ETag."""
    c = boto3.client("s3", endpoint_url=sw.endpoint, region_name="us-east-1")
    up = c.create_multipart_upload(Bucket=sw.bucket, Key=key)["UploadId"]
    part = c.upload_part(Bucket=sw.bucket, Key=key, UploadId=up, PartNumber=1, Body=data)
    c.complete_multipart_upload(Bucket=sw.bucket, Key=key, UploadId=up,
                                MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]})
    return str(c.head_object(Bucket=sw.bucket, Key=key)["ETag"])


def _setup(seaweed, prefix, tmp_path):
    """``(config, keyring, {seq: (old name, first sealing, second sealing)})``: blocks ``SEQS`` of tenant alice,
    encrypted, uploaded multipart under their format 1 names (the first sealing); the second is the same block sealed
    again (another nonce)."""
    cfg = G4Config(url=seaweed.url(prefix), endpoint_url=seaweed.endpoint, keyring={"path": str(tmp_path / "kr.json")},
                   dir_fanout=FANOUT, timeout_s=30.0)
    ns = namespace()
    blocks = {}
    with G4Pool(cfg, ns) as p:
        for seq in SEQS:
            k = ns.key(seq, tenant="alice")
            sealings = []
            for _ in range(2):
                assert put_blocks(p, [seq], "alice").written == 1
                sealings.append(bytes(p.store.get(p.object_name(k))))
                p.store.delete(p.object_name(k))
            old = p.legacy_object_name(k)
            etag = _put_multipart(seaweed, f"{prefix}/{old}", sealings[0])
            assert etag.strip('"').endswith("-1"), etag  # not the MD5 of the bytes
            blocks[seq] = (old, sealings[0], sealings[1])
    return cfg, Keyring.from_config(cfg.keyring, create=False), blocks


def _legacy(st) -> list[str]:
    return sorted(o.name for o in st.list("") if (parse_block_name(o.name) or {}).get("legacy"))


def test_sources_whose_etag_is_no_md5_are_deleted_once_renamed(seaweed, s3_prefix, tmp_path):
    cfg, kr, blocks = _setup(seaweed, s3_prefix, tmp_path)
    st = S3Store(seaweed.bucket, s3_prefix, endpoint_url=seaweed.endpoint, timeout_s=30.0)
    try:
        res = run_migrate(st, keyring=kr, dir_fanout=FANOUT, encrypted=True)
        assert (res["migrated"], res["changed_since_read"], res["errors"]) == (3, 0, 0), res
        assert _legacy(st) == []  # before: all 3 stayed, on every run
    finally:
        st.close()
    with G4Pool(cfg, namespace()) as p:
        for seq, (_old, first, _second) in blocks.items():
            assert bytes(p.store.get(p.object_name(namespace().key(seq, tenant="alice")))) == first
        assert read_checked(p, SEQS, "alice") == [True] * 3


def test_a_multipart_source_rewritten_after_the_listing_is_still_kept(seaweed, s3_prefix, tmp_path):
    """The fallback delete is conditional on the listed ETag: the old-version worker's rewrite (a new ETag) stays."""
    cfg, kr, blocks = _setup(seaweed, s3_prefix, tmp_path)
    old, first, second = blocks[SEQS[0]]
    st = _RewrittenBeforeDelete(seaweed.bucket, s3_prefix, endpoint_url=seaweed.endpoint, timeout_s=30.0)
    try:
        st.target, st.rewrite = old, second
        res = run_migrate(st, keyring=kr, dir_fanout=FANOUT, encrypted=True)
        assert st.target is None  # raced
        assert (res["migrated"], res["changed_since_read"], res["errors"]) == (3, 1, 0), res
        assert bytes(st.get(old) or b"") == second, res  # the rewrite, never read, stays
        assert _legacy(st) == [old]
        res = run_migrate(st, keyring=kr, dir_fanout=FANOUT, encrypted=True)  # the next run: a served copy is there
        assert (res["already_present"], res["changed_since_read"], res["errors"]) == (1, 0, 0), res
        assert _legacy(st) == []
    finally:
        st.close()
    with G4Pool(cfg, namespace()) as p:
        assert bytes(p.store.get(p.object_name(namespace().key(SEQS[0], tenant="alice")))) == first
        assert read_checked(p, SEQS, "alice") == [True] * 3
