"""AES-256-GCM sealing of one block payload (NIST SP 800-38D), written straight into buffers.

The ciphertext has exactly the payload's length; the 16-byte tag goes into the frame header's
``integrity`` field and the random 96-bit nonce into ``nonce`` (``docs/format.md``). The additional
authenticated data is :meth:`kvbm_backend.model.frame.FrameHeader.identity_bytes` of the block's
expected identity (namespace, tenant pseudonym, rank, world, sequence hash, layout, length), so a blob
copied to another name or tenant fails to open.

Uses ``cryptography``'s streaming GCM (OpenSSL, AES-NI) with ``update_into`` so neither sealing nor
opening allocates a payload-sized temporary, and works on read-only input (an S3 client's body) and in
place. cryptography 50 releases the GIL for the whole ``update_into`` (measured: another thread runs
Python throughout a 256 MiB seal or open, ``tests/pool/g4/test_g4_gil.py``), so G4's I/O threads seal and
open blocks in parallel; its one-shot ``AESGCM.encrypt_into``/``decrypt_into`` does too and runs at the
same speed (9.8 GB/s per thread on the dev VM, 2 MiB blocks) but needs the tag after the ciphertext, which
the frame (tag in the header) does not give in place. :func:`open_tagged_into` uses it where the caller
has put the tag after the ciphertext in a buffer of its own (G4's staged loads: a bounce buffer opened
straight into the caller's row in one call, one GIL release, no streaming context built per block).
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import os
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE_BYTES = 12
TAG_BYTES = 16
KEY_BYTES = 32

if TYPE_CHECKING:
    from typing_extensions import Buffer  # any bytes-like object (collections.abc.Buffer from Python 3.12)


class AeadError(ValueError):
    """The tag did not verify: wrong key, wrong identity (AAD), or altered bytes."""


KEY_CHECK_LABEL = b"kvbm-backend key check v1"


@functools.lru_cache(maxsize=256)
def key_check(key: bytes) -> int:
    """The frame header's ``key_check`` of data key ``key`` (``docs/format.md``): the first 4 bytes of
    HMAC-SHA256(key, ``KEY_CHECK_LABEL``) as a little-endian u32, 0 mapped to 1 (0 marks a frame written
    before the field existed). It names the key *material*, so a reader holding another key under the same
    ``(key_id, version)`` (two copies of a keyring rotated apart) tells a frame it cannot open from a corrupt
    one; a one-way function of the key, it reveals nothing usable about it. Cached per key (the 256 most
    recent). Raises ValueError on a key that is not 32 bytes."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"AES-256-GCM key: {len(key)} bytes, need {KEY_BYTES}")
    v = int.from_bytes(hmac.new(key, KEY_CHECK_LABEL, hashlib.sha256).digest()[:4], "little")
    return v or 1


def key_check_differs(check: int, key: bytes) -> bool:
    """True when a frame's ``key_check`` (``check``) names other key material than ``key``: the frame was
    sealed under another key of the same ``(key_id, version)`` (a diverged keyring copy), so a failing GCM
    tag proves nothing about its bytes. False for ``check`` 0 (a frame written before the field existed:
    a failing tag then is corruption, as before). Raises ValueError on a key that is not 32 bytes."""
    return check != 0 and check != key_check(key)


def new_nonce() -> bytes:
    """96 random bits from the OS CSPRNG (the random-nonce construction of SP 800-38D 8.2.2)."""
    return os.urandom(NONCE_BYTES)


