"""The input-cache rollback design of references/kda_spec_cache.py (KdaInputCache), fused: a speculative
decoding step through KDA that reads the base fp32 state once and writes no state except at a
write-back. `--design fused.kda_verify_cache:KdaInputCacheFused` (window 6) judges it.

KdaInputCacheFused keeps what KdaInputCache keeps (the base conv window and fp32 state as of the last
write-back, the raw inputs of the tokens committed since then in cache slots [0, fill[b]) and fill)
and answers the same five methods with the same observable behaviour; no tensor value is read on the
host, so a CUDA graph can hold a step. Each method is one launch of fused/kda_verify_cache_step.py:
  verify     replays the fill[b] cached tokens from the base in registers, runs the n_tokens[b] draft
             tokens (y, zeros past n_tokens) and stores their inputs to cache slots fill[b] + t.
  accept     one write-back launch every sequence runs: fill + accepted >= window replays the cached
             tokens into the base (in place) and sets fill to 0, the others exit at once and take
             fill + accepted; then fill is copied from the launch's fill_next (one [B] copy).
  committed  the replay of the fill cached tokens into fresh tensors (kda_decode's layout).
Counts are clamped on the device (n_tokens and accepted to 0..n_q, fill to the cache).

Layout: conv_state [B, 3, C, W-1] wd and state [B, H, Dh, Dh] fp32 at begin (copied: the base); the
draft q_raw, k_raw, v_raw, g_raw, z [B, n_q, C] and beta_raw [B, n_q, H] wd; n_tokens, accepted [B]
int32 or int64. The cache is one buffer [B, S, 5C + H] wd (S = window - 1 + n_q <= 32) whose column
blocks are the reference's cache.<name> tensors [B, S, ...] (views: rollback_buffers gives the
design's own storage); fill [B] int32. Dh in 16, 32, 64, 128; W >= 2.

`kda_cache_step` is the registry op of the same name (references.kda_spec_cache.kda_cache_step): one
verify launch and one write-back launch on buffers the caller owns (the packed cache, fill, the base),
updated in place; a buffer the kernel cannot take as it is (strided, misaligned) goes through a
contiguous copy written back after the launches.
"""
from __future__ import annotations

import torch

from fused import runtime
from fused.kda_verify_accept import capturing
from references.kda_spec import COUNT_DTYPES, check_accept_counts, check_verify_counts
from references.kda_spec_cache import TOKEN_INPUTS, cache_views, check_fill
from references.primitives import check_tensor

WD_DTYPES = (torch.bfloat16, torch.float16)
MAX_CACHE_SLOTS = 32                                         # window - 1 + n_q (the kernel's chunks)
DTYPES = ("bfloat16", "float16")   # working dtypes (the harness draws only these; the state is fp32)


def _kernel():
    from fused import kda_verify_cache_step            # cutlass: imported on first launch
    return kda_verify_cache_step


