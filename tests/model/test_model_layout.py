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


GOOD = ('name = "x"\nnum_layers = 4\nnum_kv_heads = 2\nhead_dim = 64\ndtype = "bfloat16"\nmla = false\n'
        'bytes_per_token = 2048\n')


@pytest.mark.parametrize("change,field", [
    ("num_kv_heads = 0", "num_kv_heads"),
    ("num_kv_heads = -8\nhead_dim = -128", "num_kv_heads"),
    ("num_layers = 4.9", "num_layers"),
    ("num_kv_heads = true", "num_kv_heads"),
    ("num_layers = [4]", "num_layers"),
    ('num_layers = "four"', "num_layers"),
    ("num_layers = 1000000000", "num_layers"),
    ('mla = "false"', "mla"),
    ("sliding_widow = 128", "sliding_widow"),
    ("sliding_layers = 2\nsliding_window = -128\nfull_bytes_per_token = 1024\nsliding_bytes_per_token = 1024",
     "sliding_window"),
    ('dtype = "float7"', "dtype"),
    ("mla = true\nhead_dim = 256\nbytes_per_token = 2048", "num_kv_heads"),
    ("mla = true\nnum_kv_heads = 1\nhead_dim = 512\nbytes_per_token = 4096\nkv_lora_rank = 512\n"
     "qk_rope_head_dim = 64", "head_dim"),
])
def test_a_malformed_preset_is_refused_naming_the_file_and_field(tmp_path, change, field):
    """Review finding (2026-11-29): 0 or negative heads, floats, booleans, strings, a 10^9-layer model, a
    misspelt key, mla = "false" (read as true), a negative window and an MLA preset with 2 heads or a latent
    that is not kv_lora_rank + qk_rope_head_dim were accepted (or escaped as a TypeError naming nothing)."""
    lines = dict(ln.split(" = ", 1) for ln in GOOD.strip().splitlines())
    lines.update(ln.split(" = ", 1) for ln in change.splitlines())
    path = tmp_path / "bad.toml"
    path.write_text("".join(f"{k} = {v}\n" for k, v in lines.items()))
    with pytest.raises(ValueError) as e:
        load_preset(str(path))
    assert str(path) in str(e.value) and field in str(e.value), str(e.value)


@pytest.mark.parametrize("name", ["good.toml", "good.TOML", "good.Toml"])
def test_the_well_formed_preset_of_those_cases_loads(tmp_path, name):
    """A layout file's suffix is matched in any case, as config files' are (config.load_config)."""
    path = tmp_path / name
    path.write_text(GOOD)
    p = load_preset(str(path))
    assert (p.num_layers, p.num_kv_heads, p.head_dim, p.mla) == (4, 2, 64, False)


def test_tp_above_the_kv_heads_must_be_a_multiple_of_them():
    """vLLM replicates a KV head over tp / heads ranks (QKVParallelLinear: divide(tp_size, num_kv_heads)), so
    12 ranks over 8 heads is no engine vLLM starts; the preset said 1 head per rank."""
    llama = load_preset("llama-3.1-8b")
    assert llama.kv_heads_per_rank(16) == 1
    with pytest.raises(ValueError, match="tp=12"):
        llama.kv_heads_per_rank(12)


def test_a_kv_dtype_suffix_sizes_an_fp8_kv_cache():
    """``NAME:fp8``: the preset for an engine run with vLLM's ``--kv-cache-dtype fp8`` (the presets carry the
    weights' dtype, so an FP8 cache was sized at twice its bytes by plan, replay, bench and layouts); review finding."""
    base, fp8 = load_preset("llama-3.1-8b"), load_preset("llama-3.1-8b:fp8")
    assert (fp8.name, fp8.dtype, fp8.num_layers, fp8.num_kv_heads) == ("llama-3.1-8b:fp8", "fp8", 32, 8)
    assert fp8.bytes_per_token * 2 == base.bytes_per_token == 131072
    assert fp8.layout(16, tp=2).bytes_per_block * 2 == base.layout(16, tp=2).bytes_per_block
    g, g8 = load_preset("gemma-3-27b"), load_preset("gemma-3-27b:fp8")  # hybrid: both parts halve
    assert (g8.full_bytes_per_token * 2, g8.sliding_bytes_per_token * 2) == (g.full_bytes_per_token,
                                                                             g.sliding_bytes_per_token)
    assert resolve_layout("llama-3.1-8b:float32").bytes_per_block == 2 * base.layout(16).bytes_per_block
    with pytest.raises(ValueError, match="'llama-3.1-8b:fp7': after ':' a KV dtype"):
        load_preset("llama-3.1-8b:fp7")
    with pytest.raises(ValueError, match="no preset 'nope'"):
        load_preset("nope:fp8")



def test_a_dtype_alias_or_case_is_one_namespace():
    """Reviewer (2026-11-30): dtype names were recorded as given, so bf16 / bfloat16 / BFloat16 and fp8 /
    float8_e4m3fn gave different namespace fingerprints (equal caches never shared blocks). Every spelling is
    recorded as torch's name; e4m3 and e5m2 stay apart, and a canonical name's fingerprint is unchanged."""
    from kvbm_backend.model.namespace import Namespace

    def fp(dtype):
        return Namespace(model="m", layout=KvLayout(2, 2, 16, 64, dtype)).fingerprint
    assert {fp(d) for d in ("bfloat16", "bf16", "BFloat16", "BF16")} == {fp("bfloat16")}
    assert {fp(d) for d in ("float8_e4m3fn", "fp8", "fp8_e4m3", "FP8")} == {fp("float8_e4m3fn")}
    assert {fp(d) for d in ("float16", "fp16", "half")} == {fp("float16")}
    assert fp("fp8_e5m2") == fp("float8_e5m2") != fp("float8_e4m3fn")
    assert fp("uint8") != fp("float8_e4m3fn")  # a raw-bytes cache stays its own namespace
    assert KvLayout(2, 2, 16, 64, "bf16").dtype == "bfloat16"
    # canonical names keep the fingerprints they had before the change (computed with the previous code)
    assert (fp("bfloat16"), fp("float8_e4m3fn")) == ("481a1d608f90c3e6", "ae32f157720d802c")
    with pytest.raises(ValueError, match="dtype"):
        KvLayout(2, 2, 16, 64, "int4")
    with pytest.raises(ValueError, match="dtype"):
        KvLayout(2, 2, 16, 64, 2)  # type: ignore[arg-type]


def test_a_preset_path_with_a_colon_in_its_directory_loads(tmp_path):
    """Review (2026-11-30): ``NAME:DTYPE`` was split at the last ``:`` of any name, so a ``.toml`` path whose
    directory holds one (a run directory named by time, ``/runs/12:00/llama.toml``) was refused as an unknown
    KV dtype ``00/llama.toml``. A name ending in ``.toml`` is a path; ``PATH.toml:fp8`` still replaces the dtype."""
    d = tmp_path / "run-12:00"
    d.mkdir()
    src = load_preset("llama-3.1-8b")
    f = d / "llama.toml"
    f.write_text('name = "llama-local"\nnum_layers = 32\nnum_kv_heads = 8\nhead_dim = 128\n'
                 'dtype = "bfloat16"\nbytes_per_token = 131072\n')
    p = load_preset(str(f))
    assert (p.name, p.num_layers, p.num_kv_heads, p.head_dim, p.dtype) == ("llama-local", 32, 8, 128, "bfloat16")
    assert p.layout(16, tp=2) == src.layout(16, tp=2)
    p8 = load_preset(f"{f}:fp8")
    assert (p8.dtype, p8.bytes_per_token) == ("fp8", 65536)
