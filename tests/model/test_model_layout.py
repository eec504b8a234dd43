"""KvLayout, presets and engine-layout conversions."""
import numpy as np
import pytest

from kvbm_backend.model.layout import KvLayout, engine_page_to_region, region_to_engine_page
from kvbm_backend.model.presets import list_presets, load_preset, resolve_layout

# Published config.json figures: layers x outer x kv_heads x head_dim x 2 B (bf16).
PUBLISHED_BYTES_PER_TOKEN = {
    "llama-3.1-8b": 32 * 2 * 8 * 128 * 2,
    "llama-3.1-70b": 80 * 2 * 8 * 128 * 2,
    "llama-3.1-405b": 516_096,
    "qwen3-8b": 36 * 2 * 8 * 128 * 2,
    "qwen3-32b": 64 * 2 * 8 * 128 * 2,
    "gpt-oss-20b": 24 * 2 * 8 * 64 * 2,
    "gpt-oss-120b": 36 * 2 * 8 * 64 * 2,
    "deepseek-r1": 61 * 1 * (512 + 64) * 2,
}


def test_required_presets_present():
    have = set(list_presets())
    assert set(PUBLISHED_BYTES_PER_TOKEN) | {"tiny"} <= have


@pytest.mark.parametrize("name,bpt", sorted(PUBLISHED_BYTES_PER_TOKEN.items()))
def test_bytes_per_token_matches_published(name, bpt):
    p = load_preset(name)
    assert p.layout(page_size=1, tp=1).bytes_per_block == bpt
    assert p.layout(page_size=16, tp=1).bytes_per_block == 16 * bpt


def test_tp_split_and_mla_replication():
    llama = load_preset("llama-3.1-70b")
    assert llama.layout(16, tp=8).bytes_per_block * 8 == llama.layout(16, tp=1).bytes_per_block
    assert llama.layout(16, tp=8).inner_dim == 128
    # more ranks than KV heads: heads replicated, one per rank
    assert llama.layout(16, tp=16).inner_dim == 128
    ds = load_preset("deepseek-r1")
    assert ds.layout(64, tp=8).bytes_per_block == ds.layout(64, tp=1).bytes_per_block
    assert ds.layout(64).outer_dim == 1
    with pytest.raises(ValueError, match="tp"):
        load_preset("qwen3-8b").layout(16, tp=3)


def test_kvbm_formula():
    lay = KvLayout(num_layers=3, outer_dim=2, page_size=16, inner_dim=40, dtype="float16")
    assert lay.bytes_per_block == 3 * 2 * 16 * 40 * 2
    assert lay.region_bytes == 16 * 40 * 2


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="page_size"):
        KvLayout(4, 2, 0, 128)
    with pytest.raises(ValueError, match="outer_dim"):
        KvLayout(4, 3, 16, 128)
    with pytest.raises(ValueError, match="dtype"):
        KvLayout(4, 2, 16, 128, "float7")
    with pytest.raises(ValueError, match="no preset 'nope'"):
        resolve_layout("nope")


@pytest.mark.parametrize("engine_layout", ["NHD", "HND"])
def test_engine_page_round_trip(engine_layout):
    rng = np.random.default_rng(0)
    page_size, heads, hd = 16, 2, 8
    nhd = rng.integers(0, 1000, size=(page_size, heads, hd)).astype(np.float32)
    page = nhd if engine_layout == "NHD" else nhd.transpose(1, 0, 2).copy()
    region = engine_page_to_region(page, engine_layout)
    assert region.shape == (page_size, heads * hd)
    # token-major: token t's row is its heads concatenated
    np.testing.assert_array_equal(region[3], nhd[3].reshape(-1))
    back = region_to_engine_page(region, heads, engine_layout)
    np.testing.assert_array_equal(back, page)


def test_view_checks_size():
    lay = KvLayout(2, 2, 4, 8, "bfloat16")
    buf = np.zeros(lay.bytes_per_block, np.uint8)
    assert lay.view(buf).shape == (2, 2, 4, 16)
    with pytest.raises(ValueError, match="block buffer"):
        lay.view(np.zeros(lay.bytes_per_block - 1, np.uint8))
