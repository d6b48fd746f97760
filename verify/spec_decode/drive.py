"""One contract drive's inputs, drawn from its seed alone, and the reference run over a draft:
the layer and first committed state (the kda_decode case of the seed, verify.ops.kda), each step's
draft tokens and (n_tokens, accepted) counts, and references.kda.kda_decode over a draft in the working
dtype (the baseline) or float64 (the oracle)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from verify.spec_decode.design import TOKEN_INPUTS


@dataclass(frozen=True)
class Drive:
    """One contract run: what the harness drives the design over (all of it from `seed`)."""
    config: str = "tiny"
    dtype: str = "bfloat16"
    batch: int = 4
    n_q: int = 8
    steps: int = 64
    seed: int = 0
    device: str = "cpu"


# ---- drawing -------------------------------------------------------------------------------------

def _case(drive: Drive, seed: int):
    from verify.model.case import Case

    return Case(op="kda_decode", seed=seed, batch=drive.batch, config=drive.config, dtype=drive.dtype)


def start_inputs(drive: Drive):
    """The layer weights, scalars and first committed state: the kda_decode case of `seed`."""
    from verify.ops.kda import make_kda_decode_inputs

    return make_kda_decode_inputs(_case(drive, drive.seed))


def draft_tokens(drive: Drive, step: int) -> dict[str, torch.Tensor]:
    """Step `step`'s n_q draft tokens [B, n_q, ...]: token t is the token inputs of the kda_decode case of
    its own seed (the same token whatever n_q)."""
    from verify.ops.kda import make_kda_decode_inputs

    per = [make_kda_decode_inputs(_case(drive, drive.seed * 1_000_003 + 1 + 64 * step + t)).tensors
           for t in range(drive.n_q)]
    return {n: torch.stack([p[n] for p in per], dim=1) for n in TOKEN_INPUTS}


def draw_counts(drive: Drive, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_tokens, accepted) [B] int32 for `step`: all drafted and accepted at step 0, none accepted at
    step 1; then n_tokens = n_q half the time (else 1..n_q) and accepted 0, n_tokens or in between."""
    B, n = drive.batch, drive.n_q
    g = torch.Generator().manual_seed(drive.seed * 7919 + step)
    if step == 0:
        return torch.full((B,), n, dtype=torch.int32), torch.full((B,), n, dtype=torch.int32)
    n_tokens = torch.where(torch.rand(B, generator=g) < 0.5, torch.full((B,), n),
                           torch.randint(1, n + 1, (B,), generator=g)).to(torch.int32)
    if step == 1:
        return n_tokens, torch.zeros(B, dtype=torch.int32)
    kind = torch.randint(0, 4, (B,), generator=g)
    between = (torch.rand(B, generator=g) * (n_tokens + 1).double()).floor().to(torch.int32)
    accepted = torch.where(kind == 0, 0, torch.where(kind == 1, n_tokens, between)).to(torch.int32)
    return n_tokens, accepted


def as_drafted(tokens: dict, n_tokens: torch.Tensor) -> dict:
    """The draft as a design sees it: the slots past each sequence's n_tokens hold no token (NaN)."""
    n_q = next(iter(tokens.values())).shape[1]
    dead = torch.arange(n_q, device=n_tokens.device).view(1, n_q) >= n_tokens.view(-1, 1)
    return {k: v.masked_fill(dead.view(dead.shape + (1,) * (v.dim() - 2)), float("nan")) for k, v in tokens.items()}


# ---- the reference over a draft ------------------------------------------------------------------

def reference_draft(layer: dict, params: dict, conv: torch.Tensor, state: torch.Tensor, tokens: dict,
                    n_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """references.kda.kda_decode once per draft slot over the batch from (conv, state); a sequence
    keeps its state past its n_tokens. Returns y [B, n_q, C] and the conv and recurrent states after t
    tokens for t = 0..n_q, stacked [n_q + 1, B, ...]. Float64 tensors give the oracle."""
    from references.kda import kda_decode

    n_q = tokens["q_raw"].shape[1]
    B = conv.shape[0]
    ys, convs, states = [], [conv], [state]
    for t in range(n_q):
        cs, st = convs[-1].clone(), states[-1].clone()
        ys.append(kda_decode(**{n: tokens[n][:, t] for n in TOKEN_INPUTS}, **layer, conv_state=cs, state=st,
                             **params))
        live = (n_tokens > t).view(B, 1, 1, 1)
        convs.append(torch.where(live, cs, convs[-1]))
        states.append(torch.where(live, st, states[-1]))
    return torch.stack(ys, 1), torch.stack(convs), torch.stack(states)


def at_count(stacked: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Row b of stacked[count[b]] ([n_q + 1, B, ...] -> [B, ...])."""
    return stacked[count.long(), torch.arange(stacked.shape[1], device=stacked.device)]


def last_token_magnitude(layer64: dict, params: dict, tokens64: dict, convs64, states64, accepted) -> torch.Tensor:
    """decode_state_magnitude of each sequence's last accepted token (from the state before it): the
    floor scale kda_decode's spec judges that token's new state by (rows with a = 0 are not used)."""
    from verify.model.opdef import OpInputs
    from verify.ops.kda import decode_state_magnitude

    last = (accepted.long() - 1).clamp(min=0)
    rows = torch.arange(last.shape[0], device=last.device)
    t = {n: tokens64[n][rows, last] for n in TOKEN_INPUTS}
    t.update(layer64, conv_state=at_count(convs64, last), state=at_count(states64, last))
    return decode_state_magnitude(OpInputs(t, params))["state"]
