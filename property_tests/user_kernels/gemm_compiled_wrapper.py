"""A candidate module as third-party kernel libraries write them (fla-core, for one): it imports
torch._inductor and defines a module-level torch.compile function it never calls on this path. Loading
inductor defines new operators (prims ops among them) through torch.library; no kernel of an existing
operator is replaced, so nothing the reference runs on changed and the candidate must certify."""
from __future__ import annotations

import torch
import torch._inductor  # noqa: F401

from references.gemm import skinny_gemm as _reference


@torch.compile(dynamic=True)
def _unused_compiled(x, w):
    return _reference(x, w)


def skinny_gemm(x, w):
    """The reference's own arithmetic, one row at a time (batch-position invariant bits)."""
    return torch.cat([_reference(row[None], w) for row in x])
