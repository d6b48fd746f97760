"""Legitimate evaluations of an op: other summation orders and rounding points a correct kernel may
use, run on the case's working-dtype inputs. They are what a derived tolerance must accept, and what
the element floors of tolerance_specs/*.toml are measured against (test_element_floor.py;
`python3 -m property_tests.legit` prints the floor each op needed over many draws)."""
from __future__ import annotations

import argparse

import torch

from references.primitives import acc_dtype

# ----------------------------------------------------------------------------------------- skinny_gemm


def _gemm_orders(x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """fp32 accumulations of x @ w.T, each rounded once to x.dtype: CPU BLAS on strided operands
    (another blocking), the K axis reversed, a 4-way split-K folded in fp32, the fp64 product."""
    wd = x.dtype
    xf, wf = x.float(), w.float()
    xs, ws = xf.repeat_interleave(2, dim=1)[:, ::2], wf.repeat_interleave(2, dim=1)[:, ::2]
    return {"strided": (xs @ ws.T).to(wd), "reversed_k": (xf.flip(1) @ wf.flip(1).T).to(wd),
            "split4": sum(xf[:, i::4] @ wf[:, i::4].T for i in range(4)).to(wd),
            "fp64_round": (x.double() @ w.double().T).to(wd)}


def skinny_gemm(t: dict, p: dict) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {"y": y} for name, y in _gemm_orders(t["x"], t["w"]).items()}


# ------------------------------------------------------------------------------------ attn_res_rmsnorm


def _mix_fp32(sources: torch.Tensor, res_norm_w, res_proj_w, eps: float, flip: bool) -> torch.Tensor:
    """The AttnRes mix kept in fp32 (no rounding to wd): a fused kernel's mix, optionally with every
    D-length reduction in reversed order."""
    v = sources.to(acc_dtype(sources))
    q = res_norm_w.to(v.dtype) * res_proj_w.reshape(-1).to(v.dtype)
    if flip:
        v, q = v.flip(-1), q.flip(-1)
    ms = (v * v).sum(-1, keepdim=True) / v.shape[-1]
    scores = (v * q).sum(-1) * torch.rsqrt(ms + eps).squeeze(-1)       # norm applied after the dot
    probs = scores.softmax(-1)
    mix = (probs.unsqueeze(-1) * v).sum(1)
    return mix.flip(-1) if flip else mix


def _norm_fp32(mix: torch.Tensor, norm_w, norm_eps: float, wd) -> torch.Tensor:
    """RMSNorm of an fp32 mix with the weight applied in fp32 and one rounding to wd."""
    r = torch.rsqrt(mix.pow(2).mean(-1, keepdim=True) + norm_eps)
    return (mix * r * norm_w.to(mix.dtype)).to(wd)


def attn_res_rmsnorm(t: dict, p: dict) -> dict[str, dict[str, torch.Tensor]]:
    from references.attn_res import attn_res_mix_online, attn_res_probs, fold_partials
    from references.primitives import rms_norm
    wd = t["prefix"].dtype
    pref = t["prefix"] + (t["delta"] if "delta" in t else fold_partials(t["deltas"]))   # bitwise: the declared fold
    src = torch.cat([t["blocks"][:, :p["n_blocks"]], pref.unsqueeze(1)], dim=1)
    args = (t["res_norm_w"], t["res_proj_w"], p["eps"])
    out = {"online": rms_norm(attn_res_mix_online(src, *args), t["norm_w"], p["norm_eps"])}
    for flip in (False, True):
        out["fp32_mix" + ("_reversed" if flip else "")] = _norm_fp32(_mix_fp32(src, *args, flip), t["norm_w"],
                                                                    p["norm_eps"], wd)
    # the exact mix of the stored (rounded) p, rounded as the reference rounds (mix, norm, weight): the
    # best a kernel can do with p pinned bitwise; its distance to the fp64 oracle (unrounded p) is the
    # shared rounding of p through the scores, which the fused kernel showed at wide_range fp16 k3
    probs = attn_res_probs(src.double(), t["res_norm_w"].double(), t["res_proj_w"].double(), p["eps"])
    mix = torch.matmul(probs.unsqueeze(1), src.double()).squeeze(1).to(wd)
    out["exact_on_rounded_p"] = rms_norm(mix, t["norm_w"], p["norm_eps"])
    return {name: {"out": y} for name, y in out.items()}


