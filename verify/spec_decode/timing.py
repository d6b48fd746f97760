"""`verify-kernels bench --spec-decode DESIGNS`: the speed of speculative-decoding rollback designs
through KDA at the K3 per-rank shapes, a verify step plus its accept, over many steps.

Per shape (T, B): heads H = 96 / T, Dh = 128, W = 4, n_q draft slots, every sequence drafting n_q
tokens and accepting a length drawn per step and sequence (uniform over 0..n_q, from the seed), so a
design whose cost varies across steps (the input cache writes back when it is full) is charged for
its write-backs. One timed call runs STEPS_PER_CALL steps on one copy of the design; copies are
rotated so that together they hold more than L2 (verify.bench.timing: CUDA events over CUDA-graph
replays, or launched from Python where a design cannot be captured, the method column says which).
The result is per step: the call's time divided by its steps.

Beside the designs: `decode`, one fused kda_decode launch per step (one token, the state updated in
place, no rollback): the one-token step the issue's goal compares with (the n_q-token step in at most
2 x its time). Every design is first judged by the spec-decode contract on a short drive on the same
device (small config, 8 steps): a design that fails it is refused, not timed. Values are random
normal draws (timing does not depend on them); the contract run is what judges numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verify.spec_decode.design import TOKEN_INPUTS

STEPS_PER_CALL = 8
GATE_STEPS = 8


@dataclass
class Row:
    T: int
    B: int
    heads: int
    timings: dict = field(default_factory=dict)        # design -> verify.bench.timing.Stats as a dict
    refused: dict = field(default_factory=dict)        # design -> why it was not timed here


def gate(names: list[str], n_q: int, seed: int) -> dict[str, str]:
    """design -> why it is refused (the contract failed or raised on a short CUDA drive); {} if none."""
    from verify.spec_decode.command import _factory
    from verify.spec_decode.contract import Drive, check_contract

    refused = {}
    for name in names:
        try:
            report = check_contract(_factory(name, "cuda"), Drive(config="small", batch=4, n_q=n_q, steps=GATE_STEPS,
                                                                 seed=seed, device="cuda"))
        except Exception as e:  # noqa: BLE001  (a design that raises is refused with the reason)
            refused[name] = f"the contract run raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            continue
        if not report.ok:
            bad = sorted({v.prop for v in report.violations} | set(report.unjudged))
            refused[name] = f"fails the spec-decode contract ({', '.join(bad)}) on small, {GATE_STEPS} steps"
    return refused


def _shape(T: int, B: int, n_q: int, seed: int, dtype=torch.bfloat16, device: str = "cuda") -> dict:
    """The layer, the committed state and STEPS_PER_CALL steps of draft tokens and accepted lengths."""
    from references.config import K3

    H, Dh, W = K3.heads_per_rank(T), K3.head_dim, K3.conv_kernel
    C = H * Dh
    g = torch.Generator(device=device).manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g, device=device)
    layer = dict(conv_w=rn(3, C, W) / 2, A_log=rn(H) / 2, dt_bias=rn(C) / 3, o_norm_w=1 + rn(Dh) / 5)
    params = dict(lower_bound=K3.gate_lower_bound, l2_eps=K3.l2_eps, norm_eps=K3.rms_eps)
    steps = []
    for _ in range(STEPS_PER_CALL):
        tok = {n: rn(B, n_q, H if n == "beta_raw" else C).to(dtype) for n in TOKEN_INPUTS}
        accepted = torch.randint(0, n_q + 1, (B,), generator=g, device=device, dtype=torch.int32)
        steps.append((tok, accepted))
    return {"H": H, "layer": layer, "params": params, "conv_state": rn(B, 3, C, W - 1).to(dtype),
            "state": rn(B, H, Dh, Dh) / 3, "steps": steps, "n_tokens": torch.full((B,), n_q, dtype=torch.int32,
                                                                                    device=device)}


def _design_calls(factory, s: dict, n_q: int, clock_sets) -> list:
    """One zero-argument call per design copy: STEPS_PER_CALL verify+accept steps on that copy."""
    calls = []
    for _ in range(clock_sets):
        d = factory()
        d.begin(conv_state=s["conv_state"], state=s["state"], **s["layer"], **s["params"], n_q=n_q)

        def call(d=d):
            for tok, accepted in s["steps"]:
                d.verify(**tok, n_tokens=s["n_tokens"])
                d.accept(accepted)
        calls.append(call)
    return calls


def _decode_calls(s: dict, clock_sets) -> list:
    """One fused kda_decode launch per step (token 0 of each step's draft), the state updated in place."""
    from fused.kda_decode import kda_decode

    calls = []
    for _ in range(clock_sets):
        cs, st = s["conv_state"].clone(), s["state"].clone()

        def call(cs=cs, st=st):
            for tok, _ in s["steps"]:
                kda_decode(**{n: t[:, 0] for n, t in tok.items()}, **s["layer"], conv_state=cs, state=st,
                           **s["params"])
        calls.append(call)
    return calls


def _copies(s: dict, n_q: int) -> int:
    """Design copies to rotate: their committed states and one step's checkpoints past L2."""
    from verify.bench.timing import sets_needed

    per_copy = s["state"].numel() * 4 * (1 + n_q) + s["conv_state"].numel() * 2 * (1 + n_q)
    return min(16, sets_needed(per_copy))


def time_designs(names: list[str], tps: list[int], batches: list[int], n_q: int, seed: int,
                 with_decode: bool = True, on_row=None) -> list[Row]:
    """Every design (and `decode`) at every (T, B): per-step Stats (gate() the designs first)."""
    from verify.bench.timing import GraphClock, time_launches
    from verify.spec_decode.command import _factory

    timed = list(names)
    factories = {n: _factory(n, "cuda") for n in timed}
    clock, rows = GraphClock(), []
    for T in tps:
        for B in batches:
            s = _shape(T, B, n_q, seed)
            row = Row(T, B, s["H"])
            sets = _copies(s, n_q)
            entries = ([("decode", lambda: _decode_calls(s, sets))] if with_decode else []) + \
                      [(n, lambda n=n: _design_calls(factories[n], s, n_q, sets)) for n in timed]
            for name, make in entries:
                try:
                    st = time_launches(make(), clock, min_calls=2 * sets)
                except Exception as e:  # noqa: BLE001  (one design failing at one shape is reported there)
                    torch.cuda.synchronize()
                    row.refused[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    continue
                d = st.to_dict()
                for k in ("median_us", "p10_us", "p90_us"):
                    d[k] = round(d[k] / STEPS_PER_CALL, 3)
                row.timings[name] = d
            rows.append(row)
            if on_row:
                on_row(row)
            del s
            torch.cuda.empty_cache()
    return rows


def table(rows: list[Row], names: list[str], n_q: int) -> str:
    """Markdown: us per step (verify + accept) of every design; `n_q x decode` (that many one-token
    launches, no rollback kept: the floor a per-token engine pays), and each design over `decode`."""
    cols = ["decode"] + names
    head = (f"| T | H | B | decode | {n_q} x decode | " + " | ".join(names) + " | "
            + " | ".join(f"{n} / decode" for n in names) + " |")
    lines = [f"us per step (n_q = {n_q} drafted, a random accepted length per sequence and step; decode: one "
             f"fused kda_decode token per step)", "", head, "|" + "---|" * (4 + 2 * len(names))]
    for r in rows:
        us = {n: r.timings[n]["median_us"] for n in cols if n in r.timings}
        cells = [f"{us[n]:.1f}" + ("" if r.timings[n]["method"] == "graph" else " (stream)") if n in us
                 else "refused" for n in cols]
        cells.insert(1, f"{n_q * us['decode']:.1f}" if "decode" in us else "-")
        ratios = [f"{us[n] / us['decode']:.2f}" if n in us and "decode" in us else "-" for n in names]
        lines.append(f"| {r.T} | {r.heads} | {r.B} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)
