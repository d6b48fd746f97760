"""fused/attn_res_rmsnorm.py: every static configuration compiles for sm_90a on a machine without a
GPU; the compile cache does not recompile for a new batch size; the PTX keeps the summation order and
the cluster's pushed sums; the dispatcher's picks fit the SM; the wrapper rejects bad arguments by
name. GPU numerics are in the `gpu`-marked tests (skipped here, never counted as passed).
"""
from __future__ import annotations

import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # before any cutlass import

import pytest
import torch

from fused import runtime

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ATTN_D = (7168, 256, 64)
ATTN_NBLOCKS = range(0, 9)


def _attn():
    from fused import attn_res_rmsnorm
    return attn_res_rmsnorm


def _attn_code(nb: int, cfg) -> str:
    """Code that compiles attn_res_rmsnorm at D = 7168, bf16, `nb` blocks for an AttnResConfig."""
    return f"from fused import attn_res_rmsnorm as m; m._compile('bfloat16', 7168, {nb}, m.{cfg!r})"


@pytest.mark.parametrize("D", ATTN_D)
def test_attn_res_rmsnorm_compiles_every_variant(D):
    m = _attn()
    for cfg in m.AttnResConfig.all_configs(D):
        for nb in (0, 8):
            assert runtime.compile_for_cpu_check("attn_res_rmsnorm", "bfloat16", D, nb, cfg) is not None


@pytest.mark.parametrize("n_blocks", ATTN_NBLOCKS)
def test_attn_res_rmsnorm_compiles_every_source_count(n_blocks):
    m = _attn()
    for dtype in ("bfloat16", "float16"):
        cfg = m.AttnResConfig.for_shape(7168)
        assert runtime.compile_for_cpu_check("attn_res_rmsnorm", dtype, 7168, n_blocks, cfg) is not None


def test_attn_res_rmsnorm_cache_key_has_no_batch_dimension(ir_of):
    """The batch is a dynamic dim: the compile key holds only dtype, D, n_blocks and variant, and the
    kernel is compiled for any batch: prefix / delta / out are (?, D) and blocks (?, ?, D) in its host IR."""
    import inspect
    m = _attn()
    assert list(inspect.signature(m._compile).parameters) == ["dtype", "D", "n_blocks", "cfg"]
    ir = ir_of("from fused import attn_res_rmsnorm as m; m._compile('bfloat16', 256, 3, m.AttnResConfig.for_shape(256))")
    assert '"(?,256):(256,1)"' in ir and '"(?,?,256):' in ir


@pytest.mark.parametrize("threads,cluster,nb", [(448, 2, 7), (224, 4, 8), (448, 1, 5), (256, 1, 3)])
def test_attn_res_rmsnorm_writes_the_state_first_and_sums_thread_minor(ptx_of, threads, cluster, nb):
    """The state (prefix / block slot) is stored before the
    first CTA barrier, so its writes overlap the reductions; and the block sums' buffer is thread-minor:
    each thread's 2S partials go to red[k, tid] at byte offsets k * threads * 4 from its own word. The
    column-major layout (offsets k * 4 from tid * 2S * 4) put gcd(2S, 32) lanes in one bank, 16 at
    n_blocks = 7, and cost 1.1-2 us."""
    ptx = ptx_of(_attn_code(nb, _attn().AttnResConfig(threads, cluster)))
    body = ptx[ptx.index(".entry"):]
    first_bar = body.index("bar.sync")
    head = body[:first_bar]
    assert head.count("st.global") >= 2 and "st.global" in body[first_bar:]     # state first, out last
    S2 = 2 * (nb + 1)
    offsets = {int(o or 0) for o in re.findall(r"st\.shared\.b32\s+\[%r\d+(?:\+(\d+))?\]", head)}
    assert offsets == {k * threads * 4 for k in range(S2)}, sorted(offsets)


@pytest.mark.parametrize("threads,cluster,nb", [(224, 4, 8), (448, 2, 5), (128, 8, 3)])
def test_attn_res_rmsnorm_cluster_pushes_its_partial_sums(ptx_of, threads, cluster, nb):
    """A cluster's partial sums travel by st.async (each CTA pushes its 2S + 1 sums into every CTA's
    shared memory, itself included, each store completing its bytes on the receiver's mbarrier) and
    are read locally once the CTA's own mbarrier completes: no DSMEM load, one cluster barrier (at
    entry, arrived relaxed after the mbarriers' init and its fence, waited before the first push), two
    mbarrier waits with cluster-scope acquire, two CTA barriers, and no closing barrier."""
    ptx = ptx_of(_attn_code(nb, _attn().AttnResConfig(threads, cluster)))
    body = ptx[ptx.index(".entry"):]
    S2 = 2 * (nb + 1)
    assert "ld.shared::cluster" not in body and "st.shared::cluster" not in body
    assert body.count("st.async.shared::cluster.mbarrier::complete_tx::bytes") == cluster * (S2 + 1)
    assert body.count("barrier.cluster.wait") == 1 and body.count("barrier.cluster.arrive.relaxed") == 1
    assert body.count("barrier.cluster.arrive") == 1
    assert body.index("fence.mbarrier_init") < body.index("barrier.cluster.arrive.relaxed") < body.index("bar.sync")
    assert body.index("barrier.cluster.wait") < body.index("mbarrier.arrive.expect_tx")   # arrives after it
    assert body.count("mbarrier.arrive.expect_tx") == 2 and body.count("mbarrier.init") == 2
    assert body.index("barrier.cluster.wait") < body.index("st.async")        # waits before a push
    waits = [m.start() for m in re.finditer(r"mbarrier\.try_wait\.parity\.acquire\.cluster", body)]
    assert len(waits) == 2 and body.count("mbarrier.try_wait") == 2
    assert body.count("bar.sync") == 2
    assert "st.global" in body[waits[-1]:]                                    # out written after the last
    first_reduction = body[waits[0]:]
    assert first_reduction.count("shfl.sync.idx") >= S2     # the rank sums shared by shuffles, not by smem


