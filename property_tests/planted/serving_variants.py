"""A serving-engine bug in a declared launch variant (a serving engine's autotuner): the module lists
two variants the engine's autotuner picks between (`variants`, passed as variant=); "splitk" prepacks
each weight tensor once, keyed by the tensor, and never sees new values written into it. The default
launch is clean. The refreshed-inputs and warmed-up runs judge the default launch only."""
from __future__ import annotations

import torch

from property_tests.planted._cache import TensorKeyed
from references.gemm import skinny_gemm as _ref

_PACKED = TensorKeyed()


def variants(tensors, params):
    return ["splitk", "stream"]


def skinny_gemm_variant_stale_prepack(x, w, *, variant=None):
    if variant == "splitk":
        packed = _PACKED.get(w)
        if packed is None:
            packed = w.float().clone()
            _PACKED.put(w, packed)
        return (x.float() @ packed.T).to(x.dtype)
    return _ref(x, w)
