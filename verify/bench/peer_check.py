"""Does a whole-op peer compute the op? A speed comparison with an adapter that computes something else
means nothing, and peers are not certified: each row runs the peer and the reference once on copies of
its first input set and says how far apart their outputs are. Integer outputs (ids) must match as sets
per row; float outputs are compared positionally, or sorted per row when the op returns ids (their
order follows the ids). The result is a note in the row, not a verdict: another library rounds and
breaks ties its own way. A float output that differs says in how many of its rows (along the last dim) and
how close the other rows are: a few whole rows apart with the rest close is the mark of a near-tie
choice (a layer's router picking another top-k inside its tie band, which certification judges
tie-aware; tools/diag_layer_rows.py tells it from a wrong row), every row apart that of another op."""
from __future__ import annotations

REL_TOL = 0.05


def _tensors(result) -> list:
    import torch

    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in (result or ()) if isinstance(t, torch.Tensor)]


def _one_step(ref, peer):
    """A per-step peer's output [B, ...] against the reference's steps axis of one step [1, B, ...]
    (a layer peer times one decode step; the case then holds one): the reference's one step."""
    if ref.dim() == peer.dim() + 1 and ref.shape[0] == 1 and ref.shape[1:] == peer.shape:
        return ref[0]
    return ref


def compare(ref_out, peer_out) -> str:
    import torch

    ref, peer = _tensors(ref_out), _tensors(peer_out)
    ref = [_one_step(a, b) for a, b in zip(ref, peer)] + ref[len(peer):]
    left = ""
    if 0 < len(peer) < len(ref) and all(not t.is_floating_point() for t in ref[len(peer):]):
        # a layer's step launch returns its prefix, not the step's router ids: judged on what it returns
        left, ref = f" (the reference's last {len(ref) - len(peer)} integer outputs not returned)", ref[:len(peer)]
    if len(ref) != len(peer) or any(a.shape != b.shape for a, b in zip(ref, peer)):
        return (f"DIFFERS: outputs {[tuple(t.shape) for t in peer]} against the reference's "
                f"{[tuple(t.shape) for t in ref]}")
    has_ids = any(not t.is_floating_point() for t in ref)
    worst, rows = 0.0, ""
    for a, b in zip(ref, peer):
        if not a.is_floating_point():
            if not torch.equal(a.sort(-1).values, b.to(a.dtype).sort(-1).values):
                rows = int((a.sort(-1).values != b.to(a.dtype).sort(-1).values).any(-1).sum())
                return f"DIFFERS: ids differ in {rows} of {a.shape[0]} rows"
            continue
        a, b = a.double(), b.double()
        if has_ids:
            a, b = a.sort(-1).values, b.sort(-1).values
        scale = a.abs().max().clamp_min(1e-30)
        rel = ((a - b).abs() / scale).nan_to_num(nan=float("inf"))
        this = float(rel.max()) if rel.numel() else 0.0
        if this > REL_TOL and this > worst and a.dim() >= 2:
            rows = _rows_apart(rel.flatten(0, -2).amax(-1))
        worst = max(worst, this)
    return ("ok" if worst <= REL_TOL else "DIFFERS") + f": max |peer - reference| / max |reference| = {worst:.2g}" + (
        rows if worst > REL_TOL else "") + left


def _rows_apart(per_row) -> str:
    """' in n of N rows (the others <= x)' from each row's largest relative difference."""
    apart = per_row > REL_TOL
    n, total = int(apart.sum()), per_row.numel()
    rest = per_row[~apart]
    return f" in {n} of {total} rows" + (f" (the others <= {float(rest.max()):.2g})" if rest.numel() else "")


def check(op, inputs, reference, prepare) -> str:
    """Run the reference and the peer (prepare(tensors, params) -> launch) on copies of the op's state
    in `inputs` (the other inputs are read only, shared: a K3 layer's weights are 16 GB)."""
    def fresh():
        return {k: v.clone() if k in op.state else v for k, v in inputs.tensors.items()}
    ref_out = reference(**fresh(), **inputs.params)
    peer_out = prepare(fresh(), dict(inputs.params))()
    return compare(ref_out, peer_out)