def seal_into(key: bytes, nonce: bytes, aad: bytes, plaintext: Buffer, out: Buffer) -> bytes:
    """Encrypt ``plaintext`` (bytes-like, N bytes) into ``out`` (writable bytes-like, exactly N bytes).

    Returns the 16-byte GCM tag. Raises ValueError on a wrong key/nonce size or mismatched lengths.
    """
    _check(key, nonce)
    pt, ct = memoryview(plaintext).cast("B"), memoryview(out).cast("B")
    if len(pt) != len(ct):
        raise ValueError(f"seal_into: out has {len(ct)} bytes, plaintext {len(pt)}")
    enc = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(aad)
    n = enc.update_into(pt, ct)
    if n != len(pt):  # GCM is a stream mode: never buffers
        raise AssertionError(f"GCM wrote {n} of {len(pt)} bytes")
    enc.finalize()
    return enc.tag


def open_into(key: bytes, nonce: bytes, aad: bytes, tag: bytes, ciphertext: Buffer, out: Buffer) -> None:
    """Decrypt ``ciphertext`` into ``out`` (exactly as long) and verify ``tag``.

    Raises AeadError if the tag does not verify; ``out`` then holds unverified bytes that must not be
    used (callers report the block as a miss).
    """
    _check(key, nonce)
    ct, pt = memoryview(ciphertext).cast("B"), memoryview(out).cast("B")
    if len(pt) != len(ct):
        raise ValueError(f"open_into: out has {len(pt)} bytes, ciphertext {len(ct)}")
    if len(tag) != TAG_BYTES:
        raise AeadError(f"tag of {len(tag)} bytes")
    dec = Cipher(algorithms.AES(key), modes.GCM(nonce, tag)).decryptor()
    dec.authenticate_additional_data(aad)
    dec.update_into(ct, pt)
    try:
        dec.finalize()
    except InvalidTag:
        raise AeadError("GCM tag mismatch") from None


def gcm(key: bytes) -> AESGCM:
    """A reusable one-shot AES-256-GCM context of ``key`` for :func:`open_tagged_into` (thread-safe: each
    call is independent). Raises ValueError on a wrong key size."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"AES-256-GCM key: {len(key)} bytes, need {KEY_BYTES}")
    return AESGCM(key)


def open_tagged_into(ctx: AESGCM, nonce: bytes, aad: bytes, ciphertext_and_tag: Buffer, out: Buffer) -> None:
    """Decrypt ``ciphertext_and_tag`` (N ciphertext bytes, then the 16-byte tag) into ``out`` (writable,
    exactly N bytes, not overlapping the input) and verify the tag, in one call that releases the GIL.

    Raises AeadError if the tag does not verify (``out`` then holds unverified bytes that must not be
    used; the input is unchanged); ValueError on a wrong nonce size or mismatched lengths."""
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"GCM nonce: {len(nonce)} bytes, need {NONCE_BYTES}")
    try:
        ctx.decrypt_into(nonce, memoryview(ciphertext_and_tag), aad, memoryview(out))
    except InvalidTag:
        raise AeadError("GCM tag mismatch") from None


def _check(key: bytes, nonce: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise ValueError(f"AES-256-GCM key: {len(key)} bytes, need {KEY_BYTES}")
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"GCM nonce: {len(nonce)} bytes, need {NONCE_BYTES}")


def gcm_gbps_per_core(nbytes: int = 8 << 20, seconds: float = 0.3) -> dict[str, float]:
    """Measure single-thread AES-256-GCM seal and open throughput on this CPU.

    Returns ``{"seal_gbps": float, "open_gbps": float}`` (GB = 1e9 bytes/s) over ``nbytes`` buffers.
    """
    import time

    key, nonce = os.urandom(KEY_BYTES), new_nonce()
    src, dst, back = bytearray(os.urandom(nbytes)), bytearray(nbytes), bytearray(nbytes)
    res = {}
    for name in ("seal", "open"):
        done, t0 = 0, time.perf_counter()
        tag = seal_into(key, nonce, b"aad", src, dst)
        while True:
            if name == "seal":
                tag = seal_into(key, nonce, b"aad", src, dst)
            else:
                open_into(key, nonce, b"aad", tag, dst, back)
            done += nbytes
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        res[f"{name}_gbps"] = done / dt / 1e9
    return res
