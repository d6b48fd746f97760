"""The fused wrappers at a misaligned base (guard:misaligned_inputs), without a GPU: each launch()
runs with its compiled kernel replaced by a stand-in that checks what the TVM-FFI call checks (a
16-byte aligned base wherever the kernel was compiled with align=16) and computes the reference
on the tensors it is handed. A view one element past an aligned base is copied to fresh storage,
an in-place update reaches the caller's tensor, and aligned tensors go to the kernel uncopied.
The kernels themselves at a misaligned base: `verify-kernels run --candidate fused` on a GPU."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")

from verify.model.case import Case  # noqa: E402
from verify.judge.placement import place  # noqa: E402
from verify.ops.registry import get_op  # noqa: E402


def _aligned(**tensors):
    bad = [f"{k} at {t.data_ptr() % 16}" for k, t in tensors.items() if t.data_ptr() % 16]
    assert not bad, f"misaligned base handed to a kernel compiled with align=16: {', '.join(bad)}"


def _mla_cache_write(static, seen):
    from references.mla import mla_cache_write

    def kernel(latent, cache2d, slot_mapping):
        _aligned(latent=latent, cache=cache2d)
        seen.update(latent=latent.data_ptr(), cache=cache2d.data_ptr())
        mla_cache_write(latent, cache2d.view(1, *cache2d.shape), slot_mapping)
    return kernel


def _kda_decode(static, seen):
    from references.kda import kda_decode

    def kernel(q, k, v, g, beta, z, conv_w, conv_state, A_log, dt_bias, o_norm_w, state, y, lb, l2, ne, grid):
        _aligned(state=state, **({"conv_w": conv_w} if conv_w.shape[-1] % 4 == 0 else {}))
        seen.update(state=state.data_ptr(), conv_w=conv_w.data_ptr())
        y.copy_(kda_decode(q, k, v, g, beta, z, conv_w, conv_state, A_log, dt_bias, o_norm_w, state, lb, l2, ne))
    return kernel


def _attn_res_rmsnorm(static, seen):
    from references.attn_res import attn_res_rmsnorm
    n_blocks = static[2]

    def kernel(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, out, block_write, eps, norm_eps):
        _aligned(prefix=prefix, delta=delta, blocks=blocks, res_norm_w=res_norm_w, res_proj_w=res_proj_w,
                 norm_w=norm_w)
        seen.update(prefix=prefix.data_ptr(), delta=delta.data_ptr(), blocks=blocks.data_ptr())
        out.copy_(attn_res_rmsnorm(prefix, delta, blocks, res_norm_w, res_proj_w, norm_w, n_blocks, block_write,
                                   eps, norm_eps))
    return kernel


def _skinny_gemm(static, seen):
    from references.gemm import skinny_gemm

    def kernel(x, w, out):
        _aligned(x=x, w=w, out=out)
        seen.update(x=x.data_ptr(), w=w.data_ptr())
        out.copy_(skinny_gemm(x, w))
    return kernel


def _mxfp4_dequant(static, seen):
    from references.mxfp4 import mxfp4_dequant

    def kernel(words, scale, out):                  # flat: 32-bit words of codes, scale bytes, out
        _aligned(packed=words, out=out)
        seen.update(packed=words.data_ptr())
        out.copy_(mxfp4_dequant(words.view(torch.uint8).view(-1, 16), scale.view(-1, 1), static[0]).view(-1))
    return kernel


def _launch(op_name, t, p, monkeypatch, seen):
    """The wrapper's launch() on tensors `t`, its kernel replaced; (outputs, state) it leaves."""
    import importlib

    mod = importlib.import_module(f"fused.{op_name}")
    stand_in = {"mla_cache_write": _mla_cache_write, "kda_decode": _kda_decode,
                "attn_res_rmsnorm": _attn_res_rmsnorm, "skinny_gemm": _skinny_gemm,
                "mxfp4_dequant": _mxfp4_dequant}[op_name]
    monkeypatch.setattr(mod, "_compile", lambda *static: stand_in(static, seen))
    if op_name == "mla_cache_write":
        mod.launch(t["latent"], t["cache"], t["slot_mapping"])
        return {"cache": t["cache"]}
    if op_name == "kda_decode":
        y = torch.empty_like(t["q_raw"])
        mod.launch(*(t[k] for k in ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z", "conv_w", "conv_state",
                                    "A_log", "dt_bias", "o_norm_w", "state")), y,
                   p["lower_bound"], p["l2_eps"], p["norm_eps"], variant=mod.KdaConfig())
        return {"y": y, "state": t["state"], "conv_state": t["conv_state"]}
    if op_name == "attn_res_rmsnorm":
        out = torch.empty_like(t["prefix"])
        mod.launch(*(t[k] for k in ("prefix", "delta", "blocks", "res_norm_w", "res_proj_w", "norm_w")), out,
                   p["n_blocks"], p["block_write"], p["eps"], p["norm_eps"])
        return {"out": out, "prefix": t["prefix"], "blocks": t["blocks"]}
    if op_name == "mxfp4_dequant":
        w = torch.empty(t["packed"].shape[0], t["packed"].shape[1] * 2, dtype=getattr(torch, p["out_dtype"]))
        mod.launch(t["packed"], t["scale"], w, variant=mod.Mxfp4DequantConfig())
        return {"w": w}
    out = torch.empty(t["x"].shape[0], t["w"].shape[0], dtype=t["x"].dtype)
    mod.launch(t["x"], t["w"], out, variant=mod.SkinnyGemmConfig(1, mod._n_per_cta(t["w"].shape[0], 1)))
    return {"y": out}


