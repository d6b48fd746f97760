"""A torch model of fused/kda_verify_cache_step.py's launch (KdaCacheStep's three modes), for CPU tests
of the code around the kernel: the same arguments, clamps and slot mapping, each token through
references.kda.kda_decode over the batch (rows past a sequence's count computed and dropped, as the
reference design replays). Not the CuTe code: the GPU tests run that."""
from __future__ import annotations

import functools

import torch

from references.kda import kda_decode
from references.kda_spec_cache import TOKEN_INPUTS, cache_views

CHUNK = 8


def launch(mode, q_raw, k_raw, v_raw, g_raw, beta_raw, z, count, cache, fill, fill_out, conv_w, A_log, dt_bias,
           o_norm_w, conv_s, state, conv_out, state_out, y, lower_bound, l2_eps, norm_eps, window) -> None:
    """One launch in `mode` (verify, writeback, commit), the kernel's argument order."""
    draft = (q_raw, k_raw, v_raw, g_raw, beta_raw, z)
    B, S = cache.shape[:2]
    dev = fill.device
    views = cache_views(cache, q_raw.shape[-1])
    n_q, rows = S - window + 1, torch.arange(B, device=dev)
    f0, c, zero = fill.long(), count.long(), torch.zeros(B, dtype=torch.long, device=dev)
    if mode == "verify":
        n_rep, n = f0.clamp(0, S - n_q), c.clamp(0, n_q)
        for t in range(n_q):                    # draft token t -> cache slot n_rep + t
            slot, take = (n_rep + t).clamp(max=S - 1), (t < n).view(-1, 1)
            for i, name in enumerate(TOKEN_INPUTS):
                views[name][rows, slot] = torch.where(take, draft[i][:, t], views[name][rows, slot])
        y.zero_()
    elif mode == "writeback":
        f = f0.clamp(min=0) + c.clamp(0, n_q)
        run = f >= window
        n_rep, n = torch.where(run, f.clamp(max=S), zero), zero
        fill_out.copy_(torch.where(run, zero, f))
    else:
        n_rep, n = f0.clamp(0, S), zero
    total, conv, st = n_rep + n, conv_s.clone(), state.clone()
    layer = {"conv_w": conv_w, "A_log": A_log, "dt_bias": dt_bias, "o_norm_w": o_norm_w}
    for s in range(int(total.max()) if B else 0):
        cs, sn = conv.clone(), st.clone()
        yt = kda_decode(**{name: views[name][:, s] for name in TOKEN_INPUTS}, **layer, conv_state=cs, state=sn,
                        lower_bound=lower_bound, l2_eps=l2_eps, norm_eps=norm_eps)
        live = s < total
        conv, st = torch.where(live.view(-1, 1, 1, 1), cs, conv), torch.where(live.view(-1, 1, 1, 1), sn, st)
        if mode == "verify":
            out = live & (s >= n_rep)
            y[rows[out], (s - n_rep)[out]] = yt[out]
    if mode != "verify":                    # rows with nothing to replay copy their base
        conv_out.copy_(conv)
        state_out.copy_(st)


class Kernel:
    """Stands in for the fused/kda_verify_cache_step module (fused.kda_verify_cache._kernel())."""
    CHUNK = CHUNK

    def __init__(self):
        from fused.kda_verify import KdaVerifyConfig
        self.KdaVerifyConfig = KdaVerifyConfig

    @staticmethod
    def _compile(mode, *static):
        return functools.partial(launch, mode)
