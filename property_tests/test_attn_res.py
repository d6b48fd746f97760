"""What is special to AttnRes: the online softmax equals the direct one, and the fused decode op
reproduces the HF layer wiring (kimi-k3-math §3.2) across block boundaries, bit for bit."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from references.attn_res import (allreduce_attn_res_rmsnorm, attn_res_mix, attn_res_mix_online,
                                 attn_res_rmsnorm, fold_partials)
from references.primitives import linear, rms_norm

EPS = 1e-5



def _sources(seed, B, S, D, dtype):
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp2(torch.randint(-3, 4, (1, S, 1), generator=g).double())
    return (torch.randn(B, S, D, generator=g, dtype=torch.float64) * scales).to(dtype), g


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 4), S=st.integers(1, 9), D=st.sampled_from([8, 64, 256]))
def test_online_softmax_equals_direct_in_float64(seed, B, S, D):
    src, g = _sources(seed, B, S, D, torch.float64)
    norm_w = 1 + 0.1 * torch.randn(D, generator=g, dtype=torch.float64)
    proj_w = torch.randn(D, generator=g, dtype=torch.float64) * 4 / D ** 0.5     # sharp softmax too
    direct = attn_res_mix(src, norm_w, proj_w, EPS)
    online = attn_res_mix_online(src, norm_w, proj_w, EPS)
    torch.testing.assert_close(online, direct, rtol=1e-12, atol=1e-12 * float(src.abs().max()))


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), S=st.integers(1, 9))
def test_online_softmax_within_one_ulp_in_bf16(seed, S):
    src, g = _sources(seed, 3, S, 64, torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
    proj_w = (torch.randn(64, generator=g) / 4).bfloat16()
    direct = attn_res_mix(src, norm_w, proj_w, EPS).double()
    online = attn_res_mix_online(src, norm_w, proj_w, EPS).double()
    ulp = 2.0 ** (torch.floor(torch.log2(direct.abs().amax(-1, keepdim=True).clamp_min(1e-30))) - 7)
    assert bool(((online - direct).abs() <= ulp).all())


def test_single_source_is_the_identity():
    src, g = _sources(1, 4, 1, 32, torch.bfloat16)
    w = torch.randn(32, generator=g).bfloat16()
    assert torch.equal(attn_res_mix(src, w, w, EPS), src[:, 0])


def _hf_wiring(emb, weights, n_layers, block, sublayer):
    """kimi-k3-math §3.2, verbatim order: returns the normed inputs of every sub-layer."""
    blocks, h, fed = [], emb, []
    for l in range(n_layers):
        prefix = h
        if blocks:
            h = attn_res_mix(torch.stack(blocks + [prefix], 1), weights["an"], weights["ap"], EPS)
        if l % block == 0:
            blocks.append(prefix)
            prefix = None
        fed.append(rms_norm(h, weights["ln1"], EPS))
        a = sublayer(fed[-1], 0, l)
        prefix = a if prefix is None else prefix + a
        h = attn_res_mix(torch.stack(blocks + [prefix], 1), weights["mn"], weights["mp"], EPS)
        fed.append(rms_norm(h, weights["ln2"], EPS))
        prefix = prefix + sublayer(fed[-1], 1, l)
        h = prefix
    return fed


def _fused_wiring(emb, weights, n_layers, block, sublayer):
    """The same layers with the fused op: state prefix/blocks, one call per sub-layer input."""
    B, D = emb.shape
    prefix, blocks = torch.zeros_like(emb), torch.full((B, 8, D), 7.0, dtype=emb.dtype)  # 7: must be ignored
    n_blocks, delta, fed = 0, emb, []
    for l in range(n_layers):
        write = n_blocks if l % block == 0 else -1
        fed.append(attn_res_rmsnorm(prefix, delta, blocks, weights["an"], weights["ap"], weights["ln1"],
                                    n_blocks=n_blocks, block_write=write, eps=EPS, norm_eps=EPS))
        n_blocks += write >= 0
        a = sublayer(fed[-1], 0, l)
        fed.append(attn_res_rmsnorm(prefix, a, blocks, weights["mn"], weights["mp"], weights["ln2"],
                                    n_blocks=n_blocks, block_write=-1, eps=EPS, norm_eps=EPS))
        delta = sublayer(fed[-1], 1, l)
    return fed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("block", [1, 2, 3])
def test_fused_op_reproduces_the_layer_wiring_across_block_boundaries(dtype, block):
    g = torch.Generator().manual_seed(block)
    B, D, n_layers = 3, 32, 7
    w = {k: (1 + 0.2 * torch.randn(D, generator=g)).to(dtype) for k in ("an", "mn", "ln1", "ln2")}
    w.update({k: (torch.randn(D, generator=g) / 2).to(dtype) for k in ("ap", "mp")})
    proj = torch.randn(2, n_layers, D, D, generator=g).to(dtype) / D ** 0.5
    sublayer = lambda x, kind, l: linear(x, proj[kind, l])          # noqa: E731 - a stand-in attn/MLP
    emb = torch.randn(B, D, generator=g).to(dtype)
    hf, fused = _hf_wiring(emb, w, n_layers, block, sublayer), _fused_wiring(emb, w, n_layers, block, sublayer)
    for i, (a, b) in enumerate(zip(hf, fused)):
        assert torch.equal(a, b), f"sub-layer input {i} (layer {i // 2}) differs"


def test_allreduce_equals_single_delta_of_the_declared_fold():
    g = torch.Generator().manual_seed(0)
    B, D = 4, 64
    deltas = torch.randn(5, B, D, generator=g).bfloat16()
    args = dict(blocks=torch.randn(B, 8, D, generator=g).bfloat16(), res_norm_w=torch.ones(D).bfloat16(),
                res_proj_w=torch.randn(D, generator=g).bfloat16() / 8, norm_w=torch.ones(D).bfloat16(),
                n_blocks=3, block_write=3, eps=EPS, norm_eps=EPS)
    prefix = torch.randn(B, D, generator=g).bfloat16()
    p1, p2, b2 = prefix.clone(), prefix.clone(), args["blocks"].clone()
    out1 = allreduce_attn_res_rmsnorm(p1, deltas, **args)
    out2 = attn_res_rmsnorm(p2, fold_partials(deltas), **{**args, "blocks": b2})
    assert torch.equal(out1, out2) and torch.equal(p1, p2) and torch.equal(args["blocks"], b2)
    assert not bool(p1.any()), "a block write resets the prefix to 0"
    assert torch.equal(args["blocks"][:, 3], prefix + fold_partials(deltas))


def _op_args(B=2, D=16, dtype=torch.bfloat16):
    return dict(prefix=torch.zeros(B, D, dtype=dtype), delta=torch.ones(B, D, dtype=dtype),
                blocks=torch.zeros(B, 8, D, dtype=dtype), res_norm_w=torch.ones(D, dtype=dtype),
                res_proj_w=torch.ones(D, dtype=dtype), norm_w=torch.ones(D, dtype=dtype),
                n_blocks=2, block_write=-1, eps=EPS, norm_eps=EPS)


@pytest.mark.parametrize("change, error, arg", [
    ({"n_blocks": 9}, ValueError, "n_blocks"),
    ({"block_write": 8}, ValueError, "block_write"),
    ({"block_write": -2}, ValueError, "block_write"),
    ({"delta": torch.ones(2, 17, dtype=torch.bfloat16)}, ValueError, "delta"),
    ({"delta": torch.ones(2, 16, dtype=torch.float16)}, TypeError, "delta"),
    ({"blocks": torch.zeros(3, 8, 16, dtype=torch.bfloat16)}, ValueError, "blocks"),
    ({"norm_w": torch.ones(8, dtype=torch.bfloat16)}, ValueError, "norm_w"),
    ({"prefix": torch.zeros(2, 16, dtype=torch.int32)}, TypeError, "prefix"),
])
def test_bad_input_names_the_argument(change, error, arg):
    with pytest.raises(error, match=f"^{arg}"):
        attn_res_rmsnorm(**{**_op_args(), **change})


def test_allreduce_bad_deltas_shape():
    args = _op_args()
    del args["delta"]
    with pytest.raises(ValueError, match="^deltas"):
        allreduce_attn_res_rmsnorm(deltas=torch.ones(2, 16, dtype=torch.bfloat16), **args)
