"""Planted candidates for the release-gate tests: each breaks the worker or its guards in one way.

All wrap references.attn_res:attn_res_rmsnorm (fast, no vacuous cases). Import path:
property_tests.planted_release:<name>.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time

from references.attn_res import attn_res_rmsnorm as correct


def raising(**kw):
    raise RuntimeError("planted: this candidate always raises")


def hanging(**kw):
    time.sleep(3600)


def exiting(**kw):
    os._exit(3)


def segfaulting(**kw):
    ctypes.string_at(0)                       # read address 0: SIGSEGV
    os.kill(os.getpid(), signal.SIGSEGV)      # in case the read was somehow allowed


def corrupting(**kw):
    """Correct result, but writes 4 elements just past the end of its `delta` input."""
    out = correct(**kw)
    d = kw["delta"]
    end = d.storage_offset() + (d.shape[0] - 1) * d.stride(0) + (d.shape[1] - 1) * d.stride(1) + 1
    d.as_strided((4,), (1,), end).fill_(7.0)
    return out


def printing(**kw):
    print("planted: chatter on stdout must not break the worker protocol")
    return correct(**kw)
