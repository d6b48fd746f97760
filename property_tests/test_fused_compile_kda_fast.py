"""Experimental short-chain launches of kda_decode (fused/kda_decode_fast.py): every config compiles
for sm_90a without a GPU, the head count (T = 1, 2, 4, 8 -> 96, 48, 24, 12 heads) and batch are
dynamic (no recompile), they stay out of the certified `variants()`. GPU tests (skipped here): y,
state and conv_state bitwise equal to the default kernel's on random inputs and states.
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
    from fused import kda_decode, kda_decode_fast
    return kda_decode, kda_decode_fast


def test_every_fast_config_compiles_at_k3_head_dim():
    _, mf = _mods()
    for cfg in mf.KdaFastConfig.all_configs():
        assert runtime.compile_for_cpu_check("kda_decode_fast", "bfloat16", 128, 4, cfg) is not None


@pytest.mark.parametrize("Dh", [64, 32, 16])
def test_fast_compiles_at_small_head_dims_and_fp16(Dh):
    _, mf = _mods()
    for cfg in (mf.KdaFastConfig(16, 8), mf.KdaFastConfig(8, 16, True)):
        assert runtime.compile_for_cpu_check("kda_decode_fast", "float16", Dh, 4, cfg) is not None


@pytest.mark.parametrize("T", sorted(HEADS))
def test_fast_head_count_and_batch_do_not_recompile(T):
    """H and B are dynamic dims of the compiled kernel: every T shares one entry per config."""
    mk, _ = _mods()
    tensors = {"state": torch.empty(1, HEADS[T], 128, 128, device="meta")}
    for cfg in mk.fast_variants(tensors, {}):
        runtime.compile_for_cpu_check("kda_decode_fast", "bfloat16", 128, 4, cfg)
        before = runtime.cache_info()
        runtime.compile_for_cpu_check("kda_decode_fast", "bfloat16", 128, 4, cfg)
        after = runtime.cache_info()
        assert after.misses == before.misses and after.hits == before.hits + 1


def test_fast_configs_are_experimental_only():
    mk, mf = _mods()
    listed = mk.fast_variants({}, {})
    assert listed == mf.KdaFastConfig.all_configs() and len({c.name for c in listed}) == len(listed)
    assert not set(listed) & set(mk.variants({}, {}))
    assert not set(listed) & set(mk.experimental_variants({}, {}))
    with pytest.raises(Exception):
        mf.KdaFastConfig(16, 8).lanes_per_row = 16


def test_fast_rejects_bad_config_by_name():
    mk, mf = _mods()
    dt = runtime.cutlass_dtype("bfloat16")
    with pytest.raises(ValueError, match="^lanes_per_row"):
        mf.KdaDecodeFast(dt, 128, 4, mf.KdaFastConfig(16, 12))
    with pytest.raises(ValueError, match="^num_warps"):
        mf.KdaDecodeFast(dt, 128, 4, mf.KdaFastConfig(12, 8))
    t = torch.zeros(1)
    with pytest.raises(TypeError, match="^variant"):
        mf.launch(*([t] * 13), -5.0, 1e-6, 1e-5, variant=mk.KdaConfig(8))


def _ptx_of(code: str, dump_dir) -> str:
    """PTX dumped by compiling in a fresh process (not a cache hit), as test_fused_compile_wgmma."""
    import subprocess
    import sys
    env = dict(os.environ, CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DUMP_DIR=str(dump_dir), CUTE_DSL_ARCH="sm_90a")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    return "".join(p.read_text() for p in dump_dir.glob("*.ptx"))


def test_fast_ptx_has_fewer_shuffles_and_early_epilogue_loads(tmp_path):
    """f8w16 at Dh = 128: 2 passes x 2 dots x 3 butterfly shuffles + 3 x 5 for the norms (the
    default w16 has 8 x 2 x 5 + 15 = 97), no local memory, two barriers and no global load after the
    first (the default loads z and o_norm_w after the second: one DRAM round trip at the end)."""
    code = ("from fused import runtime, kda_decode_fast as f; "
            "runtime.compile_for_cpu_check('kda_decode_fast', 'bfloat16', 128, 4, f.KdaFastConfig(16, 8))")
    ptx = _ptx_of(code, tmp_path)
    body = ptx[ptx.index(".entry"):]
    assert body.count("shfl.sync.bfly") == 2 * 2 * 3 + 3 * 5
    assert ".local" not in body
    assert body.count("bar.sync") == 2
    assert "ld.global" not in body[body.index("bar.sync"):]


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


def _run(mk, inp, variant):
    a = dict(inp, state=inp["state"].clone(), conv_state=inp["conv_state"].clone())   # updated in place
    y = mk.kda_decode(**a, variant=variant)
    torch.cuda.synchronize()
    return y, a["state"], a["conv_state"]


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("wd", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,H,Dh", [(1, 12, 128), (3, 96, 128), (8, 12, 128), (2, 24, 128),
                                    (3, 4, 64), (4, 4, 32), (2, 6, 16)])
def test_fast_is_bitwise_the_default_kernel_on_gpu(B, H, Dh, wd):
    """Same expressions, only other lanes and registers: y, state, conv_state bitwise equal to the
    certified kernel's (both the for_shape default and every KdaConfig), and rerun-deterministic."""
    mk, mf = _mods()
    inp = _inputs(B, H, Dh, seed=B * 131 + H + Dh, wd=wd)
    ref = _run(mk, inp, mk.KdaConfig.for_shape(Dh, B * H))
    for one in (_run(mk, inp, c) for c in mk.KdaConfig.all_configs()):   # the default's own claim
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(one, ref))
    cfgs = mf.KdaFastConfig.all_configs()
    if Dh < 128:   # lanes_per_row is capped at Dh/4 there: three configs cover the layouts, fewer compiles
        cfgs = [mf.KdaFastConfig(16, 8), mf.KdaFastConfig(32, 32), mf.KdaFastConfig(8, 16, True)]
    for cfg in cfgs:
        got, again = _run(mk, inp, cfg), _run(mk, inp, cfg)
        for name, a, b, c in zip(("y", "state", "conv_state"), got, ref, again):
            diff = (_bits(a) != _bits(b)).nonzero()
            assert diff.numel() == 0, (f"{cfg.name} B={B} H={H} Dh={Dh} {wd}: {name} differs from the "
                                       f"default at {diff[:4].tolist()}: {a[tuple(diff[0])].item()!r} vs "
                                       f"{b[tuple(diff[0])].item()!r}")
            assert torch.equal(_bits(a), _bits(c)), f"{cfg.name}: {name} differs between two runs"


@pytest.mark.gpu
@needs_cuda
def test_fast_takes_strided_activations_on_gpu():
    """Column slices of the merged in-projection (row stride > width), as the layer passes them."""
    mk, mf = _mods()
    B, H, Dh = 3, 12, 128
    inp = _inputs(B, H, Dh, seed=9)
    wide = torch.randn(B, 6 * H * Dh, device="cuda").to(torch.bfloat16)
    for i, k in enumerate(("q_raw", "k_raw", "v_raw", "g_raw", "z")):
        wide[:, i * H * Dh:(i + 1) * H * Dh] = inp[k]
        inp[k] = wide[:, i * H * Dh:(i + 1) * H * Dh]
    ref = _run(mk, inp, None)
    for cfg in mf.KdaFastConfig.all_configs():
        for name, a, b in zip(("y", "state", "conv_state"), _run(mk, inp, cfg), ref):
            assert torch.equal(_bits(a), _bits(b)), f"{cfg.name}: {name} (strided inputs)"
