"""The splitmix64 finalizer ("fmix64"): a bijection of 64-bit ints that spreads every input bit over the
output, used to place 64-bit keys in open-addressing hash tables (the compact G3 index's cells, the
scheduler's G3 mirror fingerprints). Not a cryptographic hash.

Source: Steele, Lea, Flood, "Fast splittable pseudorandom number generators" (OOPSLA 2014), finalizer
constants as in Vigna's ``splitmix64.c`` (https://prng.di.unimi.it/splitmix64.c).
"""
from __future__ import annotations

import numpy as np

M64 = (1 << 64) - 1
K1, K2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U = np.uint64


def fmix64(x: int) -> int:
    """fmix64 of one int in [0, 2**64) (:func:`fmix64_v` vectorised)."""
    x ^= x >> 30
    x = (x * K1) & M64
    x ^= x >> 27
    x = (x * K2) & M64
    return x ^ (x >> 31)


def fmix64_v(x: np.ndarray) -> np.ndarray:
    """fmix64 of a uint64 array, in place (the caller passes an array it owns); returns ``x``."""
    with np.errstate(over="ignore"):
        x ^= x >> _U(30)
        x *= _U(K1)
        x ^= x >> _U(27)
        x *= _U(K2)
        x ^= x >> _U(31)
    return x
