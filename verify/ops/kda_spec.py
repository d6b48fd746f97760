"""Registry entries of speculative decoding through KDA: kda_verify (the verify step of the per-token
checkpoint design, references/kda_spec.py) and kda_cache_step (a verify + accept step of the input-cache
design, references/kda_spec_cache.py).

A case is kda_decode's case (verify.ops.kda: the same weights, committed conv window and fp32 state)
with n_q draft slots instead of one token: slot t's token inputs are drawn as kda_decode's are, from
the case seed salted by t, so every slot is a fresh token of the case's distribution. n_tokens is
ragged over the batch, always holding 1 and n_q when B allows; its dtype (int32 or int64) is drawn.
The checkpoint buffers start as stale checkpoints of an earlier step (random values, not zeros), so
a kernel that writes a slot past a sequence's count, even with zeros, changes them.

A kda_cache_step case is kda_verify's draft, committed state (the base) and counts, plus: the window
(the `window` knob, else drawn), each sequence's committed cached tokens (fill, 0..window-1: sequence
0 full but one, so its accept writes back; sequence 1 empty), the tokens accepted (sequence 0 all of
its draft, sequence 1 none, the rest uniform in 0..n_tokens), and a cache whose every slot holds a
token drawn as the draft's are: the committed ones in slots below fill, stale ones above, which a step
that reads or writes the wrong slot meets.
"""
from __future__ import annotations

import dataclasses
import zlib

import torch

from references.config import get_config
from references.kda import kda_decode, kda_gate
from references.primitives import silu
from references.kda_spec_cache import CACHE_COLUMNS, cache_views, store_draft
from references.kda_tp import _own, _rank_slices, shard_decode_tensors
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs, Peer, RankShard, SplitRule
from verify.ops.kda import (_activation, _conv_inputs, _gen, _wd, decode_state_magnitude,
                            make_kda_decode_inputs)

TOKEN_INPUTS = ("q_raw", "k_raw", "v_raw", "g_raw", "beta_raw", "z")
MAX_SLOTS = 8            # the verify step's draft slots (K3: accept length ~6 of up to 8 drafted)
VERIFY_MAX_BATCH = 8     # k3: n_q fp32 state checkpoints of 6 MiB per sequence, and the fp64 oracle's copy


def draft_slots(case: Case) -> int:
    """n_q: the `draft` knob, else drawn from the seed over 1..8 (1, 6 and 8 twice as likely)."""
    n_q = case.knob("draft")
    if n_q is None:
        opts = (1, 1, 2, 3, 4, 5, 6, 6, 7, 8, 8)
        n_q = opts[int(torch.randint(0, len(opts), (1,), generator=_gen(case, "draft")))]
    if not isinstance(n_q, int) or not 1 <= n_q <= MAX_SLOTS:
        raise ValueError(f"draft={n_q!r}: the verify step takes 1..{MAX_SLOTS} draft tokens per sequence")
    return n_q


def draw_counts(case: Case, batch: int, n_q: int) -> torch.Tensor:
    """Ragged tokens per sequence in 1..n_q: sequence 0 verifies n_q, sequence 1 one token, the rest
    uniform; int32 or int64 drawn from the seed."""
    g = _gen(case, "n_tokens")
    counts = torch.randint(1, n_q + 1, (batch,), generator=g)
    counts[0] = n_q
    if batch > 1:
        counts[1] = 1
    dtype = (torch.int32, torch.int64)[int(torch.randint(0, 2, (1,), generator=g))]
    return counts.to(dtype)


def _slot_tokens(case: Case, t: int, B: int, H: int, Dh: int, W: int, wd: torch.dtype) -> dict[str, torch.Tensor]:
    """Token inputs of slot t, drawn as kda_decode's from the seed salted by t (slot 0: the case's own)."""
    c = case if t == 0 else dataclasses.replace(case, seed=zlib.crc32(f"{case.seed}:slot{t}".encode()) & 0x7FFFFFFF)
    C = H * Dh
    tok = {n: v for n, v in _conv_inputs(c, B, H, Dh, W, wd).items() if n != "conv_state"}
    tok["g_raw"] = _activation(c, "g_raw", (B, C), wd)
    tok["beta_raw"] = _activation(c, "beta_raw", (B, H), wd)
    tok["z"] = _activation(c, "z", (B, C), wd)
    return tok


