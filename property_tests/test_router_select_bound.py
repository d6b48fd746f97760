"""The threshold top-k of fused/router_topk.py (`select="threshold"`), modelled step by step in
Python on the CPU: thread t of T holds experts t, t+T, ...; the k-th best thread maximum bounds the
candidates; each candidate's rank among the candidates is its place in the top k. Checked against
the reference's stable descending sort (references.moe.select_topk) on drawn scores with exact ties,
so the argument in the kernel's docstring is tested, not only the kernel's agreement on the GPU."""
import struct

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from references.moe import select_topk

MIN_KEY = -(1 << 63)


def key_of(c: float, e: int, E: int) -> int:
    """The kernel's key: signed-monotone fp32 bits (-0 as +0) above E-1-e."""
    c = 0.0 if c == 0.0 else c
    bits = struct.unpack("<i", struct.pack("<f", c))[0]
    mono = bits if bits >= 0 else bits ^ 0x7FFFFFFF
    return (mono << 32) | (E - 1 - e)


def threshold_topk(choice: list[float], k: int, T: int, warp_bound: bool = False) -> tuple[list[int], int]:
    """bound="cta": the k-th best of the T thread maxima; bound="warp": the best of each warp's k-th
    best thread maximum."""
    E = len(choice)
    keys = {e: key_of(choice[e], e, E) for e in range(E)}
    best = [max((keys[e] for e in range(t, E, T)), default=MIN_KEY) for t in range(T)]
    groups = [best[w:w + 32] for w in range(0, T, 32)] if warp_bound else [best]
    bound = MIN_KEY
    for g in groups:
        for m in g:
            if sum(b > m for b in g) == k - 1 and m > MIN_KEY:
                bound = max(bound, m)
    cand = [keys[e] for e in range(E) if keys[e] >= bound]
    assert len(cand) <= k * -(-E // T) * len(groups)        # the kernel's shared-memory capacity
    out = [None] * k
    for c in cand:
        r = sum(m > c for m in cand)
        if r < k:
            out[r] = E - 1 - (c & 0xFFFFFFFF)
    return out, len(cand)


fp32 = st.floats(-4, 4, width=32, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), E=st.integers(1, 300), T=st.sampled_from([32, 64, 128, 256]),
       distinct=st.integers(1, 40), warp_bound=st.booleans())
def test_threshold_select_is_the_stable_descending_top_k(data, E, T, distinct, warp_bound):
    k = data.draw(st.integers(1, min(32, E)))
    pool = data.draw(st.lists(fp32, min_size=distinct, max_size=distinct))     # few values: many ties
    choice = [pool[data.draw(st.integers(0, distinct - 1))] for _ in range(E)]
    got, _ = threshold_topk(choice, k, T, warp_bound)
    want = select_topk(torch.tensor([choice], dtype=torch.float32), k)[0].tolist()
    assert got == want


def test_signed_zeros_tie_and_the_lower_id_wins():
    got, _ = threshold_topk([-0.0, 0.0, -0.0, 1.0], 3, 32)
    assert got == [3, 0, 1]


def test_concentrated_top_k_gives_many_candidates_within_the_capacity():
    """k - 1 threads hold only top values and the k-th thread's best is just above the rest: every
    expert of those k - 1 threads is a candidate ((k - 1) * per_lane + 1 of them, under k * per_lane),
    and the select still returns the right k."""
    E, T, k = 896, 128, 16
    choice = [0.0] * E
    for t in range(k - 1):
        for e in range(t, E, T):
            choice[e] = 2.0 + e / E
    choice[k - 1] = 1.5
    got, n = threshold_topk(choice, k, T)
    assert n == (k - 1) * (E // T) + 1
    assert got == select_topk(torch.tensor([choice]), k)[0].tolist()
