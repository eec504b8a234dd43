"""fmix64 (the splitmix64 finalizer shared by the compact G3 index and the scheduler's G3 mirror) against
splitmix64's published outputs, scalar and vectorised alike."""
import random

import numpy as np

from kvbm_backend.model.mix64 import M64, fmix64, fmix64_v

GAMMA = 0x9E3779B97F4A7C15
# splitmix64 from state 0: outputs 1 and 2 (Vigna's splitmix64.c; also the first seeds of xoshiro's seeding)
SPLITMIX64_FROM_0 = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


def test_fmix64_gives_splitmix64s_outputs_and_the_vector_form_agrees():
    assert [fmix64((i * GAMMA) & M64) for i in (1, 2)] == SPLITMIX64_FROM_0
    rng = random.Random(3)
    xs = [0, 1, M64, 1 << 63] + [rng.getrandbits(64) for _ in range(1000)]
    a = np.array(xs, np.uint64)
    assert fmix64_v(a) is a  # in place
    assert a.tolist() == [fmix64(x) for x in xs]
    assert len(set(a.tolist())) == len(xs)  # a bijection: distinct inputs stay distinct
