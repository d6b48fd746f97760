"""Edge-case inputs of moe_experts_mxfp4 (knob sweep cases of verify/ops/moe.py). No OPS here.

routing='edges' (any B; parts that need more tokens or experts are left out where they do not fit):
  - token 0's k experts are chosen by no other token, and its slots 0 and 1 hold mirror experts
    (same w13, w2 with every code's sign flipped, so their outputs cancel exactly) with weights
    w and w (1 - 2^-8) (w in 0.3..0.7), its other slots weights near 0: y[0] is a 2^-8 remainder of two large terms,
    which a combine that rounds its partial sums to wd gets wrong by many ulps;
  - token 1: weight exactly 1 in slot 0, 2^-20-scale weights in the others (near 0), one exactly 0;
  - token B-1: its slot-0 expert is chosen by no other token (one token of B).
routing='same': every token routes to the same k experts, each in its own slot order.
scales='every_byte': in token 0's slot-0 expert its w13 scale bytes run through 0..254 and its w2 bytes through 0..131 plus one 0xFF (one NaN output column of
  its tokens); groups whose byte is above 131 get zero codes (+0 values: a decode that turns a large
  scale into inf gives 0 * inf = NaN there), so every value stays in the working dtypes' range.
"""
import torch

SAFE_BYTE = 131             # largest scale byte whose codes stay drawn: |w| <= 6 * 2^4 (fp16-safe sums)
MIRROR_RATIO = 1.0 - 2.0 ** -8


def edge_routing(kind: str, g: torch.Generator, ids: torch.Tensor, weights: torch.Tensor, E: int):
    """(ids, weights) of routing knob `kind` ('edges' or 'same'), from the drawn ones' shapes."""
    B, k = ids.shape
    perm = torch.randperm(E, generator=g)
    if kind == "same":
        chosen = perm[:k]
        ids = torch.stack([chosen[torch.randperm(k, generator=g)] for _ in range(B)]).contiguous()
        return ids, weights
    if kind != "edges":
        raise ValueError(f"knob routing={kind!r} is unknown; use 'edges' or 'same'")
    rest = perm[k:]
    exclusive_last = B >= 3 and E >= 2 * k + 1
    pool = rest[1:] if exclusive_last else rest
    rows = [perm[:k]]
    for b in range(1, B):
        row = pool[torch.randperm(len(pool), generator=g)[:k]]
        if exclusive_last and b == B - 1:
            row[0] = rest[0]
        rows.append(row)
    ids = torch.stack(rows).contiguous() if len(pool) >= k else ids
    weights = weights.clone()
    weights[0] = torch.rand(k, generator=g) * 2.0 ** -12
    w = 0.3 + 0.4 * float(torch.rand((), generator=g))     # no power of two: w * o rounds in wd
    weights[0, 0] = w
    weights[0, 1] = w * MIRROR_RATIO
    if B >= 2:
        weights[1] = torch.rand(k, generator=g) * 2.0 ** -20
        weights[1, 0] = 1.0
        weights[1, -1] = 0.0
    return ids, weights


def mirror_expert(ids: torch.Tensor, w13_p, w13_s, w2_p, w2_s):
    """Token 0's slot-1 expert made the mirror of its slot-0 expert (same w13, negated w2)."""
    if ids.shape[1] < 2:
        return w13_p, w13_s, w2_p, w2_s
    a, b = int(ids[0, 0]), int(ids[0, 1])
    w13_p, w13_s, w2_p, w2_s = (t.clone() for t in (w13_p, w13_s, w2_p, w2_s))
    w13_p[b], w13_s[b], w2_s[b] = w13_p[a], w13_s[a], w2_s[a]
    w2_p[b] = w2_p[a] ^ 0x88                      # both nibbles' sign bits
    return w13_p, w13_s, w2_p, w2_s


def every_byte_scales(g: torch.Generator, e: int, w13_p, w13_s, w2_p, w2_s):
    """Expert e's scale bytes cover 0..255 (see the module doc); codes of groups above SAFE_BYTE zeroed."""
    w13_p, w13_s, w2_p, w2_s = (t.clone() for t in (w13_p, w13_s, w2_p, w2_s))
    s13 = torch.arange(255, dtype=torch.uint8)
    n13 = w13_s[e].numel()
    order13 = torch.cat([s13[torch.randperm(255, generator=g)][:n13],
                         s13[torch.randint(0, 255, (max(0, n13 - 255),), generator=g)]])
    w13_s[e] = order13.reshape(w13_s[e].shape)
    s2 = torch.arange(SAFE_BYTE + 1, dtype=torch.uint8)
    n2 = w2_s[e].numel()
    order2 = torch.cat([s2[torch.randperm(len(s2), generator=g)][:n2],
                        s2[torch.randint(0, len(s2), (max(0, n2 - len(s2)),), generator=g)]])
    order2[int(torch.randint(0, n2, (1,), generator=g))] = 0xFF
    w2_s[e] = order2.reshape(w2_s[e].shape)
    for packed, scale in ((w13_p[e], w13_s[e]), (w2_p[e], w2_s[e])):
        big = (scale > SAFE_BYTE) & (scale != 0xFF)
        packed.view(scale.shape[0], scale.shape[1], -1)[big] = 0   # 16 bytes of codes per group
    return w13_p, w13_s, w2_p, w2_s
