"""The fused mla_decode_attn on a CPU-only machine: every static configuration compiles for sm_90a,
the dispatcher's picks are certified variants, a new batch size, length or split count reuses the
compiled kernels, bad lengths are one-line errors before any launch, and the op's draw reaches the
kernel's edges (lengths 1, n_q, page - 1, page, page + 1, split size + 1, past 2^16 slots).
Numerics on the H200: property_tests/test_mla_decode_attn_gpu.py."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

from references.config import get_config
from verify.model.case import Case
from verify.ops.mla import LARGE_CACHE_SLOTS, make_decode_attn_inputs

fm = pytest.importorskip("fused.mla_decode_attn", reason="needs the fused package")


def _needs_dsl():
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")


def _static_keys(config: str, dtype: str, path: str = fm.PATH) -> list[tuple]:
    """Every compile key launch() can ask for at this config and dtype: m_atoms 1..4 (rows per CTA
    <= 64) x direct / split, and the combine."""
    cfg = get_config(config)
    D, C, page = cfg.kv_lora_rank, cfg.cache_dim, cfg.page_size
    path = "whole" if D <= 128 and path == "split" else path      # split needs several warps per atom
    return ([("partial", dtype, D, C, page, m, 32, direct, path) for m in (1, 2, 3, 4) for direct in (True, False)]
            + [("combine", dtype, D)])


@pytest.mark.parametrize("config", ["tiny", "small", "k3"])
@pytest.mark.parametrize("dtype", list(fm.DTYPES))
def test_every_static_configuration_compiles_for_sm90a(config, dtype):
    _needs_dsl()
    from fused import runtime
    for key in _static_keys(config, dtype):
        assert runtime.compile_for_cpu_check("mla_decode_attn", *key) is not None, key


@pytest.mark.parametrize("path", ["whole", "split", "split_ldsm"])
def test_every_path_compiles_at_k3(path):
    """The trial paths (not dispatched; the GPU tests check and time them) compile too."""
    _needs_dsl()
    from fused import runtime
    cfg = get_config("k3")
    for direct in (True, False):
        key = ("partial", "bfloat16", cfg.kv_lora_rank, cfg.cache_dim, cfg.page_size, 3, 32, direct, path)
        assert runtime.compile_for_cpu_check("mla_decode_attn", *key) is not None


def test_dispatcher_keys_are_the_compiled_ones_and_ignore_batch_and_length():
    """Over K3's per-rank heads, drafts 1..8, B = 1..64 and block tables of 1..2048 pages, launch asks
    only for keys of _static_keys: batch, lengths and the split count are launch arguments."""
    keys = set()
    for config in ("tiny", "small", "k3"):
        cfg = get_config(config)
        allowed = set(_static_keys(config, "bfloat16"))
        for H in (96, 12, 6, 16, 1):
            for n_q in range(1, 9):
                for B in (1, 2, 5, 17, 64):
                    for pages in (1, 4, 63, 2048):
                        part, S, comb = fm.plan(B, n_q, H, cfg.cache_dim, cfg.kv_lora_rank, cfg.page_size, pages,
                                                "bfloat16", 132)
                        assert part in allowed and S >= 1 and (comb is None) == (S == 1)
                        assert comb is None or comb in allowed
                        m_atoms = part[5]
                        assert 16 * m_atoms * -(-(n_q * H) // (16 * m_atoms)) >= n_q * H
                        keys.add(part)
    assert len(keys) <= 3 * 8 and {k[-1] for k in keys} <= {fm.PATH, "whole"}


def test_a_new_batch_size_or_length_is_a_cache_hit():
    _needs_dsl()
    from fused import runtime
    cfg = get_config("tiny")
    part, _, _ = fm.plan(3, 2, 16, cfg.cache_dim, cfg.kv_lora_rank, cfg.page_size, 12, "bfloat16", 132)
    fm._compile(*part)
    before = runtime.cache_info()
    for B, pages in ((1, 12), (7, 12), (3, 400)):
        again, _, _ = fm.plan(B, 2, 16, cfg.cache_dim, cfg.kv_lora_rank, cfg.page_size, pages, "bfloat16", 132)
        if again == part:
            fm._compile(*again)
    after = runtime.cache_info()
    assert after.misses == before.misses and after.hits > before.hits


def test_every_variant_is_certified_and_covers_direct_and_combine():
    cfgs = fm.variants({}, {})
    assert cfgs == fm.all_configs() and len({c.name for c in cfgs}) == len(cfgs)
    assert {c.m_atoms for c in cfgs} == {1, 2, 3, 4}
    assert any(c.splits == 1 for c in cfgs) and any(c.splits > 1 for c in cfgs)
    assert {c.path for c in cfgs} == {fm.PATH}
    assert fm.PATH not in {c.path for c in fm.trial_configs()} and len(fm.trial_configs()) == 2 * len(cfgs)


@pytest.mark.parametrize("lens,n_q,match", [
    ([5, 2, 9], 3, r"sequence 1 has length 2, shorter than its 3 query tokens"),
    ([0], 1, r"sequence 0 has length 0, shorter than its 1 query tokens"),
    ([5, 70], 1, r"sequence 1 has length 70, which needs 9 pages; its block_table row has 8"),
])
def test_bad_lengths_are_one_line_errors_before_launch(lens, n_q, match):
    """A length shorter than the draft (or past its block-table row) is a ValueError naming the
    sequence, raised by the host check that runs before any launch."""
    cache = torch.zeros(20, 8, 40)
    table = torch.arange(len(lens) * 8, dtype=torch.int32).view(len(lens), 8) % 20
    with pytest.raises(ValueError, match=match) as e:
        fm._check_lengths(n_q, cache, table, torch.tensor(lens, dtype=torch.int32))
    assert "\n" not in str(e.value)


def test_a_page_id_outside_the_cache_is_an_error():
    table = torch.tensor([[0, 1, -1], [2, 25, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"page id 25 at \[1, 1\] is outside the cache of 20 pages"):
        fm._check_lengths(1, torch.zeros(20, 8, 40), table, torch.tensor([9, 16], dtype=torch.int32))
    fm._check_lengths(1, torch.zeros(20, 8, 40), table, torch.tensor([9, 8], dtype=torch.int32))   # pad unread


def test_cpu_tensors_are_refused_with_the_reason():
    inp = make_decode_attn_inputs(Case("mla_decode_attn", 1, 2, "tiny", "bfloat16", "normal", 1))
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        fm.mla_decode_attn(**inp.tensors, **inp.params)


def test_the_draw_reaches_the_kernels_edges():
    """Over the draw's seeds: n_q 1..8, lengths 1, n_q, page - 1, page, page + 1 and 2 pages + 1 (the
    last split holding one slot at S = 2: a page-aligned split size + 1); knob context='long' puts
    every page past slot 2^16 and, at tiny, a sequence past 2^16 slots."""
    page = get_config("tiny").page_size
    seen_q, seen_len, draft_len = set(), set(), set()
    for seed in range(120):
        inp = make_decode_attn_inputs(Case("mla_decode_attn", seed, 8, "tiny", "bfloat16", "normal", 1))
        n_q = inp.tensors["q_abs"].shape[1]
        lens = inp.tensors["seq_lens"].tolist()
        seen_q.add(n_q)
        seen_len.update(lens)
        draft_len.update(n_q for n in lens if n == n_q)
        assert min(lens) >= n_q
    assert seen_q == set(range(1, 9)) and draft_len == set(range(1, 9))
    assert {1, page - 1, page, page + 1, 2 * page + 1} <= seen_len
    long = make_decode_attn_inputs(Case("mla_decode_attn", 3, 5, "tiny", "bfloat16", "normal", 1,
                                        (("context", "long"),)))
    t = long.tensors
    assert int(t["seq_lens"][0]) > 1 << 16
    assert int(t["block_table"][t["block_table"] >= 0].min()) * page >= LARGE_CACHE_SLOTS
    assert t["cache"].shape[0] * page > (1 << 16) + int(t["seq_lens"][0])


def test_custom_op_registers_under_project_namespace():
    fm._custom_op()
    assert hasattr(torch.ops.verify_kernels, "mla_decode_attn")
