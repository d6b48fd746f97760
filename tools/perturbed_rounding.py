"""A legitimate other implementation of a reference layer, as a candidate: the reference itself with
every fp32 -> bf16/fp16 rounding taken from a value moved by a relative REL (a random sign per
element, the same draws on every call, so the candidate is deterministic). A fused kernel that sums in
another fp32 order differs from the reference by about this much before each rounding (REL = 2^-20:
a few-hundred-term fp32 sum in another order), so a derived tolerance must accept this candidate.

    VK_PERTURB_REL=9.5e-7 verify-kernels run --ops kda_layer --candidate tools.perturbed_rounding:kda_layer_steps

(REL defaults to 2^-20.) It measures how much room a spec leaves a correct kernel, not a kernel."""
from __future__ import annotations

import os

import torch

import references.layers as layers

_to = torch.Tensor.to
_LOW = (torch.float16, torch.bfloat16)


def _perturbing(gen: torch.Generator, rel: float):
    def to(self, *args, **kwargs):
        dtype = args[0] if args and isinstance(args[0], torch.dtype) else kwargs.get("dtype")
        if dtype in _LOW and self.dtype in (torch.float32, torch.float64):
            sign = torch.randint(0, 2, self.shape, generator=gen).to(self.device, self.dtype) * 2 - 1
            return _to(self * (1 + rel * sign), *args, **kwargs)
        return _to(self, *args, **kwargs)
    return to


def _wrap(step):
    def candidate(*args, **kwargs):
        rel = float(os.environ.get("VK_PERTURB_REL", 2.0 ** -20))
        torch.Tensor.to = _perturbing(torch.Generator().manual_seed(0), rel)
        try:
            return step(*args, **kwargs)
        finally:
            torch.Tensor.to = _to
    candidate.__doc__ = f"{step.__name__} with its roundings to wd perturbed (tools/perturbed_rounding.py)"
    return candidate


kda_layer_steps = _wrap(layers.kda_layer_steps)
mla_layer_steps = _wrap(layers.mla_layer_steps)