# ------------------------------------------------------------------------------------- mla_decode_attn


def _round_toward_zero_fp32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the fp32 value next toward zero (round toward zero, as a tensor core's accumulator)."""
    r = x.float()
    return torch.where(r.double().abs() > x.abs(), torch.nextafter(r, torch.zeros_like(r)), r)


def tensor_core_scores(q: torch.Tensor, kv: torch.Tensor, k_step: int = 16) -> torch.Tensor:
    """q[Q,H,C] . kv[L,C] (16-bit) as a Hopper MMA chain accumulates it: each k_step-wide slice's products
    summed exactly, added to the fp32 accumulator and the sum rounded toward zero (-> [Q,H,L] fp32)."""
    acc = torch.zeros(*q.shape[:2], kv.shape[0], dtype=torch.float32)
    for c in range(0, q.shape[-1], k_step):
        part = torch.einsum("qhc,tc->qht", q[..., c:c + k_step].double(), kv[:, c:c + k_step].double())
        acc = _round_toward_zero_fp32(acc.double() + part)
    return acc


def _scores(q, kv, scale: float, order: str) -> torch.Tensor:
    """scale * q[Q,H,C] . kv[L,C] -> [Q,H,L] in another summation order: C reversed, 64-wide k-blocks
    folded in order, as a tensor-core MMA chain rounds (16-bit q, kv: tensor_core_scores), or the scale
    folded into q; fp32 (q, kv are fp32 but for tensor_core)."""
    if order == "reversed_c":
        return torch.einsum("qhc,tc->qht", q.flip(-1), kv.flip(-1)) * scale
    if order == "blocked_c":     # 64-wide k-blocks folded in order (a tensor-core MMA's accumulation)
        return sum(torch.einsum("qhc,tc->qht", q[..., i:i + 64], kv[:, i:i + 64]) for i in range(0, q.shape[-1], 64)) * scale
    if order == "tensor_core":
        return tensor_core_scores(q, kv) * scale
    return torch.einsum("qhc,tc->qht", q * scale, kv)                              # scale folded into q


def _attn_one(q, kv, lora: int, scale: float, visible, order: str, wd) -> torch.Tensor:
    """One sequence's attention in fp32 with the scores summed in another order or the softmax in
    another form: q[Q,H,C], kv[L,C] (fp32), visible[Q,L] -> o[Q,H,lora] (fp32)."""
    import torch.nn.functional as F
    if order == "sdpa":          # torch's own fused attention: another dot order, scale applied to q
        qh = q.permute(1, 0, 2)                                                     # [H, Q, C]
        k, v = kv.expand(qh.shape[0], -1, -1), kv[:, :lora].expand(qh.shape[0], -1, -1)
        return F.scaled_dot_product_attention(qh, k, v, attn_mask=visible, scale=scale).permute(1, 0, 2)
    s = _scores(q, kv, scale, order).masked_fill(~visible[:, None, :], float("-inf"))
    if order == "exp2":          # exp2 with log2(e) folded in, the max subtracted first (FlashAttention's form)
        s2 = s * 1.4426950408889634
        e = torch.exp2(s2 - s2.amax(-1, keepdim=True))
        p = e / e.sum(-1, keepdim=True)
    else:
        p = torch.softmax(s, -1)
    if order == "p_rounded":     # P rounded to the working dtype before the P @ V MMA (FlashMLA)
        p = p.to(wd).to(p.dtype)
    return torch.einsum("qht,tc->qhc", p, kv[:, :lora])


def mla_decode_attn(t: dict, p: dict) -> dict[str, dict[str, torch.Tensor]]:
    from references.mla import causal_visible, mla_decode_attn_split_kv, paged_cache_read
    q_abs, cache, table, lens = t["q_abs"], t["cache"], t["block_table"], t["seq_lens"]
    wd, acc, lora, scale = q_abs.dtype, acc_dtype(q_abs), p["kv_lora_rank"], p["scale"]
    n_q = q_abs.shape[1]
    res = {}
    # torch's CPU scaled_dot_product_attention turns a NaN score row into zeros where the oracle is
    # NaN (a kernel doing that is wrong, and the element rule rejects it): it is a legitimate order
    # only for finite inputs
    finite = bool(torch.isfinite(q_abs).all() and torch.isfinite(cache).all())
    for order in ("sdpa",) * finite + ("reversed_c", "blocked_c", "scale_in_q", "exp2", "p_rounded"):
        o = torch.zeros(*q_abs.shape[:3], lora, dtype=acc)
        for b in range(q_abs.shape[0]):
            length = int(lens[b])
            kv = paged_cache_read(cache, table[b], length).to(acc)
            o[b] = _attn_one(q_abs[b].to(acc), kv, lora, scale, causal_visible(length, n_q, 0, length), order, wd)
        res[order] = {"o_latent": o.to(wd)}
    for n in (2, 3):
        res[f"split_kv{n}"] = {"o_latent": mla_decode_attn_split_kv(q_abs, cache, table, lens, scale, lora, n)[0]}
    return res


# -------------------------------------------------------------------------------- mla_decode_attn_cp


def mla_decode_attn_cp(t: dict, p: dict) -> dict[str, dict[str, torch.Tensor]]:
    """The rank's window attention, the rest as the reference, with its scores summed over C reversed
    (fp32, round to nearest) and, for 16-bit inputs, accumulated as tensor cores do (an fp32 kernel has
    no such MMA): the spec's lse bound must take both."""
    from references.mla import causal_visible, paged_cache_read
    q_abs, cache, table = t["q_abs"], t["cache"], t["block_table"]
    lora, scale = p["kv_lora_rank"], p["scale"]
    (n_seq, n_q, H, _), acc = q_abs.shape, acc_dtype(q_abs)
    res = {}
    for order in ("reversed_c",) + (("tensor_core",) if q_abs.dtype != torch.float32 else ()):
        wd = q_abs.dtype if order == "tensor_core" else acc          # the MMA takes the 16-bit operands
        out = torch.zeros(n_seq, n_q, H, lora, dtype=acc)
        lse = torch.full((n_seq, n_q, H), float("-inf"), dtype=acc)
        for b in range(n_seq):
            start, n, length = int(t["kv_start"][b]), int(t["kv_len"][b]), int(t["seq_lens"][b])
            vis = causal_visible(length, n_q, start, start + n)
            seen = vis.any(-1)
            if not bool(seen.any()):
                continue
            kv = paged_cache_read(cache, table[b], n)
            s = _scores(q_abs[b].to(wd), kv.to(wd), scale, order).masked_fill(~vis[:, None, :], float("-inf"))
            lse[b, seen] = torch.logsumexp(s[seen], dim=-1)
            out[b, seen] = torch.einsum("qht,tc->qhc", torch.softmax(s[seen], dim=-1), kv[:, :lora].to(acc))
        res[order] = {"o_latent": out.to(q_abs.dtype), "lse": lse}
    return res


LEGIT = {"skinny_gemm": skinny_gemm, "attn_res_rmsnorm": attn_res_rmsnorm,
         "allreduce_attn_res_rmsnorm": attn_res_rmsnorm, "mla_decode_attn": mla_decode_attn,
         "mla_decode_attn_cp": mla_decode_attn_cp}


SPEC = "spec"


def judge_legit(op_name: str, case, element_floor: float | None | str = SPEC) -> dict[str, float]:
    """Worst ratio (error / tolerance) of every legitimate evaluation of the case under the op's spec
    bounds and magnitudes, with the spec's element floor or `element_floor`; > 1 would reject it."""
    from verify.judge.candidates import reference_fn
    from verify.judge.compare import compare_derived
    from verify.judge.calls import run_plain, to_oracle
    from verify.ops.registry import get_op
    from verify.model.specs import load_spec
    op, spec = get_op(op_name), load_spec(op_name)
    inputs = op.make_inputs(case)
    inputs64 = to_oracle(inputs)
    oracle = run_plain(reference_fn(op), op, inputs64, "cpu")
    base = run_plain(reference_fn(op), op, inputs, "cpu")
    mags = op.magnitudes(inputs64, base) if op.magnitudes is not None else {}      # base: the wd
    worst = {}
    for name, outs in LEGIT[op_name]({k: v.clone() for k, v in inputs.tensors.items()}, inputs.params).items():
        for out, y in outs.items():
            out_spec = spec.output(out)
            k, floor = out_spec.bounds(base[out].dtype)
            rho = out_spec.element_floor_for(base[out].dtype) if element_floor == SPEC else element_floor
            chk = compare_derived(out, y, oracle[out], base[out], k, floor, row_ndim=op.row_ndims.get(out, 1),
                                  magnitude=mags.get(out), element_floor=rho)
            worst[f"{name}:{out}"] = chk.metrics["ratio"]
    return worst


def legit_row_signs(op_name: str, case) -> dict[str, tuple[int, int, int, float]]:
    """(rows above, rows below the baseline's signed errors, rows, their mean differences in ulps summed)
    of every legitimate evaluation of the case (verify/judge/bias.py's statistic), per 'evaluation:output'."""
    from verify.judge.bias import row_signs, unit_ulps
    from verify.judge.candidates import reference_fn
    from verify.judge.pipeline import run_plain, to_oracle
    from verify.ops.registry import get_op
    from verify.model.specs import load_spec
    op, spec = get_op(op_name), load_spec(op_name)
    inputs = op.make_inputs(case)
    oracle = run_plain(reference_fn(op), op, to_oracle(inputs), "cpu")
    base = run_plain(reference_fn(op), op, inputs, "cpu")
    out = {}
    for name, outs in LEGIT[op_name]({k: v.clone() for k, v in inputs.tensors.items()}, inputs.params).items():
        for o, y in outs.items():
            if spec.output(o).klass == "derived":
                rn = op.row_ndims.get(o, 1)
                rows = y[(...,) + (0,) * rn].numel() if y.dim() > rn else 1
                out[f"{name}:{o}"] = (*row_signs(y, oracle[o], base[o], rn, unit_ulps(spec.output(o), base[o].dtype)),
                                      rows)
    return out


def main() -> None:
    from verify.model.case import Case
    from verify.ops.registry import get_op
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("op", choices=sorted(LEGIT))
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--floors", default="spec,0.000244140625,0.001953125,0.015625,0.0625,1")
    ap.add_argument("--knobs", default="", help="k=v,k=v added to every case (e.g. score_scale=64)")
    a = ap.parse_args()
    op = get_op(a.op)
    def value(v: str):
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return v
    extra = tuple(sorted((kv.split("=", 1)[0], value(kv.split("=", 1)[1])) for kv in a.knobs.split(",") if kv))
    floors = [f if f == SPEC else float(f) for f in a.floors.split(",")]
    need = {f: 0.0 for f in floors}
    for config in a.configs.split(","):
        for dtype in a.dtypes.split(","):
            for dist in op.dists:
                for seed in range(a.seeds):
                    case = Case(a.op, seed, 1 + (seed * 13) % op.max_batch, config, dtype, dist, extra=extra)
                    for f in floors:
                        r = max(judge_legit(a.op, case, f).values())
                        need[f] = max(need[f], r)
                        if r > 1:
                            print(f"floor {f}: {case.to_json()} ratio {r:.3g}", flush=True)
    for f in floors:
        print(f"element_floor {f}: worst ratio {need[f]:.3g} over {a.seeds} seeds x {len(op.dists)} dists "
              f"x configs {a.configs} x dtypes {a.dtypes}")


if __name__ == "__main__":
    main()