def test_attn_res_rmsnorm_cluster_picks_fit_two_ctas_per_sm(ptx_of, ptxas_regs, ctas_per_sm):
    """Up to B = 32 the dispatcher spreads a row over a 4-CTA cluster: 128 CTAs at B = 32. With one CTA
    per SM the H200 holds only 30 such clusters at once (Nsight Compute's "Max Active Clusters";
    on the H200 the push kernel at 134 registers took 9.1 us at B = 32, 8 blocks, against 6.4 for the last
    certified one), so the pick must fit 2 CTAs per SM, with no spills."""
    assert ctas_per_sm(134, 7) == 1 and ctas_per_sm(115, 7) == 2
    assert ctas_per_sm(168, 4) == 3 and ctas_per_sm(194, 4) == 2
    for nb in (6, 8):
        cfg = _attn().AttnResConfig.for_shape(7168, 16, 32, nb)
        assert cfg.cluster_n == 4
        regs, spills = ptxas_regs(ptx_of(_attn_code(nb, cfg)))
        assert ctas_per_sm(regs, cfg.num_threads // 32) >= 2 and spills == 0, (nb, regs, spills)


def test_attn_res_rmsnorm_dispatch_by_blocks():
    """The measured rule (H200, D = 7168, with the pushed cluster sums): one CTA of 448 threads
    for 0 blocks at every B; 4 x 224 up to B = 32 and 2 x 448 beyond otherwise; never a one-CTA launch
    over 512 threads (fp32 rows)."""
    A = _attn().AttnResConfig
    one, c4, c2 = A(448, 1), A(224, 4), A(448, 2)
    for B in (1, 8, 16, 31):
        assert A.for_shape(7168, 16, B, 0) == one
        assert all(A.for_shape(7168, 16, B, nb) == c4 for nb in range(1, 9))
    for B in (32, 48, 64):
        assert A.for_shape(7168, 16, B, 0) == one
        assert all(A.for_shape(7168, 16, B, nb) == (c4 if B == 32 else c2) for nb in range(1, 9))
    assert all(A.for_shape(7168, 32, B, nb).num_threads <= 512 for B in range(1, 65) for nb in range(9))


def test_attn_res_rmsnorm_rejects_bad_arguments_by_name():
    m = _attn()
    B, D = 2, 64
    t = lambda *s: torch.zeros(*s, dtype=torch.bfloat16)
    good = dict(prefix=t(B, D), delta=t(B, D), blocks=t(B, 9, D), res_norm_w=t(D), res_proj_w=t(D),
                norm_w=t(D), n_blocks=2, block_write=-1, eps=1e-5, norm_eps=1e-5)
    for key, bad, word in (("n_blocks", 9, "n_blocks"), ("block_write", 9, "block_write"),
                           ("delta", t(B, D + 8), "delta"), ("norm_w", t(D).float(), "norm_w")):
        with pytest.raises((ValueError, TypeError), match=f"^{word}"):
            m.attn_res_rmsnorm(**{**good, key: bad})


def test_attn_res_rmsnorm_configs_are_frozen_and_cover_the_dispatch():
    a = _attn()
    for D in ATTN_D:        # every batch's pick is a certified variant
        for bits in (16, 32):
            picks = {a.AttnResConfig.for_shape(D, bits, B, nb) for B in range(1, 65) for nb in range(9)}
            assert picks <= set(a.AttnResConfig.all_configs(D, bits)), (D, bits)
    with pytest.raises(Exception):
        a.AttnResConfig(128).num_threads = 64


# ------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("nb,bw", [(0, -1), (3, 3), (8, -1)])
def test_attn_res_rmsnorm_matches_oracle_on_gpu(nb, bw):
    from references.attn_res import attn_res_rmsnorm as ref
    m = _attn()
    g = torch.Generator(device="cuda").manual_seed(nb)
    B, D = 5, 7168
    rn = lambda *s: torch.randn(*s, generator=g, device="cuda")
    inp = dict(prefix=rn(B, D).bfloat16(), delta=rn(B, D).bfloat16(), blocks=rn(B, 9, D).bfloat16(),
               res_norm_w=(1 + 0.2 * rn(D)).bfloat16(), res_proj_w=(rn(D) / 30).bfloat16(),
               norm_w=(1 + 0.2 * rn(D)).bfloat16(), n_blocks=nb, block_write=bw, eps=1e-5, norm_eps=1e-5)
    cl = lambda d, f: {k: (f(v) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
    o_in, b_in, f_in = cl(inp, torch.Tensor.double), cl(inp, torch.Tensor.clone), cl(inp, torch.Tensor.clone)
    oracle, base, out = ref(**o_in), ref(**b_in), m.attn_res_rmsnorm(**f_in)
    ec = (out.double() - oracle).abs().amax(-1)
    eb = (base.double() - oracle).abs().amax(-1)
    assert bool((ec <= 2 * eb + oracle.abs().amax(-1) * 2.0 ** -7).all())
    assert torch.equal(f_in["prefix"], b_in["prefix"]) and torch.equal(f_in["blocks"], b_in["blocks"])
