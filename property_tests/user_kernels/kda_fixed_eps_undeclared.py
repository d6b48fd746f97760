"""The kernel of kda_fixed_eps without its PARAMS declaration: judged on the whole contract, it is
wrong wherever a case draws another l2_eps."""
from __future__ import annotations

from property_tests.user_kernels import kda_fixed_eps


def kda_decode(*args, **kwargs):
    return kda_fixed_eps.kda_decode(*args, **kwargs)