def make_kda_verify_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    wd, B, H, Dh, W = _wd(case), case.batch, cfg.n_heads, cfg.head_dim, cfg.conv_kernel
    n_q = draft_slots(case)
    base = make_kda_decode_inputs(case)
    slots = [{n: base.tensors[n] for n in TOKEN_INPUTS}]
    slots += [_slot_tokens(case, t, B, H, Dh, W, wd) for t in range(1, n_q)]
    t = {n: torch.stack([s[n] for s in slots], dim=1) for n in TOKEN_INPUTS}
    t["n_tokens"] = draw_counts(case, B, n_q)
    for n in ("conv_w", "conv_state", "A_log", "dt_bias", "o_norm_w", "state"):
        t[n] = base.tensors[n]
    g = _gen(case, "stale_checkpoints")
    t["conv_ckpt"] = torch.randn((B, n_q) + tuple(t["conv_state"].shape[1:]), generator=g).to(wd)
    t["state_ckpt"] = torch.randn((B, n_q) + tuple(t["state"].shape[1:]), generator=g, dtype=torch.float32)
    return OpInputs(tensors=t, params=dict(base.params))


# Mantissa bits of the working dtypes: a rounding to wd moves a value by at most one ulp, 2^(e - bits)
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
# The spec's state floor is 16 fp32 ulps of the row's largest magnitude, at least 16 * 2^-24 = 2^-20 of
# it: a wd rounding flip scaled by 2^20 is covered by that floor once, and no more.
FLIP_SCALE = 2.0 ** 20


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of `dtype` at |x| (float64; fp16's subnormal spacing 2^-24 below its normals)."""
    _, e = torch.frexp(x.abs())
    u = torch.ldexp(torch.ones_like(x), e - 1 - _MANTISSA[dtype])
    return u.clamp(min=2.0 ** -24) if dtype == torch.float16 else u


def _flip_magnitude(d: dict, p: dict, conv: torch.Tensor, state: torch.Tensor, s: int, wd: torch.dtype) -> torch.Tensor:
    """First-order change of token s's new state element (j, i) when one k and one v conv output of
    its head land one wd ulp away (a rounding flip: another fp32 order before the rounding to wd, left
    free by the spec; it needs the fp32 values to straddle a wd rounding boundary, about 2^-16 of the
    time per element in bf16, so one flip per head and token, not all 128 at once):
      v_j flips:    du_j = beta ulp(v_j)                        -> |k_i| du_j
      ks_c flips:   dk_c = ulp(ks_c) / |ks|, du_j = beta |S'_jc| dk_c  -> |u_j| dk_i (c = i), |k_i| du_j
    the largest over c of the k flip's term, summed with the v flip's."""
    B, H, V, K = state.shape

    def conv_out(i: int) -> torch.Tensor:
        x = d[("q_raw", "k_raw", "v_raw")[i]][:, s]
        window = torch.cat([conv[:, i], x.unsqueeze(-1)], dim=-1)
        return silu((window * d["conv_w"][i]).sum(-1)).view(B, H, -1)

    ks, v = conv_out(1), conv_out(2)
    norm = torch.sqrt((ks * ks).sum(-1, keepdim=True) + p["l2_eps"])
    k = ks / norm
    dk = _ulp(ks, wd) / norm                                                    # [B, H, K]
    _, alpha = kda_gate(d["g_raw"][:, s].view(B, H, K), d["A_log"], d["dt_bias"], p["lower_bound"])
    beta = torch.sigmoid(d["beta_raw"][:, s]).unsqueeze(-1)                     # [B, H, 1]
    sd = state * alpha.unsqueeze(-2)                                            # [B, H, V, K]
    u = beta * (v - (sd * k.unsqueeze(-2)).sum(-1))                             # [B, H, V]
    du = beta * (_ulp(v, wd) + (sd.abs() * dk.unsqueeze(-2)).amax(-1))          # [B, H, V]
    return dk.unsqueeze(-2) * u.abs().unsqueeze(-1) + k.abs().unsqueeze(-2) * du.unsqueeze(-1)


def verify_state_magnitude(inputs: OpInputs, cand: dict | None = None) -> dict[str, torch.Tensor]:
    """Error scale of every state checkpoint, summed over tokens 0..t (a carried error passes through
    the contraction ||A_t|| <= 1, kda_layer.toml, and each token adds its own): per token, from the
    float64 oracle's state before it,
      m_s     kda_decode's running-error magnitude (verify.ops.kda.decode_state_magnitude: any fp32
              evaluation order errs by c u m_s), plus
      f_s     the state change of a wd rounding flip of one k and one v conv output (_flip_magnitude),
              scaled by FLIP_SCALE so that the spec's 16-fp32-ulp floor of the row covers it once.
    The working dtype is the candidate's y (fp32 without a candidate: no flip beyond fp32's own).
    Slots past a sequence's count keep their stale values: their magnitude is unused."""
    d, p, wd = _in_float64(inputs, cand)
    acc = torch.zeros_like(d["state_ckpt"])
    for s, m in enumerate(_token_terms(d, p, d["conv_state"], d["state"], d["q_raw"].shape[1], wd)):
        acc[:, s] = m + (acc[:, s - 1] if s else 0)
    return {"state_ckpt": acc}


def _in_float64(inputs: OpInputs, cand: dict | None) -> tuple[dict, dict, torch.dtype]:
    """(the inputs' float tensors in float64, the params, the working dtype: the candidate's y, fp32
    without a candidate: no flip beyond fp32's own)."""
    wd = cand["y"].dtype if cand and "y" in cand and cand["y"].dtype in _MANTISSA else torch.float32
    d = {n: v.to(torch.float64) if v.is_floating_point() else v for n, v in inputs.tensors.items()}
    return d, inputs.params, wd


def _token_terms(d: dict, p: dict, conv: torch.Tensor, state: torch.Tensor, steps: int, wd: torch.dtype,
                 live=None):
    """The error-scale term of each token s < steps of a chain over d's slot tensors ([B, S, ...]) from
    (conv, state): kda_decode's running-error magnitude plus FLIP_SCALE x a k and a v rounding flip
    (verify_state_magnitude). Each sequence advances by the token where live(s) ([B] bool) holds, every
    sequence where live is None."""
    layer = {n: d[n] for n in ("conv_w", "A_log", "dt_bias", "o_norm_w")}
    cs, st = conv.clone(), state.clone()
    for s in range(steps):
        token = {n: d[n][:, s] for n in TOKEN_INPUTS}
        m = decode_state_magnitude(OpInputs({**token, **layer, "conv_state": cs, "state": st}, p))["state"]
        yield m + FLIP_SCALE * _flip_magnitude(d, p, cs, st, s, wd)
        new_cs, new_st = cs.clone(), st.clone()
        kda_decode(**token, **layer, conv_state=new_cs, state=new_st, lower_bound=p["lower_bound"],
                   l2_eps=p["l2_eps"], norm_eps=p["norm_eps"])
        keep = None if live is None else live(s).view(-1, 1, 1, 1)
        cs = new_cs if keep is None else torch.where(keep, new_cs, cs)
        st = new_st if keep is None else torch.where(keep, new_st, st)


def shard_kda_verify(inputs: OpInputs, T: int) -> list[RankShard]:
    """By head, as kda_decode (references/kda_tp.py): the draft slots' channels and beta columns, the
    checkpoints' heads; n_tokens is every rank's."""
    t = inputs.tensors
    H, Dh = t["state"].shape[1], t["state"].shape[-1]
    per_token = {n: v for n, v in t.items() if n not in ("beta_raw", "n_tokens", "conv_ckpt", "state_ckpt")}
    out = []
    for rank, r in enumerate(shard_decode_tensors(per_token, T)):
        hs, cs = _rank_slices(H, Dh, T, rank)
        r["beta_raw"] = _own(t["beta_raw"][..., hs])
        r["n_tokens"] = t["n_tokens"]
        r["conv_ckpt"] = _own(t["conv_ckpt"][:, :, :, cs])
        r["state_ckpt"] = _own(t["state_ckpt"][:, :, hs])
        out.append(RankShard(r, dict(inputs.params)))
    return out


def combine_kda_verify(per_rank: list[dict[str, torch.Tensor]], inputs: OpInputs) -> dict[str, torch.Tensor]:
    return {"y": torch.cat([r["y"] for r in per_rank], -1),
            "conv_ckpt": torch.cat([r["conv_ckpt"] for r in per_rank], 3),
            "state_ckpt": torch.cat([r["state_ckpt"] for r in per_rank], 2)}


def kda_verify_bytes(inputs: OpInputs) -> int:
    """What the step must move: every slot's activations, the counts and the fp32 parameters read, the
    committed conv window and state read once, each verified token's conv window and state checkpoint
    written, y [B, n_q, C] written."""
    t = inputs.tensors
    B, n_q, C = t["q_raw"].shape
    H = t["A_log"].shape[0]
    Dh, W = C // H, t["conv_w"].shape[-1]
    e, tokens = t["q_raw"].element_size(), int(t["n_tokens"].sum())
    activations = (5 * B * n_q * C + B * n_q * H) * e
    params = (3 * C * W + H + C + Dh) * 4
    conv = (B + tokens) * 3 * C * (W - 1) * t["conv_state"].element_size()
    state = (B + tokens) * H * Dh * Dh * 4
    counts = t["n_tokens"].numel() * t["n_tokens"].element_size()
    return activations + counts + params + conv + state + B * n_q * C * e


_ACT = {n: 0 for n in TOKEN_INPUTS}

KDA_VERIFY_PEERS = (
    Peer("kda_decode_per_token", "verify.bench.peers:kda_decode_per_token",
         part="n_q fused kda_decode launches, each token's state copied to its checkpoint: the step without "
              "a multi-token kernel"),
    Peer("fla_recurrence_tokens", "verify.bench.peers:fla_recurrence_tokens",
         part="fla's fused_recurrent_kda over the n_q tokens, final state only (no per-token checkpoints, no "
              "convs or gated norm): a lower bound through fla"),
)

KDA_VERIFY = OpDef(
    name="kda_verify",
    family="kda_spec",
    reference="references.kda_spec:kda_verify",
    make_inputs=make_kda_verify_inputs,
    outputs=("y",),
    signature=("q_raw, k_raw, v_raw, g_raw, z [B,n_q,H*Dh] wd; beta_raw[B,n_q,H] wd  (slot t = draft token t)\n"
               "n_tokens[B] int32|int64  (1..n_q tokens verified per sequence, ragged)\n"
               "conv_w[3,H*Dh,W] fp32; conv_state[B,3,H*Dh,W-1] wd; A_log[H], dt_bias[H*Dh], o_norm_w[Dh] fp32\n"
               "state[B,H,Dh(V),Dh(K)] fp32  (committed; read only)\n"
               "conv_ckpt[B,n_q,3,H*Dh,W-1] wd; state_ckpt[B,n_q,H,Dh,Dh] fp32  (written for t < n_tokens[b])\n"
               "lower_bound, l2_eps, norm_eps: float\n"
               "-> y[B,n_q,H*Dh] wd  (zero past n_tokens)"),
    state=("conv_ckpt", "state_ckpt"),
    batch_dims={**_ACT, "n_tokens": 0, "conv_state": 0, "state": 0, "conv_ckpt": 0, "state_ckpt": 0, "y": 0},
    split=SplitRule(kind="heads", shard=shard_kda_verify, combine=combine_kda_verify,
                    reduction_order="none: heads are independent; y, conv_ckpt, state_ckpt concatenated by head"),
    fused="fused.kda_verify:kda_verify",
    magnitudes=verify_state_magnitude, moved_bytes=kda_verify_bytes, peers=KDA_VERIFY_PEERS,
    max_batch=VERIFY_MAX_BATCH, compile_heavy=True,
    notes=(f"batch capped at {VERIFY_MAX_BATCH}: at k3 every sequence holds n_q fp32 state checkpoints of 6 MiB "
           "(and the oracle an fp64 copy). torch.compile of the reference (a loop of n_q kda_decode steps, "
           "recompiled per n_q) takes about a minute a case on a CPU. The rollback itself (accept, and any design's contract over many "
           "steps) is judged by `verify-kernels spec-decode`."),
)


# ---------------------------------------------------------------------------------------------- kda_cache_step
WINDOWS = (1, 2, 3, 6, 6, 8, 12)     # drawn windows; K3's default is 6 (fused/kda_verify_cache.py)
MAX_CACHE_SLOTS = 32                 # window - 1 + n_q: the fused kernel's cache chunks
CACHE_ORDER = CACHE_COLUMNS + ("beta_raw",)   # the packed cache's column blocks, in order
CACHE_KNOBS = ({"window": 1, "draft": 8}, {"window": 25, "draft": 8}, {"window": 6, "draft": 6})


def cache_window(case: Case, n_q: int) -> int:
    """The `window` knob, else drawn from the seed (WINDOWS); window - 1 + n_q <= MAX_CACHE_SLOTS."""
    window = case.knob("window")
    if window is None:
        window = WINDOWS[int(torch.randint(0, len(WINDOWS), (1,), generator=_gen(case, "window")))]
    if not isinstance(window, int) or window < 1 or window - 1 + n_q > MAX_CACHE_SLOTS:
        raise ValueError(f"window={window!r}: expected an int >= 1 with window - 1 + n_q <= {MAX_CACHE_SLOTS} "
                         f"(n_q={n_q})")
    return window


def _cache_counts(case: Case, n_tokens: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fill [B] int32 in 0..window-1, accepted [B] in 0..n_tokens, n_tokens' dtype): sequence 0 holds
    window - 1 tokens and accepts its whole draft (a write-back), sequence 1 holds none and accepts none."""
    B = n_tokens.shape[0]
    g = _gen(case, "cache_counts")
    fill = torch.randint(0, window, (B,), generator=g)
    accepted = (torch.rand(B, generator=g) * (n_tokens.long() + 1)).long().clamp(max=n_tokens.long())
    fill[0], accepted[0] = window - 1, n_tokens[0]
    if B > 1:
        fill[1], accepted[1] = 0, 0
    return fill.to(torch.int32), accepted.to(n_tokens.dtype)


def make_kda_cache_step_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    wd, B, H, Dh, W = _wd(case), case.batch, cfg.n_heads, cfg.head_dim, cfg.conv_kernel
    base = make_kda_verify_inputs(case)
    n_q = base.tensors["q_raw"].shape[1]
    window = cache_window(case, n_q)
    t = {n: base.tensors[n] for n in TOKEN_INPUTS + ("n_tokens", "conv_w", "A_log", "dt_bias", "o_norm_w")}
    t["fill"], t["accepted"] = _cache_counts(case, t["n_tokens"], window)
    slots = []
    for s in range(window - 1 + n_q):
        c = dataclasses.replace(case, seed=zlib.crc32(f"{case.seed}:cache{s}".encode()) & 0x7FFFFFFF)
        tok = _slot_tokens(c, 0, B, H, Dh, W, wd)
        slots.append(torch.cat([tok[n] for n in CACHE_ORDER], dim=-1))
    t["cache"] = torch.stack(slots, dim=1)
    t["base_conv"], t["base_state"] = base.tensors["conv_state"], base.tensors["state"]
    return OpInputs(tensors=t, params={**base.params, "window": window})


def _replay_slots(d: dict, C: int) -> dict[str, torch.Tensor]:
    """The cache after the verify step's stores, as [B, S, ...] tensors per token input: slot s is the
    s-th token each sequence's write-back replays."""
    views = {n: v.clone() for n, v in cache_views(d["cache"], C).items()}
    store_draft(views, {n: d[n] for n in TOKEN_INPUTS}, d["fill"].to(d["q_raw"].device),
                d["n_tokens"].to(d["q_raw"].device))
    return views


def cache_state_magnitude(inputs: OpInputs, cand: dict | None = None) -> dict[str, torch.Tensor]:
    """Error scale of base_state (verify_state_magnitude's terms, summed over the tokens a sequence's
    write-back replays: the fill cached ones, then its accepted drafts); zero where no write-back
    happens (the base must come back as it was: the floor is then the row's own scale)."""
    d, p, wd = _in_float64(inputs, cand)
    B, H, Dh, _ = d["base_state"].shape
    chain = {**d, **_replay_slots(d, H * Dh)}
    f = d["fill"].long() + d["accepted"].long()
    count = torch.where(f >= p["window"], f, torch.zeros_like(f))
    acc = torch.zeros_like(d["base_state"])
    steps = int(count.max()) if B else 0
    for s, m in enumerate(_token_terms(chain, p, d["base_conv"], d["base_state"], steps, wd, lambda s: count > s)):
        acc = torch.where((count > s).view(B, 1, 1, 1), acc + m, acc)
    return {"base_state": acc}


def _cache_columns(cache: torch.Tensor, C: int, cs: slice, hs: slice) -> torch.Tensor:
    """A rank's cache: each token input's column block cut to its channels (beta to its heads)."""
    v = cache_views(cache, C)
    return _own(torch.cat([v[n][..., hs if n == "beta_raw" else cs] for n in CACHE_ORDER], dim=-1))


def shard_kda_cache_step(inputs: OpInputs, T: int) -> list[RankShard]:
    """By head, as kda_verify: the draft's channels and beta columns, the cache's column blocks, the
    base's heads; the counts and fill are every rank's."""
    t = inputs.tensors
    H, Dh = t["base_state"].shape[1], t["base_state"].shape[-1]
    C = H * Dh
    out = []
    for rank in range(T):
        hs, cs = _rank_slices(H, Dh, T, rank)
        r = {n: _own(t[n][..., cs]) for n in ("q_raw", "k_raw", "v_raw", "g_raw", "z", "dt_bias")}
        r["beta_raw"] = _own(t["beta_raw"][..., hs])
        r.update({n: t[n].clone() for n in ("n_tokens", "accepted", "fill")})
        r["conv_w"], r["A_log"], r["o_norm_w"] = _own(t["conv_w"][:, cs]), _own(t["A_log"][hs]), t["o_norm_w"]
        r["cache"] = _cache_columns(t["cache"], C, cs, hs)
        r["base_conv"], r["base_state"] = _own(t["base_conv"][:, :, cs]), _own(t["base_state"][:, hs])
        out.append(RankShard(r, dict(inputs.params)))
    return out


def combine_kda_cache_step(per_rank: list[dict[str, torch.Tensor]], inputs: OpInputs) -> dict[str, torch.Tensor]:
    """The unsplit results; fill is rank 0's where every rank's agrees, else -1 (which no step gives)."""
    views = [cache_views(r["cache"], r["base_state"].shape[1] * r["base_state"].shape[-1]) for r in per_rank]
    blocks = [torch.cat([v[n] for v in views], -1) for n in CACHE_ORDER]
    fill = per_rank[0]["fill"]
    agree = all(torch.equal(r["fill"], fill) for r in per_rank)
    return {"y": torch.cat([r["y"] for r in per_rank], -1), "cache": torch.cat(blocks, -1),
            "fill": fill if agree else torch.full_like(fill, -1),
            "base_conv": torch.cat([r["base_conv"] for r in per_rank], 2),
            "base_state": torch.cat([r["base_state"] for r in per_rank], 1)}


def kda_cache_step_bytes(inputs: OpInputs) -> int:
    """What the step must move: the draft (every slot), the counts and the fp32 parameters read; each
    sequence's fill cached tokens read once (one pass can both verify and write back: accepted is an
    input) and its n_tokens draft slots stored; fill read and written; the base read once and written
    where the step writes back; y written."""
    t = inputs.tensors
    B, n_q, C = t["q_raw"].shape
    H = t["A_log"].shape[0]
    e = t["q_raw"].element_size()
    size = lambda n: t[n].numel() * t[n].element_size()
    activations = sum(size(n) for n in TOKEN_INPUTS)
    reads = sum(size(n) for n in ("n_tokens", "accepted", "conv_w", "A_log", "dt_bias", "o_norm_w"))
    slot = (5 * C + H) * e
    cache = (int(t["fill"].long().sum()) + int(t["n_tokens"].long().sum())) * slot
    wb = int(((t["fill"].long() + t["accepted"].long()) >= inputs.params["window"]).sum())
    base = (size("base_conv") + size("base_state")) // max(B, 1)
    return activations + reads + cache + 2 * size("fill") + (B + wb) * base + B * n_q * C * e


KDA_CACHE_STEP = OpDef(
    name="kda_cache_step",
    family="kda_spec",
    reference="references.kda_spec_cache:kda_cache_step",
    make_inputs=make_kda_cache_step_inputs,
    outputs=("y",),
    signature=("q_raw, k_raw, v_raw, g_raw, z [B,n_q,H*Dh] wd; beta_raw[B,n_q,H] wd  (slot t = draft token t)\n"
               "n_tokens[B] int32|int64 (1..n_q verified); accepted[B] same dtype (0..n_tokens)\n"
               "conv_w[3,H*Dh,W], A_log[H], dt_bias[H*Dh], o_norm_w[Dh] fp32\n"
               "cache[B,window-1+n_q,5*H*Dh+H] wd (state: q|k|v|g|z|beta of the tokens since the write-back, "
               "slots < fill committed)\n"
               "fill[B] int32 (state: 0..window-1); base_conv[B,3,H*Dh,W-1] wd, base_state[B,H,Dh,Dh] fp32 "
               "(state: as of the write-back)\n"
               "lower_bound, l2_eps, norm_eps: float; window: int\n"
               "-> y[B,n_q,H*Dh] wd  (zero past n_tokens)"),
    state=("cache", "fill", "base_conv", "base_state"),
    batch_dims={**_ACT, "n_tokens": 0, "accepted": 0, "cache": 0, "fill": 0, "base_conv": 0, "base_state": 0,
                "y": 0},
    split=SplitRule(kind="heads", shard=shard_kda_cache_step, combine=combine_kda_cache_step,
                    reduction_order="none: heads are independent; y, cache, base_conv, base_state concatenated by "
                                    "head"),
    fused="fused.kda_verify_cache:kda_cache_step",
    magnitudes=cache_state_magnitude, moved_bytes=kda_cache_step_bytes,
    max_batch=VERIFY_MAX_BATCH, compile_heavy=True, knob_sweep=CACHE_KNOBS,
    notes=("The input-cache rollback design's step (references/kda_spec_cache.py): verify the draft from the "
           "base plus the cached tokens, then accept, writing back where the cache fills. Its contract over many "
           "steps is `verify-kernels spec-decode --design fused.kda_verify_cache:KdaInputCacheFused`. Knob sweep: "
           "window 1 (every accepted token writes back), window 25 with 8 drafts (the 32 cache slots the fused "
           "kernel takes), window 6 with 6 drafts (K3's step)."),
)

OPS: list[OpDef] = [KDA_VERIFY, KDA_CACHE_STEP]