class KdaInputCacheFused:
    """The input-cache design (module docstring). `window`: the cached tokens that trigger a write-back
    (>= 1); `variant`: a KdaVerifyConfig for every launch (None: KdaVerifyConfig.for_shape)."""

    def __init__(self, window: int = 6, *, variant=None):
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window: expected an int >= 1 (cached tokens that trigger a write-back), got {window!r}")
        self.window, self.variant = window, variant

    # ---- the protocol ------------------------------------------------------------------------------

    def begin(self, *, conv_state, state, conv_w, A_log, dt_bias, o_norm_w, lower_bound, l2_eps, norm_eps,
              n_q) -> None:
        check_tensor("state", state, ndim=4, dtypes=(torch.float32,))
        B, H, Dh, _ = state.shape
        C = H * Dh
        check_tensor("state", state, shape=(B, H, Dh, Dh))
        check_tensor("conv_w", conv_w, ndim=3, dtypes=(torch.float32,))
        W = conv_w.shape[-1]
        check_tensor("conv_w", conv_w, shape=(3, C, W))
        check_tensor("conv_state", conv_state, shape=(B, 3, C, W - 1), dtypes=WD_DTYPES)
        check_tensor("A_log", A_log, shape=(H,), dtypes=(torch.float32,))
        check_tensor("dt_bias", dt_bias, shape=(C,), dtypes=(torch.float32,))
        check_tensor("o_norm_w", o_norm_w, shape=(Dh,), dtypes=(torch.float32,))
        if Dh not in (16, 32, 64, 128) or W < 2:
            raise ValueError(f"state: head_dim {Dh} / conv_w: width {W}; the kernel takes Dh in 16, 32, 64, 128 "
                             "and W >= 2")
        if not isinstance(n_q, int) or isinstance(n_q, bool) or n_q < 1:
            raise ValueError(f"n_q: expected an int >= 1 (draft slots of every verify), got {n_q!r}")
        if self.window - 1 + n_q > MAX_CACHE_SLOTS:
            raise ValueError(f"n_q: {n_q} with window {self.window} needs {self.window - 1 + n_q} cache slots; the "
                             f"kernel takes window - 1 + n_q <= {MAX_CACHE_SLOTS}")
        if not lower_bound < 0:
            raise ValueError(f"lower_bound: expected a negative float (K3: -5.0), got {lower_bound!r}")
        self._require_device(state)
        for name, t in (("conv_state", conv_state), ("conv_w", conv_w), ("A_log", A_log), ("dt_bias", dt_bias),
                        ("o_norm_w", o_norm_w)):
            if t.device != state.device:
                raise ValueError(f"{name}: on {t.device}, state on {state.device}; every tensor on one device")
        self.base_conv = conv_state.clone(memory_format=torch.contiguous_format)
        self.base_state = state.clone(memory_format=torch.contiguous_format)
        self.layer = {"conv_w": runtime.aligned(conv_w.contiguous(), 16 if W % 4 == 0 else 4),
                      "A_log": A_log.contiguous(), "dt_bias": dt_bias.contiguous(), "o_norm_w": o_norm_w.contiguous()}
        self.params = (float(lower_bound), float(l2_eps), float(norm_eps))
        self.n_q = n_q
        S = self.window - 1 + n_q
        dev, wd = state.device, conv_state.dtype
        self._buffers(torch.zeros((B, S, 5 * C + H), dtype=wd, device=dev),
                      torch.zeros(B, dtype=torch.int32, device=dev))
        self.fill_next = torch.zeros(B, dtype=torch.int32, device=dev)
        self.y_unused = torch.zeros((B, 1, C), dtype=wd, device=dev)       # y of the modes that write none

    def verify(self, *, q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens) -> torch.Tensor:
        """The draft tokens' outputs y [B, n_q, C] (zero past n_tokens); caches their inputs after fill."""
        B, H, Dh, _ = self.base_state.shape
        C, wd = H * Dh, self.base_conv.dtype
        draft = {"q_raw": q_raw, "k_raw": k_raw, "v_raw": v_raw, "g_raw": g_raw, "beta_raw": beta_raw, "z": z}
        for name, t in draft.items():
            check_tensor(name, t, shape=(B, self.n_q, H if name == "beta_raw" else C), dtypes=(wd,))
            if t.device != self.base_state.device:
                raise ValueError(f"{name}: on {t.device}, the design's state on {self.base_state.device}")
        check_tensor("n_tokens", n_tokens, shape=(B,), dtypes=COUNT_DTYPES)
        y = torch.empty((B, self.n_q, C), dtype=wd, device=q_raw.device)
        self._launch("verify", [draft[n] for n in TOKEN_INPUTS], n_tokens, y, self.base_conv, self.base_state)
        return y

    def accept(self, accepted) -> None:
        """Commit accepted[b] of the last verify's tokens; the sequences whose cache is full write back."""
        check_tensor("accepted", accepted, shape=(self.base_state.shape[0],), dtypes=COUNT_DTYPES)
        self._launch("writeback", None, accepted, self.y_unused, self.base_conv, self.base_state)
        self.fill.copy_(self.fill_next)

    def committed(self) -> tuple[torch.Tensor, torch.Tensor]:
        conv, state = torch.empty_like(self.base_conv), torch.empty_like(self.base_state)
        self._launch("commit", None, self.fill, self.y_unused, conv, state)
        return conv, state

    def rollback_buffers(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """The cache: slots [0, fill[b]) hold committed tokens, draft token t goes to slot fill[b] + t."""
        return [(f"cache.{name}", self.cache[name], self.fill) for name in TOKEN_INPUTS]

    def fork(self) -> "KdaInputCacheFused":
        """The same design with its own copies of everything it updates (the cache views re-made)."""
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.base_conv, other.base_state = self.base_conv.clone(), self.base_state.clone()
        other._buffers(self.cache_buf.clone(), self.fill.clone())
        other.fill_next = self.fill_next.clone()
        return other

    # ---- plumbing ----------------------------------------------------------------------------------

    def _require_device(self, state) -> None:
        runtime.require_cuda("state", state)

    def _buffers(self, cache_buf: torch.Tensor, fill: torch.Tensor) -> None:
        self.cache_buf, self.fill = cache_buf, fill
        self.cache = cache_views(cache_buf, self.base_state.shape[1] * self.base_state.shape[2])

    def _launch(self, mode: str, draft, count, y, conv_out, state_out) -> None:
        B, H, Dh, _ = self.base_state.shape
        if B == 0 or H == 0:
            return
        k = _kernel()
        S = self.cache_buf.shape[1]
        W = self.layer["conv_w"].shape[-1]
        cfg = self.variant or k.KdaVerifyConfig.for_shape(Dh, B * H, runtime.sm_count(self.base_state.device))
        fn = k._compile(mode, runtime.dtype_name(self.base_conv.dtype), Dh, W, runtime.dtype_name(count.dtype),
                        -(-S // k.CHUNK), cfg)
        if draft is None:                    # the modes that read no draft: the cache's own views stand in
            draft = [self.cache[n] for n in TOKEN_INPUTS]
        draft = [t if t.stride(-1) == 1 else t.contiguous() for t in draft]
        lay = self.layer
        fn(*draft, count.contiguous(), self.cache_buf, self.fill, self.fill_next, lay["conv_w"], lay["A_log"],
           lay["dt_bias"], lay["o_norm_w"], self.base_conv, self.base_state, conv_out, state_out, y, *self.params,
           self.window)


def input_cache_fused(window: int = 6, variant=None) -> KdaInputCacheFused:
    """A fresh fused input-cache design (a factory for --design MODULE:ATTR)."""
    return KdaInputCacheFused(window, variant=variant)


# ---------------------------------------------------------------------------------------------- the registry op
def _check_step(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, accepted, conv_w, A_log, dt_bias, o_norm_w,
                cache, fill, base_conv, base_state, lower_bound, window) -> None:
    check_tensor("base_state", base_state, ndim=4, dtypes=(torch.float32,))
    B, H, Dh, _ = base_state.shape
    check_tensor("base_state", base_state, shape=(B, H, Dh, Dh))
    C = H * Dh
    check_tensor("q_raw", q_raw, ndim=3, dtypes=WD_DTYPES)
    n_q = q_raw.shape[1]
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window: expected an int >= 1 (cached tokens that trigger a write-back), got {window!r}")
    if n_q < 1 or window - 1 + n_q > MAX_CACHE_SLOTS:
        raise ValueError(f"q_raw: {n_q} draft slots with window {window} need {window - 1 + n_q} cache slots; the "
                         f"kernel takes 1..{MAX_CACHE_SLOTS}")
    for name, t in (("q_raw", q_raw), ("k_raw", k_raw), ("v_raw", v_raw), ("g_raw", g_raw), ("z", z)):
        check_tensor(name, t, shape=(B, n_q, C), dtypes=(q_raw.dtype,))
    check_tensor("beta_raw", beta_raw, shape=(B, n_q, H), dtypes=(q_raw.dtype,))
    check_tensor("n_tokens", n_tokens, shape=(B,), dtypes=COUNT_DTYPES)
    check_tensor("accepted", accepted, shape=(B,), dtypes=COUNT_DTYPES)
    check_tensor("conv_w", conv_w, ndim=3, dtypes=(torch.float32,))
    W = conv_w.shape[-1]
    check_tensor("conv_w", conv_w, shape=(3, C, W))
    check_tensor("A_log", A_log, shape=(H,), dtypes=(torch.float32,))
    check_tensor("dt_bias", dt_bias, shape=(C,), dtypes=(torch.float32,))
    check_tensor("o_norm_w", o_norm_w, shape=(Dh,), dtypes=(torch.float32,))
    check_tensor("cache", cache, shape=(B, window - 1 + n_q, 5 * C + H), dtypes=(q_raw.dtype,))
    check_tensor("fill", fill, shape=(B,), dtypes=(torch.int32,))
    check_tensor("base_conv", base_conv, shape=(B, 3, C, W - 1), dtypes=(q_raw.dtype,))
    if Dh not in (16, 32, 64, 128) or W < 2:
        raise ValueError(f"base_state: head_dim {Dh} / conv_w: width {W}; the kernel takes Dh in 16, 32, 64, 128 "
                         "and W >= 2")
    if not lower_bound < 0:
        raise ValueError(f"lower_bound: expected a negative float (K3: -5.0), got {lower_bound!r}")
    runtime.require_cuda("base_state", base_state)
    for name, t in (("q_raw", q_raw), ("k_raw", k_raw), ("v_raw", v_raw), ("g_raw", g_raw), ("beta_raw", beta_raw),
                    ("z", z), ("n_tokens", n_tokens), ("accepted", accepted), ("conv_w", conv_w), ("A_log", A_log),
                    ("dt_bias", dt_bias), ("o_norm_w", o_norm_w), ("cache", cache), ("fill", fill),
                    ("base_conv", base_conv)):
        if t.device != base_state.device:
            raise ValueError(f"{name}: on {t.device}, base_state on {base_state.device}; every tensor on one device")


def _working(t: torch.Tensor, align: int) -> torch.Tensor:
    """`t` where the kernel can update it in place (contiguous, `align`-byte base), else a copy."""
    return runtime.aligned(t, align) if t.is_contiguous() else t.contiguous()


def kda_cache_step(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, accepted, conv_w, A_log, dt_bias, o_norm_w,
                   cache, fill, base_conv, base_state, lower_bound: float, l2_eps: float, norm_eps: float,
                   window: int, validate: bool = True, *, variant=None):
    """Fused replacement of references.kda_spec_cache.kda_cache_step (same signature) -> y [B, n_q, C]:
    the verify launch (y; the draft stored to the cache after fill), the write-back launch (fill +
    accepted >= window: the cached tokens replayed into base_conv and base_state in place) and fill's
    copy. validate=True checks the counts on the host as the reference does, except under CUDA-graph
    capture; the kernel clamps every count either way."""
    _check_step(q_raw, k_raw, v_raw, g_raw, beta_raw, z, n_tokens, accepted, conv_w, A_log, dt_bias, o_norm_w,
                cache, fill, base_conv, base_state, lower_bound, window)
    n_q = q_raw.shape[1]
    if validate and not capturing():
        check_verify_counts(n_tokens, n_q)
        check_accept_counts(accepted, n_tokens)
        check_fill(fill, window)
    B, H, Dh, _ = base_state.shape
    C, W = H * Dh, conv_w.shape[-1]
    y = torch.empty((B, n_q, C), dtype=q_raw.dtype, device=q_raw.device)
    if B == 0 or H == 0:
        return y
    k = _kernel()
    cfg = variant or k.KdaVerifyConfig.for_shape(Dh, B * H, runtime.sm_count(base_state.device))
    buf, fl, bc, bs = _working(cache, 16), _working(fill, 4), _working(base_conv, 16), _working(base_state, 16)
    fill_next = torch.empty_like(fl)
    lay = (runtime.aligned(conv_w.contiguous(), 16 if W % 4 == 0 else 4), A_log.contiguous(), dt_bias.contiguous(),
           o_norm_w.contiguous())
    params = (float(lower_bound), float(l2_eps), float(norm_eps))
    views = cache_views(buf, C)
    cached = [views[n] for n in TOKEN_INPUTS]
    draft = [t if t.stride(-1) == 1 else t.contiguous() for t in (q_raw, k_raw, v_raw, g_raw, beta_raw, z)]
    n_chunks = -(-buf.shape[1] // k.CHUNK)
    wd, cd = runtime.dtype_name(q_raw.dtype), runtime.dtype_name(n_tokens.dtype)
    k._compile("verify", wd, Dh, W, cd, n_chunks, cfg)(
        *draft, n_tokens.contiguous(), buf, fl, fill_next, *lay, bc, bs, bc, bs, y, *params, window)
    y_unused = torch.empty((B, 1, C), dtype=q_raw.dtype, device=q_raw.device)
    k._compile("writeback", wd, Dh, W, runtime.dtype_name(accepted.dtype), n_chunks, cfg)(
        *cached, accepted.contiguous(), buf, fl, fill_next, *lay, bc, bs, bc, bs, y_unused, *params, window)
    fl.copy_(fill_next)
    for work, caller in ((buf, cache), (fl, fill), (bc, base_conv), (bs, base_state)):
        runtime.write_back(work, caller)
    return y


def variants(tensors: dict, params: dict) -> list:
    """Every launch variant the harness must certify for these inputs (KdaVerify's layouts)."""
    from fused.kda_verify import KdaVerifyConfig

    return KdaVerifyConfig.all_configs()
