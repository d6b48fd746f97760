"""Planted bugs that leave the process changed, or hand back a right value in a wrong form, in
skinny_gemm (references.gemm:skinny_gemm): x[M,K], w[N,K] -> y[M,N]. Each output is correct; what
the call leaves behind reaches the reference's later runs and every other caller of torch."""
from __future__ import annotations

import os
import warnings

import torch
from torch.overrides import TorchFunctionMode

from references.primitives import linear


def _bf16_matmul(a, b, *, out=None):
    return torch.Tensor.matmul(a.to(torch.bfloat16), b.to(torch.bfloat16)).to(a.dtype)


def skinny_gemm_patches_torch_matmul(x, w):
    """Installs its own torch.matmul ("use the fast path everywhere") and leaves it installed: every
    later fp32 matmul of the process, the reference's included, runs in bf16."""
    torch.matmul = _bf16_matmul
    return linear(x, w)


class _Timing(TorchFunctionMode):
    """A profiling mode a kernel wrapper enters and forgets to exit."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def skinny_gemm_leaves_function_mode(x, w):
    """Enters a TorchFunctionMode (a timing hook) and never exits it: every later torch call of the
    process goes through it."""
    _Timing().__enter__()
    return linear(x, w)


def skinny_gemm_sets_default_device(x, w):
    """Calls torch.set_default_device to build its workspace and leaves it set: every later factory
    call of the process (torch.empty, torch.zeros) lands there."""
    torch.set_default_device(x.device)
    return linear(x, w)


def skinny_gemm_silences_warnings(x, w):
    """Silences every warning of the process (to hide its own deprecation warning): it outlives the call."""
    warnings.simplefilter("ignore")
    return linear(x, w)


def skinny_gemm_overrides_environ(x, w):
    """Rewrites a variable of the process's environment (its own launcher's tuning switch): every
    later subprocess and lazily initialised library reads the new value."""
    os.environ["PATH"] = "/opt/skinny_gemm/bin:" + os.environ.get("PATH", "")
    return linear(x, w)


def skinny_gemm_disables_mkldnn(x, w):
    """Turns oneDNN off (torch.backends.mkldnn.enabled = False) to dodge a slow path and leaves it off."""
    torch.backends.mkldnn.enabled = False
    return linear(x, w)


def skinny_gemm_transposed_out(x, w):
    """Computes y^T = w x^T (the weights as the MMA's M operand) and returns its transpose: right
    values, column-major storage; the next kernel reads data_ptr() row-major."""
    return linear(w, x).t()


def skinny_gemm_requires_grad_out(x, w):
    """Returns its output as a leaf that requires grad (an nn.Parameter-style workspace)."""
    return linear(x, w).requires_grad_(True)


_CALLS: dict[tuple, list] = {}


def skinny_gemm_graph_after_warmup(x, w):
    """After 40 calls of a shape the wrapper "captures a CUDA graph" and from then on replays it: on
    the tensors recorded at capture (stale pointers), whatever it is called on."""
    seen = _CALLS.setdefault((tuple(x.shape), tuple(w.shape), x.dtype), [])
    if len(seen) < 40:
        seen.append((x.clone(), w.clone()))
        return linear(x, w)
    x0, w0 = seen[-1]
    return linear(x0, w0)
