"""The stored frame: a self-describing 4 KiB header, then the payload padded to 4 KiB.

The byte format is specified in ``docs/format.md`` (format version :data:`FORMAT_VERSION`); this
module is its only implementation. Readers reject unknown versions, bad magic, bad header checks and
identity mismatches with :class:`FrameError` (callers count these as misses, never serve them).
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence, TypeAlias, Union, cast

import numpy as np
import numpy.typing as npt
import xxhash

from .layout import KvLayout
from .namespace import KeyIdentity

if TYPE_CHECKING:
    from typing_extensions import Buffer

#: A read-only bytes-like input: anything with the buffer protocol (bytes, bytearray, memoryview), or
#: a C-contiguous uint8 numpy array. numpy arrays are named apart because numpy's stubs declare the
#: buffer protocol (``__buffer__``) only for Python >= 3.12, and mypy checks this package as 3.11.
BytesLike: TypeAlias = Union["Buffer", npt.NDArray[np.uint8]]
#: A bytes-like input that is also sliced (``x[a:b]``) before it is read.
SliceableBytes: TypeAlias = Union[bytes, bytearray, memoryview, npt.NDArray[np.uint8]]


def _buf(data: BytesLike) -> Buffer:
    """``data`` as the buffer it is at runtime (numpy arrays export the buffer protocol; only their stubs
    before Python 3.12 do not say so: see :data:`BytesLike`). No copy, no check."""
    return cast("Buffer", data)

MAGIC = b"KVBMFRM\x00"
FORMAT_VERSION = 1
#: An encrypted frame whose AEAD additional data also binds its token digest (docs/format.md "Token digest");
#: every other frame is version 1. Readers from before 2026-12-01 know only version 1: such a frame is a miss
#: to them, never dropped (a G4 ``version`` miss is not).
DIGEST_AAD_VERSION = 2
HEADER_BYTES = 4096
ALIGN = 4096

FLAG_ENCRYPTED = 0x1  # payload is AES-256-GCM ciphertext; integrity holds the GCM tag
FLAG_CHECKSUM = 0x2  # integrity holds xxh3_128 of the plaintext payload
FLAG_DEVCHECK = 0x4  # dev_check holds device_checksum() of the plaintext payload (verifiable on a GPU)

# magic, version, flags, header_len, ns_fp, tenant_tag, rank, world, seq_hash,
# num_layers, outer_dim, dtype_bytes, page_size, inner_dim, payload_len, stored_len,
# key_id, key_version, nonce, key_check, integrity, created_ns, dev_check
_FMT = "<8sHHI8s16sIIQIHHIIQQII12sI16sQQ"
_FIXED = struct.calcsize(_FMT)  # 144
_CHECK = struct.Struct("<Q")
_IDENTITY = struct.Struct("<8s16sIIQIHHIIQ")  # FrameHeader.identity_bytes: the AEAD additional data
#: Header bytes ``[152, 168)``: the block's token digest (:func:`kvbm_backend.model.hashing.token_digests`),
#: zero when the writer had none (docs/format.md "Token digest").
TOKEN_DIGEST_OFF, TOKEN_DIGEST_BYTES = 152, 16
NO_DIGEST = bytes(TOKEN_DIGEST_BYTES)


def identity_bytes(ns_fp: bytes, tenant_tag: bytes, rank: int, world: int, seq_hash: int, layout: KvLayout) -> bytes:
    """:meth:`FrameHeader.identity_bytes` of the frame :meth:`FrameHeader.for_block` makes for that block
    (``payload_len`` the layout's block), without building the header: what a reader binds as AEAD
    additional data (``docs/format.md``)."""
    return _IDENTITY.pack(ns_fp, tenant_tag, rank, world, seq_hash, layout.num_layers, layout.outer_dim,
                          layout.dtype_bytes, layout.page_size, layout.inner_dim, layout.bytes_per_block)
assert _FIXED == 144


class FrameError(ValueError):
    """A frame that must not be served. ``reason`` is a short counter label (``magic``, ``version``,
    ``header_check``, ``identity``, ``layout``, ``length``, ``integrity``, ``token_digest``)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def bound_aad(hdr: FrameHeader, identity: bytes) -> bytes:
    """The AEAD additional data of frame ``hdr`` given its ``identity`` bytes (:func:`identity_bytes`, the reader's
    expectation): those alone (format version 1), or followed by the header's token digest (version
    :data:`DIGEST_AAD_VERSION`: a frame whose digest was changed in the store fails its tag)."""
    return identity + hdr.token_digest if hdr.version == DIGEST_AAD_VERSION else identity


def unbound_digest(hdr: FrameHeader, encrypted_flag: int) -> bool:
    """Whether encrypted frame ``hdr`` (``hdr.flags & encrypted_flag``) names a nonzero token digest its AEAD does
    not bind (format version 1 seals none; the writer seals every frame with a digest as version
    :data:`DIGEST_AAD_VERSION`): only a store that rewrote the digest makes one, to relabel the block for another
    prompt of the same name. Readers refuse it as ``token_digest`` (review finding 2026-12-02: it was served)."""
    return bool(hdr.flags & encrypted_flag) and hdr.version != DIGEST_AAD_VERSION and hdr.token_digest != NO_DIGEST


def key_digest(key: object) -> bytes | None:
    """The token digest a key names (``key.token_digest``: a :class:`~.namespace.DigestKey`, 16 bytes), or
    None for a key that names none (its frames are not checked for one)."""
    d = getattr(key, "token_digest", None)
    return d if isinstance(d, bytes) else None


def key_digests(keys: Iterable[object]) -> list[bytes | None] | None:
    """:func:`key_digest` of each key, or None when no key names one (the readers' fast path)."""
    ds = [key_digest(k) for k in keys]
    return ds if any(d is not None for d in ds) else None


def digest_rows(headers: npt.NDArray[np.uint8], digests: Sequence[bytes | None] | None) -> npt.NDArray[np.bool_]:
    """True for each of ``m`` header rows (uint8 ``(m, >= 168)``) whose token digest is the one ``digests``
    names, or that has none named (None, or ``digests`` None)."""
    m = len(headers)
    ok: npt.NDArray[np.bool_] = np.ones(m, bool)
    if digests is None:
        return ok
    rows = [j for j in range(m) if digests[j] is not None]
    if rows:
        want = np.frombuffer(b"".join(cast(bytes, digests[j]) for j in rows), np.uint8).reshape(len(rows), 16)
        ok[rows] = (headers[rows, TOKEN_DIGEST_OFF:TOKEN_DIGEST_OFF + TOKEN_DIGEST_BYTES] == want).all(axis=1)
    return ok


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def slot_bytes(stored_len: int) -> int:
    """Bytes a frame occupies: header plus the stored payload padded to 4 KiB."""
    return HEADER_BYTES + align_up(stored_len)


def payload_checksum(data: BytesLike) -> bytes:
    """xxh3_128 of the payload bytes (16 bytes, big-endian digest as xxhash gives it)."""
    return xxhash.xxh3_128_digest(_buf(data))


@dataclass
class FrameHeader:
    ns_fp: bytes  # 8 bytes (Namespace.fingerprint_bytes)
    tenant_tag: bytes  # 16 bytes
    rank: int
    world: int
    seq_hash: int
    num_layers: int
    outer_dim: int
    dtype_bytes: int
    page_size: int
    inner_dim: int
    payload_len: int
    stored_len: int
    flags: int = FLAG_CHECKSUM
    key_id: int = 0
    key_version: int = 0
    nonce: bytes = b"\x00" * 12
    key_check: int = 0  # encrypted frames: aead.key_check of the data key (0: written before it existed)
    integrity: bytes = b"\x00" * 16
    created_ns: int = field(default_factory=time.time_ns)
    dev_check: int = 0
    version: int = FORMAT_VERSION
    token_digest: bytes = NO_DIGEST  # 16 bytes after the header check (zero: the writer had none)

    @classmethod
    def for_block(cls, key: KeyIdentity, layout: KvLayout, world: int, tenant_tag: bytes,
                  **kw: Any) -> "FrameHeader":
        kw.setdefault("token_digest", key_digest(key) or NO_DIGEST)  # a DigestKey's frames carry its digest
        return cls(ns_fp=bytes.fromhex(key.namespace), tenant_tag=tenant_tag, rank=key.rank, world=world,
                   seq_hash=key.seq_hash, num_layers=layout.num_layers, outer_dim=layout.outer_dim,
                   dtype_bytes=layout.dtype_bytes, page_size=layout.page_size, inner_dim=layout.inner_dim,
                   payload_len=kw.pop("payload_len", layout.bytes_per_block),
                   stored_len=kw.pop("stored_len", layout.bytes_per_block), **kw)

    def identity_bytes(self) -> bytes:
        """The AEAD additional data: namespace, tenant, rank, world, sequence hash and layout, then (frame version
        :data:`DIGEST_AAD_VERSION`) the token digest."""
        return bound_aad(self, _IDENTITY.pack(self.ns_fp, self.tenant_tag, self.rank, self.world, self.seq_hash,
                                              self.num_layers, self.outer_dim, self.dtype_bytes, self.page_size,
                                              self.inner_dim, self.payload_len))

    def pack(self) -> bytes:
        """The 4096-byte header."""
        fixed = struct.pack(_FMT, MAGIC, self.version, self.flags, HEADER_BYTES, self.ns_fp, self.tenant_tag,
                            self.rank, self.world, self.seq_hash, self.num_layers, self.outer_dim,
                            self.dtype_bytes, self.page_size, self.inner_dim, self.payload_len,
                            self.stored_len, self.key_id, self.key_version, self.nonce, self.key_check,
                            self.integrity, self.created_ns, self.dev_check)
        check = _CHECK.pack(xxhash.xxh3_64_intdigest(fixed))
        if len(self.token_digest) != TOKEN_DIGEST_BYTES:
            raise ValueError(f"token_digest: {len(self.token_digest)} bytes, a frame holds {TOKEN_DIGEST_BYTES}")
        return fixed + check + self.token_digest + b"\x00" * (HEADER_BYTES - TOKEN_DIGEST_OFF - TOKEN_DIGEST_BYTES)

    @classmethod
    def unpack(cls, buf: BytesLike) -> "FrameHeader":
        """Parse a header. Raises FrameError on bad magic, unknown version or a failed header check."""
        mv = memoryview(_buf(buf))
        if len(mv) < _FIXED + 8:
            raise FrameError("length", f"header of {len(mv)} bytes")
        fixed = bytes(mv[:_FIXED])
        if fixed[:8] != MAGIC:
            raise FrameError("magic")
        (_m, version, flags, hlen, ns_fp, ttag, rank, world, seq, nl, od, db, ps, inner, plen, slen, kid, kver,
         nonce, kcheck, integ, created, devc) = struct.unpack(_FMT, fixed)
        if version != FORMAT_VERSION and not (version == DIGEST_AAD_VERSION and flags & FLAG_ENCRYPTED):
            raise FrameError("version", f"frame format {version}, this reader knows {FORMAT_VERSION} and "
                                        f"{DIGEST_AAD_VERSION} (encrypted)")
        if _CHECK.unpack(bytes(mv[_FIXED:_FIXED + 8]))[0] != xxhash.xxh3_64_intdigest(fixed):
            raise FrameError("header_check")
        if hlen != HEADER_BYTES:
            raise FrameError("length", f"header_len {hlen}")
        return cls(ns_fp=ns_fp, tenant_tag=ttag, rank=rank, world=world, seq_hash=seq, num_layers=nl, outer_dim=od,
                   dtype_bytes=db, page_size=ps, inner_dim=inner, payload_len=plen, stored_len=slen, flags=flags,
                   key_id=kid, key_version=kver, nonce=nonce, key_check=kcheck, integrity=integ, created_ns=created,
                   dev_check=devc, version=version,
                   token_digest=bytes(mv[TOKEN_DIGEST_OFF:TOKEN_DIGEST_OFF + TOKEN_DIGEST_BYTES]).ljust(16, b"\x00"))

    def check_identity(self, key: KeyIdentity, layout: KvLayout, tenant_tag: bytes) -> None:
        """Raise FrameError('identity'/'layout') unless this header names exactly ``key`` in ``layout``, and
        FrameError('token_digest') when ``key`` names a token digest (:func:`key_digest`) it does not hold."""
        if (self.ns_fp != bytes.fromhex(key.namespace) or self.tenant_tag != tenant_tag
                or self.rank != key.rank or self.seq_hash != key.seq_hash):
            raise FrameError("identity", "header names another block")
        want = key_digest(key)
        if want is not None and self.token_digest != want:
            raise FrameError("token_digest", "token digest differs: another token sequence with this sequence hash, "
                                         "or a frame written without a digest")
        if (self.num_layers, self.outer_dim, self.dtype_bytes, self.page_size, self.inner_dim) != (
                layout.num_layers, layout.outer_dim, layout.dtype_bytes, layout.page_size, layout.inner_dim):
            raise FrameError("layout", "header layout differs from the namespace's")
        if self.payload_len != layout.bytes_per_block:
            raise FrameError("length", f"payload_len {self.payload_len} != block {layout.bytes_per_block}")


def accept(buf: BytesLike, key: KeyIdentity, layout: KvLayout, tenant_tag: bytes, *, world: int | None = None,
           stored_len: int | None = None, frame_bytes: int | None = None, exact: bool = False) -> FrameHeader:
    """The frame check every reader runs before it trusts a stored block's header (G3 reads and
    restore, G4 loads, the device loader): one implementation, so the checks cannot drift apart.

    Parses the 4 KiB header at the start of ``buf`` (magic, version, header check, header length) and
    requires that it names exactly ``key`` (namespace, ``tenant_tag``, rank, sequence hash) in ``layout``
    (geometry and payload length), and, where given: TP ``world``, ``stored_len`` bytes stored, and a
    frame that fits in ``frame_bytes`` (a G3 slot, a G4 object; ``exact``: the object is exactly header +
    stored bytes). Payload integrity is the caller's (host checksum, AEAD tag, or device checksum).

    Returns the parsed header. Raises FrameError with the reason (``magic``, ``version``,
    ``header_check``, ``identity``, ``layout``, ``length``).
    """
    h = FrameHeader.unpack(buf)
    h.check_identity(key, layout, tenant_tag)
    if world is not None and h.world != world:
        raise FrameError("identity", f"frame of TP world {h.world}, expected {world}")
    if stored_len is not None and h.stored_len != stored_len:
        raise FrameError("length", f"stored_len {h.stored_len} != {stored_len}")
    if frame_bytes is not None and (HEADER_BYTES + h.stored_len > frame_bytes
                                    or (exact and HEADER_BYTES + h.stored_len != frame_bytes)):
        raise FrameError("length", f"frame of {frame_bytes} bytes, header says {HEADER_BYTES}+{h.stored_len}")
    return h


def device_checksum(payload: BytesLike) -> int:
    """Position-weighted sum of the payload's little-endian u32 words, mod 2**64:
    ``sum((i + 1) * w[i])`` (a trailing partial word is zero-padded).

    Chosen because it is computable with plain integer tensor ops on a GPU (torch int64 arithmetic
    wraps identically), so a block read straight into HBM can be verified where it landed; it detects
    bit flips, truncation and reordered words. Host paths use the xxh3_128 ``integrity`` value.
    """
    b = np.frombuffer(memoryview(_buf(payload)), dtype=np.uint8)
    pad = (-len(b)) % 4
    if pad:
        b = np.concatenate([b, np.zeros(pad, np.uint8)])
    w = b.view("<u4").astype(np.uint64)
    with np.errstate(over="ignore"):
        return int((w * np.arange(1, len(w) + 1, dtype=np.uint64)).sum(dtype=np.uint64))


def verify_payload(hdr: FrameHeader, payload: BytesLike) -> None:
    """Raise FrameError('integrity') unless the plaintext payload matches the header's checksum."""
    if hdr.flags & FLAG_CHECKSUM and payload_checksum(payload) != hdr.integrity:
        raise FrameError("integrity", "payload checksum mismatch")


_FIXED_STRUCT = struct.Struct(_FMT)
_PREFIX = struct.Struct("<8sHHI8s16sIIQIHHIIQQ")  # magic .. stored_len: 88 bytes
_OFF_INTEGRITY = 112  # offset of the 16-byte integrity field in the header
assert _PREFIX.size == 88 and _FIXED_STRUCT.size == _FIXED
_HEADER_TAIL = bytes(HEADER_BYTES - _FIXED - 8)
_FLAGS_DEV = struct.pack("<H", FLAG_CHECKSUM | FLAG_DEVCHECK)


class ChecksumFrames:
    """Fast writer/checker of plaintext, checksummed frames (``flags`` = ``FLAG_CHECKSUM``, or
    ``FLAG_CHECKSUM | FLAG_DEVCHECK`` when the writer also has the payload's :func:`device_checksum`)
    of one namespace and layout: the same bytes :meth:`FrameHeader.pack` makes, without building a
    :class:`FrameHeader` per block (a pool's per-block CPU on small blocks). Both flag sets are
    accepted by :meth:`verify` / :meth:`verify_many` (host readers check the xxh3_128 either way).

    Args:
        ns_fp: the namespace fingerprint (8 bytes).
        layout: the namespace's :class:`KvLayout`; payloads are ``layout.bytes_per_block`` bytes.
        world: TP world size written in the header.
    """

    def __init__(self, ns_fp: bytes, layout: KvLayout, world: int):
        self.block_bytes = layout.bytes_per_block
        self._args = (layout.num_layers, layout.outer_dim, layout.dtype_bytes, layout.page_size, layout.inner_dim,
                      self.block_bytes, self.block_bytes)
        self._ns_fp = ns_fp
        self._world = world

    def write_header(self, buf: memoryview | bytearray, offset: int, tenant_tag: bytes, rank: int, seq_hash: int,
                     integrity: bytes, created_ns: int, dev_check: int | None = None,
                     token_digest: bytes | None = None) -> None:
        """Write the full 4096-byte header of one block at ``buf[offset:offset + 4096]`` (a writable
        buffer, e.g. a memoryview of a staging array). ``integrity``: :func:`payload_checksum` of the
        payload (16 bytes). ``dev_check``: the payload's :func:`device_checksum` (an int in
        ``[0, 2**64)``) if the writer has it: the frame then also carries ``FLAG_DEVCHECK`` and can be
        verified where it lands on a GPU without coming back to the host. ``token_digest``: the block's
        16-byte token digest (:func:`key_digest` of its key), written at bytes 152..167 (zero when None)."""
        a = self._args
        flags = FLAG_CHECKSUM if dev_check is None else FLAG_CHECKSUM | FLAG_DEVCHECK
        _FIXED_STRUCT.pack_into(buf, offset, MAGIC, FORMAT_VERSION, flags, HEADER_BYTES, self._ns_fp,
                                tenant_tag, rank, self._world, seq_hash, a[0], a[1], a[2], a[3], a[4], a[5], a[6],
                                0, 0, b"\x00" * 12, 0, integrity, created_ns,
                                0 if dev_check is None else dev_check & 0xFFFFFFFFFFFFFFFF)
        _CHECK.pack_into(buf, offset + _FIXED, xxhash.xxh3_64_intdigest(buf[offset:offset + _FIXED]))
        buf[offset + _FIXED + 8:offset + HEADER_BYTES] = _HEADER_TAIL
        if token_digest is not None:
            buf[offset + TOKEN_DIGEST_OFF:offset + TOKEN_DIGEST_OFF + TOKEN_DIGEST_BYTES] = token_digest

    def prefix(self, tenant_tag: bytes, rank: int, seq_hash: int) -> bytes:
        """The first 88 header bytes (magic .. stored_len) this writer makes for that block."""
        a = self._args
        return _PREFIX.pack(MAGIC, FORMAT_VERSION, FLAG_CHECKSUM, HEADER_BYTES, self._ns_fp, tenant_tag, rank,
                            self._world, seq_hash, *a)

    def verify(self, header: SliceableBytes, payload: BytesLike, tenant_tag: bytes, rank: int,
               seq_hash: int, token_digest: bytes | None = None) -> bool:
        """True only if ``header`` (>= 168 bytes) is exactly what :meth:`write_header` makes for this
        block (identity, layout, lengths, flags, header check; ``token_digest`` when given) and ``payload``'s xxh3_128 matches its
        integrity field. False says nothing about why: callers re-check with :meth:`FrameHeader.unpack`,
        :meth:`FrameHeader.check_identity` and :func:`verify_payload` to name the reason (a frame that
        passes here passes those too)."""
        hb = bytes(header[:TOKEN_DIGEST_OFF + TOKEN_DIGEST_BYTES])
        if token_digest is not None and hb[TOKEN_DIGEST_OFF:] != token_digest:
            return False
        want = self.prefix(tenant_tag, rank, seq_hash)
        if hb[:88] != want and hb[:88] != want[:10] + _FLAGS_DEV + want[12:]:
            return False
        if _CHECK.unpack_from(hb, _FIXED)[0] != xxhash.xxh3_64_intdigest(hb[:_FIXED]):
            return False
        return xxhash.xxh3_128_digest(_buf(payload)) == hb[_OFF_INTEGRITY:_OFF_INTEGRITY + 16]

    def check_headers(self, headers: npt.NDArray[np.uint8], tenant_tags: Sequence[bytes] | npt.NDArray[np.uint8],
                      ranks: Sequence[int] | npt.NDArray[Any], seq_hashes: Iterable[int], *, check_world: bool = True,
                      digests: Sequence[bytes | None] | None = None,
                      ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
        """The header half of :meth:`verify_many` for ``m`` headers at once (numpy compares, one xxh3_64
        call per header): True where the header is exactly what :meth:`write_header` makes for that block
        (identity, layout, lengths, flags ``FLAG_CHECKSUM`` or ``FLAG_CHECKSUM | FLAG_DEVCHECK``, header
        check). ``check_world`` False: any TP world is accepted (readers that were not told one).

        Args:
            headers: uint8 ``(m, stride)``, ``stride >= 168``: row ``j`` starts with block ``j``'s header.
            tenant_tags: ``m`` 16-byte tags; ranks, seq_hashes: ``m`` ints.
            digests: None, or ``m`` token digests (:func:`key_digests`; None: that row's is not checked).
        Returns:
            ``(ok, devcheck)``: bool arrays of ``m``; ``devcheck[j]``: the header carries FLAG_DEVCHECK
            (its ``dev_check`` field, :func:`header_dev_checks`, is the payload's device checksum).
        """
        m = len(tenant_tags)
        h = headers[:m]
        dev_flags = np.frombuffer(_FLAGS_DEV, np.uint8)
        exp = np.empty((m, _PREFIX.size), np.uint8)
        exp[:] = np.frombuffer(self.prefix(b"\x00" * 16, 0, 0), np.uint8)
        exp[:, 24:40] = np.frombuffer(b"".join(tenant_tags), np.uint8).reshape(m, 16)
        exp[:, 40:44] = np.asarray(ranks, dtype="<u4").view(np.uint8).reshape(m, 4)
        exp[:, 48:56] = np.fromiter(seq_hashes, dtype="<u8", count=m).view(np.uint8).reshape(m, 8)
        if not check_world:
            exp[:, 44:48] = h[:, 44:48]
        # flags (bytes 10-11) may be FLAG_CHECKSUM or FLAG_CHECKSUM | FLAG_DEVCHECK
        flags = h[:, 10:12]
        ok: npt.NDArray[np.bool_] = ((h[:, :10] == exp[:, :10]).all(axis=1)
                                     & (h[:, 12:_PREFIX.size] == exp[:, 12:]).all(axis=1))
        devcheck: npt.NDArray[np.bool_] = (flags == dev_flags).all(axis=1)
        ok &= (flags == exp[0, 10:12]).all(axis=1) | devcheck
        flat = np.ascontiguousarray(h[:, :_FIXED + 8]).reshape(-1).data  # a memoryview of the copy
        row = _FIXED + 8
        cuts = map(slice, range(0, m * row, row), range(_FIXED, m * row + _FIXED, row))  # map chain: no bytecode per row
        checks = np.fromiter(map(xxhash.xxh3_64_intdigest, map(flat.__getitem__, cuts)), dtype="<u8", count=m)
        ok &= h[:, _FIXED:_FIXED + 8].copy().view("<u8").reshape(m) == checks
        ok &= digest_rows(h, digests)
        return ok, devcheck

    def verify_many(self, headers: npt.NDArray[np.uint8], payloads: Sequence[BytesLike],
                    tenant_tags: Sequence[bytes], ranks: Sequence[int],
                    seq_hashes: Iterable[int], digests: Sequence[bytes | None] | None = None) -> npt.NDArray[np.bool_]:
        """:meth:`verify` for ``m`` blocks at once (numpy compares instead of per-block Python).

        Args:
            headers: uint8 array of shape ``(m, stride)``, ``stride >= 168``, C-contiguous rows: row
                ``j`` starts with block ``j``'s header bytes (e.g. a staging buffer of whole slots
                reshaped to ``(m, slot_bytes)``, or packed 4 KiB headers).
            payloads: ``m`` buffers of ``block_bytes`` each.
            tenant_tags: ``m`` 16-byte tags; ranks, seq_hashes: ``m`` ints; digests: as :meth:`check_headers`.

        Returns:
            ``np.ndarray`` of ``m`` bools: True exactly where :meth:`verify` would return True.
        """
        m = len(payloads)
        if m == 0:
            return np.zeros(0, bool)
        h = headers[:m]
        ok, _ = self.check_headers(h, tenant_tags, ranks, seq_hashes, digests=digests)
        bufs = cast("Sequence[Buffer]", payloads)  # as _buf, for the whole list (map: no per-item Python call)
        digs = np.frombuffer(b"".join(map(xxhash.xxh3_128_digest, bufs)), np.uint8).reshape(m, 16)
        ok &= (h[:, _OFF_INTEGRITY:_OFF_INTEGRITY + 16] == digs).all(axis=1)
        return ok


def header_dev_checks(headers: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint64]:
    """The ``dev_check`` field (:func:`device_checksum` of the payload) of ``m`` headers, uint64 ``[m]``
    (``headers``: uint8 ``(m, stride)``, ``stride >= 144``, rows starting with a header)."""
    out: npt.NDArray[np.uint64] = headers[:, _FIXED - 8:_FIXED].copy().view("<u8").reshape(-1).astype(np.uint64)
    return out


def header_flags(headers: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint16]:
    """The ``flags`` field (``FLAG_*`` bits) of ``m`` headers, uint16 ``[m]`` (``headers`` as in
    :func:`header_dev_checks`)."""
    out: npt.NDArray[np.uint16] = headers[:, 10:12].copy().view("<u2").reshape(-1).astype(np.uint16)
    return out


def header_integrity(headers: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """The 16-byte ``integrity`` field (xxh3_128 of the payload, or the GCM tag) of ``m`` headers, uint8
    ``[m, 16]`` (``headers`` as in :func:`header_dev_checks`)."""
    return np.ascontiguousarray(headers[:, _OFF_INTEGRITY:_OFF_INTEGRITY + 16])
