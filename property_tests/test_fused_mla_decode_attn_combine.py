"""fused/mla_decode_attn_combine.py: the wide LSE combine of mla_decode_attn's split partials. On the CPU every
configuration the op can ask for compiles for sm_90a; on the H200 (`@pytest.mark.gpu`) it must give
fused/mla_decode_attn_split.py Combine's bits (o and lse) on partials with -inf splits and rows with no
mass, at split counts up to past the SM count, and its time beside Combine's is printed: the evidence
for making it the op's combine."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

from references.config import get_config

DTYPES = ("bfloat16", "float16")


def _needs_dsl():
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")


@pytest.mark.parametrize("config", ["tiny", "small", "k3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_configuration_compiles_for_sm90a(config, dtype):
    _needs_dsl()
    from fused import runtime

    D = get_config(config).kv_lora_rank
    assert runtime.compile_for_cpu_check("mla_decode_attn_combine", dtype, D, 4) is not None


def _partials(B: int, S: int, R: int, D: int, seed: int):
    """fp32 partials as the split kernel leaves them: lse in a wide range, some splits empty (-inf, o = 0),
    and row 0 of sequence 0 empty in every split (no mass)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    po = torch.randn(B, S, R, D, generator=g, device="cuda")
    pl = torch.randn(B, S, R, generator=g, device="cuda") * 8
    empty = torch.rand(B, S, R, generator=g, device="cuda") < 0.2
    pl[empty], po[empty] = float("-inf"), 0.0
    pl[0, :, 0], po[0, :, 0] = float("-inf"), 0.0
    return po, pl


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,S,R,D", [(1, 1, 12, 512), (1, 2, 6, 512), (2, 7, 96, 512), (1, 33, 72, 512),
                                     (1, 132, 12, 512), (3, 300, 8, 512), (4, 5, 16, 64), (2, 9, 16, 32)])
def test_wide_combine_gives_combines_bits(dtype, B, S, R, D):
    from fused.mla_decode_attn import _compile
    from fused.mla_decode_attn_combine import combine

    po, pl = _partials(B, S, R, D, seed=B * 1000 + S)
    wd = getattr(torch, dtype)
    want_o, want_l = torch.empty(B, R, D, dtype=wd, device="cuda"), torch.empty(B, R, device="cuda")
    got_o, got_l = torch.full_like(want_o, 7.0), torch.full_like(want_l, 7.0)
    _compile("combine", dtype, D)(po, pl, want_o, want_l)
    combine(po, pl, got_o, got_l)
    torch.cuda.synchronize()
    nan = torch.isnan(want_o)
    assert torch.equal(nan, torch.isnan(got_o))                                # the rows with no mass
    assert torch.equal(want_o[~nan].view(torch.int16), got_o[~nan].view(torch.int16))    # the rest, bit for bit
    assert torch.equal(want_l.view(torch.int32), got_l.view(torch.int32))
    assert bool(torch.isnan(got_o[0, 0]).all()) and float(got_l[0, 0]) == float("-inf")


def _us(fn) -> float:
    from property_tests.gpu_timing import graph_us

    fn()                                        # compiles, outside the capture
    torch.cuda.synchronize()
    return graph_us(fn)


@pytest.mark.gpu
@needs_gpu
def test_combine_timing_table():
    """us per combine (CUDA graph replays) for T = 8's 12 rows and T = 1's 96 at B = 1 and 64, over split
    counts the dispatcher picks for long contexts: Combine, then the wide one at 4 and 8 warps."""
    from fused.mla_decode_attn import _compile
    from fused.mla_decode_attn_combine import combine

    print("\nB R S | Combine | wide x4 | wide x8 (us)")
    for B, R in ((1, 12), (1, 96), (64, 12)):
        for S in (4, 33, 132, 264):
            if B * S * R * 512 * 4 > 4 << 30:
                continue
            po, pl = _partials(B, S, R, 512, seed=S)
            o, lse = torch.empty(B, R, 512, dtype=torch.bfloat16, device="cuda"), torch.empty(B, R, device="cuda")
            old = _us(lambda: _compile("combine", "bfloat16", 512)(po, pl, o, lse))
            w4 = _us(lambda: combine(po, pl, o, lse, 4))
            w8 = _us(lambda: combine(po, pl, o, lse, 8))
            print(f"{B} {R} {S} | {old:.1f} | {w4:.1f} | {w8:.1f}")
