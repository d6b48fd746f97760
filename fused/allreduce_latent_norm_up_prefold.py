"""allreduce_latent_norm_up in two launches: the latent half folded once, then the one-launch tail on it.

fused.allreduce_latent_norm_up stages the folded latent rows in every CTA, because the RMS of a row
needs all L of its columns: each of its D / rows_per_cta CTAs reads all T x B x L partials. At K3
(L = 3584, D = 7168, 448 CTAs) and T = 8, B = 8, that is 205 MB of partial reads against w_up's 51 MB,
and the one launch is slower than the four it replaces. This form folds the partials once, through
fused.allreduce_fold, then runs the one-launch tail on the single folded partial of each half, so
each CTA stages B x L instead of T x B x L.

- Where the halves are the column slices of one gathered [T, B, L + D] row (as the layer's rank step
  hands them), one fold launch reads the whole row in place: two launches in all.
- Otherwise each half is folded on its own: three launches.
- Up to ONE_LAUNCH_MAX partial rows (T x B), the one-launch tail folds them itself: each CTA's extra
  reads are T x B x L elements from L2, and on the H100 at K3 the one launch took 23.8 us against the two
  launches' 25.5 at T = 8, B = 1 (8 rows), 29.2 against 27.5 at T = 16, B = 1 (16 rows)
  (results/performance.md, the tail op alone). At 16 rows the one launch is the slower alone, but in
  the layer's rank step it removes a launch and the gap before it. The bits are the same either way.

The rounding points are the reference's. allreduce_fold rounds the fp32 rank-order sum once to the
working dtype, exactly the `allreduce_fold` of each half in references.moe_tp, and a one-partial
fold in the tail is a copy. At T = 1 there is nothing to fold, and the tail runs alone.

The candidate: `--candidate fused.allreduce_latent_norm_up_prefold:allreduce_latent_norm_up`. Its
variants are the tail's tiles (each is certified).
"""
import torch

from fused import allreduce_fold as fold
from fused import allreduce_latent_norm_up as tail

DTYPES = tail.DTYPES
variants = tail.variants        # the tail's tiles: the fold's tile changes no bit (its order is per element)
ONE_LAUNCH_MAX = 16             # partial rows (T x B) up to which the one-launch tail folds them itself


def _one_row(y_parts: torch.Tensor, shared_parts: torch.Tensor) -> torch.Tensor | None:
    """The [T, B, L + D] tensor whose column slices y_parts and shared_parts are (shared right after
    the latent, the same strides, unit column stride), or None."""
    L = y_parts.shape[2]
    if (y_parts.stride() != shared_parts.stride() or y_parts.stride(2) != 1
            or y_parts.untyped_storage().data_ptr() != shared_parts.untyped_storage().data_ptr()
            or shared_parts.storage_offset() != y_parts.storage_offset() + L):
        return None
    T, B, D = shared_parts.shape
    return y_parts.as_strided((T, B, L + D), y_parts.stride())   # y_parts's storage offset: the row's start


def allreduce_latent_norm_up(prefix, y_parts, shared_parts, norm_w, w_up, eps: float, *, variant=None):
    """Fused replacement of references.moe_tp.allreduce_latent_norm_up (same signature) -> out [B, D]:
    fused.allreduce_fold of the partials (T > 1 and T x B > ONE_LAUNCH_MAX; one launch for a gathered
    row, else one per half), then fused.allreduce_latent_norm_up on the folded rows."""
    tail._check(prefix, y_parts, shared_parts, norm_w, w_up, eps)
    T, B, L = y_parts.shape
    if T > 1 and T * B > ONE_LAUNCH_MAX:
        row = _one_row(y_parts, shared_parts)
        if row is not None:
            folded = fold.allreduce_fold(row)[None]
            y_parts, shared_parts = folded[..., :L], folded[..., L:]
        else:
            y_parts, shared_parts = fold.allreduce_fold(y_parts)[None], fold.allreduce_fold(shared_parts)[None]
    return tail.allreduce_latent_norm_up(prefix, y_parts, shared_parts, norm_w, w_up, eps, variant=variant)
