"""Does a whole-op peer compute the op? A speed comparison with an adapter that computes something else
means nothing, and peers are not certified: each row runs the peer and the reference once on copies of
its first input set and says how far apart their outputs are. Integer outputs (ids) must match as sets
per row; float outputs are compared positionally, or sorted per row when the op returns ids (their
order follows the ids). The result is a note in the row, not a verdict: another library rounds and
breaks ties its own way."""
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
    worst = 0.0
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
        worst = max(worst, float(((a - b).abs().max() / scale).nan_to_num(nan=float("inf"))))
    return ("ok" if worst <= REL_TOL else "DIFFERS") + f": max |peer - reference| / max |reference| = {worst:.2g}" + left


def check(op, inputs, reference, prepare) -> str:
    """Run the reference and the peer (prepare(tensors, params) -> launch) on copies of the op's state
    in `inputs` (the other inputs are read only, shared: a K3 layer's weights are 16 GB)."""
    def fresh():
        return {k: v.clone() if k in op.state else v for k, v in inputs.tensors.items()}
    ref_out = reference(**fresh(), **inputs.params)
    peer_out = prepare(fresh(), dict(inputs.params))()
    return compare(ref_out, peer_out)