@pytest.mark.parametrize("op_name", ["mla_cache_write", "kda_decode", "attn_res_rmsnorm", "skinny_gemm",
                                     "mxfp4_dequant"])
def test_a_misaligned_base_reaches_the_kernel_aligned_and_state_comes_back(op_name, monkeypatch):
    op = get_op(op_name)
    inputs = op.make_inputs(Case(op_name, 5, 3, op.configs[0], op.dtypes[0], op.dists[0], 1))
    aligned = {k: place(k, v, "cpu").view for k, v in inputs.tensors.items()}
    odd = {k: place(k, v, "cpu", offset=1).view for k, v in inputs.tensors.items()}
    assert all(v.data_ptr() % 16 == 0 for v in aligned.values())
    seen: dict[str, int] = {}
    want = _launch(op_name, aligned, inputs.params, monkeypatch, seen)
    assert all(ptr in {t.data_ptr() for t in aligned.values()} for ptr in seen.values()), \
        f"{op_name}: an aligned tensor was copied before the kernel: {seen}"
    seen.clear()
    got = _launch(op_name, odd, inputs.params, monkeypatch, seen)
    # outputs, and the state read back from the caller's misaligned tensors
    for name in want:
        assert torch.equal(got[name], want[name]), f"{op_name}: {name} differs at a misaligned base"
    assert not op.state or any(not torch.equal(want[s], inputs.tensors[s]) for s in op.state), \
        f"{op_name}: the case updates no state, so the write-back is not tested"


def test_skinny_gemm_writes_a_misaligned_out_through_an_aligned_copy(monkeypatch):
    """out= one element past an aligned base (guard:misaligned_inputs' second run): the kernel gets
    aligned storage and the caller's out gets the product."""
    import fused.skinny_gemm as mod
    op = get_op("skinny_gemm")
    t = op.make_inputs(Case("skinny_gemm", 5, 3, op.configs[0], op.dtypes[0], op.dists[0], 1)).tensors
    seen: dict[str, int] = {}
    monkeypatch.setattr(mod, "_compile", lambda *static: _skinny_gemm(static, seen))
    out = place("y", torch.empty(t["x"].shape[0], t["w"].shape[0], dtype=t["x"].dtype), "cpu", poison=True,
                offset=1).view
    assert out.data_ptr() % 16
    mod.launch(t["x"], t["w"], out, variant=mod.SkinnyGemmConfig(1, mod._n_per_cta(t["w"].shape[0], 1)))
    from references.gemm import skinny_gemm
    assert torch.equal(out, skinny_gemm(t["x"], t["w"]))
