"""The stream-K partition (fused/streamk.py) that the wgmma kernel's stream-K variant runs: for any
(blocks, K/64, G) the kernel accepts, every (column block, k-tile) pair is covered by exactly one
CTA, each block's contributors and their k ranges are what the kernel's fold assumes (consecutive
CTAs in k order, slots contiguous in that order and never shared), and the workspace holds every
slot. The model is checked against a brute-force walk of the tiles, not against its own formulas."""
from hypothesis import given, settings
from hypothesis import strategies as st

from fused.streamk import StreamK


def _walk(p: StreamK):
    """Brute force: for each CTA, its tiles in order, as (block, k) pairs."""
    return {c: [divmod(t, p.kt) for t in range(c * p.tiles // p.ctas, (c + 1) * p.tiles // p.ctas)]
            for c in range(p.ctas)}


def _partitions():
    """Shapes the wgmma kernel takes: N/rows column blocks x K/64 k-tiles over G CTAs, T >= G."""
    return st.builds(lambda blocks, kt, g: StreamK(blocks, kt, g),
                     st.integers(1, 200), st.integers(1, 160), st.integers(1, 300)
                     ).filter(lambda p: p.problem() is None)


@settings(max_examples=400, deadline=None)
@given(p=_partitions())
def test_partition_covers_each_tile_once_and_folds_in_k_order(p):
    walk = _walk(p)
    seen = [(b, k) for c in range(p.ctas) for b, k in walk[c]]
    assert sorted(seen) == [(b, k) for b in range(p.blocks) for k in range(p.kt)]   # each pair once
    used_slots = set()
    for b in range(p.blocks):
        first, n = p.contributors(b)
        metb = [c for c in range(p.ctas) if any(bb == b for bb, _ in walk[c])]
        assert metb == list(range(first, first + n)), (b, first, n, metb)
        k_next = 0                                         # contributors in k order, back to back
        for c in metb:
            lo, hi = p.span(c)
            k0, k1 = p.k_range(b, lo, hi)
            assert [k for bb, k in walk[c] if bb == b] == list(range(k0, k1))
            assert k0 == k_next and k1 > k0
            k_next = k1
        assert k_next == p.kt
        assert (n == 1) == (p.k_range(b, *p.span(first)) == (0, p.kt))   # one contributor: stores y
        slots = [p.slot(b, c) for c in metb]
        assert slots == list(range(p.slot(b, first), p.slot(b, first) + n))   # fold reads slot0 + j
        if n > 1:
            assert not used_slots & set(slots), (b, slots)
            used_slots |= set(slots)
    assert all(0 <= s < p.slots for s in used_slots)


@settings(max_examples=400, deadline=None)
@given(p=_partitions())
def test_segments_of_a_cta_are_the_blocks_it_meets(p):
    for c, tiles in _walk(p).items():
        b0, nseg = p.segments(*p.span(c))
        assert list(range(b0, b0 + nseg)) == sorted({b for b, _ in tiles})
        assert all(p.owner(b * p.kt + k) == c for b, k in tiles)


@settings(max_examples=200, deadline=None)
@given(p=_partitions(), rows=st.sampled_from([64, 128]),
       m_pads=st.sets(st.sampled_from([8, 16, 32, 64]), min_size=2))
def test_summation_order_depends_on_shape_and_grid_only(p, rows, m_pads):
    """The variant's partition (hence every sum's order) is the same for every m_pad bucket and every
    stage count: it is built from (N, K, rows, G) alone."""
    from fused import skinny_gemm_wgmma as wg
    N, K = p.blocks * rows, p.kt * wg.BK
    parts = {wg.partition(N, K, wg.SkinnyGemmWgmmaConfig(m, rows, 3 + m % 5, 1, 1, streamk=p.ctas))
             for m in m_pads}
    assert parts == {StreamK(p.blocks, p.kt, p.ctas)}


def test_partition_rejects_what_the_kernel_cannot_run():
    assert "10 tiles (blocks x K/64) < 132 CTAs" in StreamK(5, 2, 132).problem()
    assert "overflows" in StreamK(4096, 4096, 264).problem()
    assert StreamK(56, 112, 132).problem() is None


def test_k3_shapes_partition():
    """The two shapes stream-K is for, at G = 132: 7168 -> 3584 (56 blocks x 112 k-tiles) gives each
    CTA 47-48 tiles, so a block has 3 or 4 contributors; 1536 -> 7168 (112 blocks x 24) 20-21 tiles,
    2 or 3; a CTA meets 1 or 2 blocks; no block is stored by one CTA alone (every one is folded)."""
    for p, counts in ((StreamK(56, 112, 132), {3, 4}), (StreamK(112, 24, 132), {2, 3})):
        assert {p.contributors(b)[1] for b in range(p.blocks)} == counts
        assert {p.segments(*p.span(c))[1] for c in range(p.ctas)} == {1, 2}
