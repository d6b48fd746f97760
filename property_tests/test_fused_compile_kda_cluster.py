"""Experimental cluster variant of kda_decode (fused/kda_decode_cluster.py): every config compiles
for sm_90a without a GPU, the head count (T = 1, 2, 4, 8 -> 96, 48, 24, 12 heads) and batch are
dynamic (no recompile), it stays out of the certified `variants()`. GPU tests (skipped here): the
cluster variant against the one-CTA kernel (bitwise: same per-row code and summation orders) and the
fp64 oracle, determinism, batch invariance.
"""
from __future__ import annotations

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # before any cutlass import

import pytest
import torch

from fused import runtime

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
HEADS = {1: 96, 2: 48, 4: 24, 8: 12}               # TP degree T -> heads per rank (K3)


def _mods():
    from fused import kda_decode, kda_decode_cluster
    return kda_decode, kda_decode_cluster


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_cluster_config_compiles_at_k3_head_dim(dtype):
    _, mc = _mods()
    for cfg in mc.KdaClusterConfig.all_configs():
        assert runtime.compile_for_cpu_check("kda_decode_cluster", dtype, 128, 4, cfg) is not None


@pytest.mark.parametrize("Dh", [64, 32, 16])
def test_cluster_compiles_at_small_head_dims(Dh):
    _, mc = _mods()
    for cfg in (mc.KdaClusterConfig(2, 16), mc.KdaClusterConfig(8, 8)):
        assert runtime.compile_for_cpu_check("kda_decode_cluster", "bfloat16", Dh, 4, cfg) is not None


@pytest.mark.parametrize("T", sorted(HEADS))
def test_head_count_and_batch_do_not_recompile(T):
    """H and B are dynamic dims of the compiled kernel: every T shares one entry per config."""
    mk, mc = _mods()
    tensors = {"state": torch.empty(1, HEADS[T], 128, 128, device="meta")}
    for cfg in mk.experimental_variants(tensors, {}):
        runtime.compile_for_cpu_check("kda_decode_cluster", "bfloat16", 128, 4, cfg)
        before = runtime.cache_info()
        runtime.compile_for_cpu_check("kda_decode_cluster", "bfloat16", 128, 4, cfg)
        after = runtime.cache_info()
        assert after.misses == before.misses and after.hits == before.hits + 1


def test_cluster_configs_are_experimental_only():
    mk, mc = _mods()
    listed = mk.experimental_variants({}, {})
    assert listed == mc.KdaClusterConfig.all_configs()
    assert {c.cluster_n for c in listed} == {2, 4, 8}
    assert not set(listed) & set(mk.variants({}, {}))
    assert all(isinstance(c, mk.KdaConfig) for c in mk.variants({}, {}))
    with pytest.raises(Exception):
        mc.KdaClusterConfig(4, 8).cluster_n = 2


def test_cluster_rejects_bad_config_by_name():
    mk, mc = _mods()
    with pytest.raises(ValueError, match="^cluster_n"):
        mc.KdaDecodeCluster(runtime.cutlass_dtype("bfloat16"), 128, 4, mc.KdaClusterConfig(3, 8))
    t = torch.zeros(1)
    with pytest.raises(TypeError, match="^variant"):
        mc.launch(*([t] * 13), -5.0, 1e-6, 1e-5, variant=mk.KdaConfig(8))


# ------------------------------------------------------------------------------------------ GPU

def _inputs(B, H, Dh, seed, wd=torch.bfloat16, W=4):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, device="cuda")
    C = H * Dh
    return dict(q_raw=rn(B, C).to(wd), k_raw=rn(B, C).to(wd), v_raw=rn(B, C).to(wd),
                g_raw=rn(B, C).to(wd), beta_raw=rn(B, H).to(wd), z=rn(B, C).to(wd),
                conv_w=rn(3, C, W) / 2, conv_state=rn(B, 3, C, W - 1).to(wd), A_log=rn(H) / 2,
                dt_bias=rn(C) / 3, o_norm_w=1 + rn(Dh) / 5, state=rn(B, H, Dh, Dh) / 3,
                lower_bound=-5.0, l2_eps=1e-6, norm_eps=1e-5)


def _clone(d, f=torch.Tensor.clone):
    return {k: (f(v) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def _run(mk, inp, variant):
    a = _clone(inp)
    y = mk.kda_decode(**a, variant=variant)
    torch.cuda.synchronize()
    return y, a["state"], a["conv_state"]


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("wd", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,Dh", [(12, 128), (96, 128), (4, 32), (6, 16)])
def test_cluster_matches_one_cta_kernel_and_oracle_on_gpu(H, Dh, wd):
    """Same per-row code and the one-CTA sum order for o^2: y, state, conv_state bitwise equal to
    the certified kernel's; y also within the harness's derived bound against the fp64 oracle."""
    from references.kda import kda_decode as ref
    mk, mc = _mods()
    inp = _inputs(3, H, Dh, seed=H + Dh, wd=wd)
    one = _run(mk, inp, mk.KdaConfig.for_shape(Dh, 3 * H))
    oracle_in, base_in = _clone(inp, torch.Tensor.double), _clone(inp)
    oracle, base = ref(**oracle_in), ref(**base_in)
    for cfg in mc.KdaClusterConfig.all_configs():
        y, state, conv = _run(mk, inp, cfg)
        assert torch.equal(_bits(conv), _bits(one[2])), f"{cfg.name}: conv_state"
        assert torch.equal(_bits(state), _bits(one[1])), f"{cfg.name}: state"
        assert torch.equal(_bits(y), _bits(one[0])), f"{cfg.name}: y"
        ec = (y.double() - oracle).abs().amax(-1)
        eb = (base.double() - oracle).abs().amax(-1)
        assert bool((ec <= 2 * eb + oracle.abs().amax(-1) * 2.0 ** -7).all()), cfg.name
        assert torch.equal(_bits(conv), _bits(base_in["conv_state"])), f"{cfg.name}: conv vs reference"


@pytest.mark.gpu
@needs_cuda
def test_cluster_is_deterministic_and_batch_invariant_on_gpu():
    mk, mc = _mods()
    B, H, Dh = 5, 12, 128
    inp = _inputs(B, H, Dh, seed=5)
    for cfg in mc.KdaClusterConfig.all_configs():
        first, second = _run(mk, inp, cfg), _run(mk, inp, cfg)
        for a, b in zip(first, second):
            assert torch.equal(_bits(a), _bits(b)), f"{cfg.name}: two runs differ"
        for row in (0, 3):
            alone = _run(mk, {k: (v[row:row + 1] if isinstance(v, torch.Tensor) and v.shape[0] == B
                                  and k not in ("conv_w",) else v) for k, v in inp.items()}, cfg)
            for a, b in zip(first, alone):
                assert torch.equal(_bits(a[row:row + 1]), _bits(b)), f"{cfg.name}: row {row} alone differs"
