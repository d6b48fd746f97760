"""fused/mla_cache_append.py: every static configuration (dtype, widths, page, index dtypes, variant)
compiles for sm_90a without a GPU; the kernel reads each length and block-table entry once, waits for
the whole CTA before advancing the length, and copies 16-byte chunks; bad arguments are refused by name
and validate=True refuses what the reference refuses. On a GPU: every variant through the harness
(page edges, slots past 2^16, int64 indices, strided halves of a merged projection) and a CUDA graph
replaying the append step after step."""
from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # before any cutlass import

import pytest
import torch

from fused import runtime

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (kv_lora, rope, page) of k3, small and tiny
SHAPES = ((512, 64, 64), (64, 16, 16), (32, 8, 8))


def _m():
    from fused import mla_cache_append
    return mla_cache_append


@pytest.mark.parametrize("kv_lora,rope,page", SHAPES)
def test_compiles_every_variant_dtype_and_index_dtype(kv_lora, rope, page):
    m = _m()
    for dtype in ("bfloat16", "float16", "float32"):
        for table in ("int32", "int64"):
            for lens in ("int32", "int64"):
                for cfg in m.all_configs():
                    assert runtime.compile_for_cpu_check("mla_cache_append", dtype, kv_lora, rope, page, table, lens, cfg)


def test_vector_width_divides_both_halves():
    m = _m()
    assert [m.vector_width(kv, rope, 2) for kv, rope, _ in SHAPES] == [8, 8, 8]
    assert m.vector_width(512, 64, 4) == 4 and m.vector_width(36, 6, 2) == 2


def test_one_length_and_one_table_read_a_barrier_then_16_byte_copies_and_one_length_store(ptx_of):
    """K3 bf16, int32 table, int64 lengths: the length (64-bit) and the page id (32-bit) are loaded
    once, bar.sync precedes every store, the row goes as 16-byte chunks (one kv_c path, one k_rot
    path) and the advanced length is one 64-bit store."""
    ptx = ptx_of("from fused import mla_cache_append as m; "
                 "m._compile('bfloat16', 512, 64, 64, 'int32', 'int64', m.MlaCacheAppendConfig(1))")
    body = ptx[ptx.index(".entry"):]
    assert body.count("ld.global.b64") == 1 and body.count("ld.global.b32") == 1, body
    assert body.count("ld.global.v4") == 2 and body.count("st.global.v4") == 2
    assert body.count("st.global.b64") == 1 and body.count("st.global") == 3
    assert body.index("bar.sync") < body.index("st.global")


def test_rejects_bad_arguments_by_name():
    m = _m()
    B, kv, rope, page = 2, 32, 8, 8
    good = dict(kv_c=torch.zeros(B, kv, dtype=torch.bfloat16), k_rot=torch.zeros(B, rope, dtype=torch.bfloat16),
                cache=torch.zeros(4, page, kv + rope, dtype=torch.bfloat16),
                block_table=torch.zeros(B, 2, dtype=torch.int32), seq_lens=torch.zeros(B, dtype=torch.int32))
    for key, bad in (("k_rot", torch.zeros(B, rope)), ("cache", torch.zeros(4, page, kv, dtype=torch.bfloat16)),
                     ("block_table", torch.zeros(B, 2)), ("seq_lens", torch.zeros(B + 1, dtype=torch.int32)),
                     ("kv_c", torch.zeros(B, kv, dtype=torch.int32))):
        with pytest.raises((ValueError, TypeError), match=f"^{key}"):
            m.mla_cache_append(**{**good, key: bad})
    with pytest.raises(ValueError, match="CUDA"):
        m.mla_cache_append(**good)


def test_cache_key_holds_the_widths_page_and_index_dtypes_not_the_batch():
    import inspect
    assert list(inspect.signature(_m()._compile).parameters) == ["dtype", "kv_lora", "rope", "page", "table_dtype",
                                                                 "lens_dtype", "cfg"]


# ------------------------------------------------------------------------------------------ GPU
CASES = [("k3", 1, "bfloat16", "normal", ()), ("k3", 64, "bfloat16", "normal", (("cache", "large"),)),
         ("k3", 17, "float16", "range_edges", (("index", "int64"),)), ("small", 5, "float32", "nonfinite", ()),
         ("tiny", 33, "bfloat16", "normal", (("cache", "large"),)), ("tiny", 8, "float16", "outliers", ())]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config,batch,dtype,dist,knobs", CASES)
def test_every_variant_through_the_harness(config, batch, dtype, dist, knobs):
    from property_tests.harness_case import judge_case
    from verify.model.case import Case

    v = judge_case(Case("mla_cache_append", 7, batch, config, dtype, dist, 1, knobs))
    assert v.status == "pass", f"{v.stage}: {v.reason}\n  {v.repro}"


@pytest.mark.gpu
@needs_cuda
def test_halves_of_a_merged_projection_and_a_graph_replayed_step_after_step():
    """kv_c and k_rot as column slices of one [B, q_lora + kv_lora + rope] row (read in place), the
    append captured once in a CUDA graph and replayed over a page boundary: after every replay the
    cache and lengths equal the reference's run step by step; a sequence with no page left writes
    nothing under validate=False."""
    from references.mla_cache_append import mla_cache_append as ref

    m = _m()
    B, q_lora, kv, rope, page, pages = 3, 1536, 512, 64, 64, 3
    g = torch.Generator(device="cuda").manual_seed(3)
    merged = torch.randn(B, q_lora + kv + rope, generator=g, device="cuda").bfloat16()
    kv_c, k_rot = merged[:, q_lora:q_lora + kv], merged[:, q_lora + kv:]
    assert m._rows(kv_c, 8) is kv_c and m._rows(k_rot, 8) is k_rot
    cache = torch.randn(B * pages + 1, page, kv + rope, generator=g, device="cuda").bfloat16()
    table = torch.randperm(B * pages, device="cuda").view(B, pages).int()
    lens = torch.tensor([page - 2, 2 * page - 1, pages * page - 2], dtype=torch.int32, device="cuda")
    want_cache, want_lens = cache.clone(), lens.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        m.mla_cache_append(kv_c, k_rot, cache, table, lens, validate=False)         # warm-up = step 1
        with torch.cuda.graph(graph, stream=stream):
            m.mla_cache_append(kv_c, k_rot, cache, table, lens, validate=False)
    torch.cuda.current_stream().wait_stream(stream)
    ref(kv_c, k_rot, want_cache, table, want_lens, validate=False)
    for step in range(3):
        graph.replay()
        ref(kv_c, k_rot, want_cache, table, want_lens, validate=False)
        torch.cuda.synchronize()
        assert torch.equal(lens, want_lens), (step, lens, want_lens)
        assert torch.equal(cache.view(torch.int16), want_cache.view(torch.int16)), step
    assert int(lens[2]) == pages * page        # sequence 2 ran out of pages: it stopped, nothing written
