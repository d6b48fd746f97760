"""shared_experts: y[B, D] = wd(situ_and_mul(wd(x @ w_gate_up.T)) @ w_down.T), three launches on a side
stream.

Launch 1 is the project's skinny GEMM (fused/skinny_gemm.py, its dispatcher picks SIMT or wgmma by
B): h = x @ w_gate_up.T, fp32 accumulation, rounded to wd into a scratch [B, 2I] ([gate | up]).
A per-rank intermediate that is not a multiple of 8 (the tiny and small configs split 16 ways) runs
with h and w_down zero-padded to the next multiple (`_padded`). Launch 2 (`SituMul`) is SiTU-and-mul: a thread per 16-byte chunk of the gate half and the matching
chunk of the up half, in fp32 in the reference's order, a = wd((beta tanh(g / beta) sigmoid(g)) *
(lbeta tanh(u / lbeta))), into a scratch [B, I]. Launch 3 is skinny_gemm again: y = a @ w_down.T,
rounded once. The roundings are the reference's three, in its places.

Side stream: the shared experts do not depend on the routed experts, so they run on a second stream
and overlap them. `start` records an event on the caller's current stream and makes the side stream
wait on it (x, the weights and out are ready; under CUDA-graph capture this forks the capture onto
the side stream), launches the three kernels there, and records a second event after the last one;
`Pending.wait()` makes the caller's current stream wait on that event (the join; under capture it
brings the side branch back into the graph). The caller does its other work between the two.
`shared_experts(...)` is start + wait at once (the harness's entry point). Scratch is allocated on
the side stream (its memory is reused only after the side stream's work), and x, the weights and out
are marked as used by the side stream (record_stream) outside capture.

As custom ops (torch.compile, CUDA graphs): `shared_experts_fork` (the launches on this module's
side stream of the device, mutates out) and `shared_experts_join` (the wait, mutates out, so
everything that reads out is ordered after it). The batch is dynamic: one compile per (dtype, I)
for SiTU-and-mul and per (N, K, variant) for the GEMMs.
"""

from dataclasses import dataclass

import torch

from fused import runtime
from fused import skinny_gemm as sg
from references.primitives import check_tensor

DTYPES = ("bfloat16", "float16")   # working dtypes of every operand (the harness draws only these)
THREADS = 128                      # threads per CTA of the SiTU-and-mul kernel
VEC = 8                            # elements of a 16-byte chunk (2-byte dtypes)


@dataclass(frozen=True)
class SharedExpertsConfig:
    """The two GEMMs' variants (None: skinny_gemm's dispatcher for that launch)."""
    gate_up: sg.Config | None
    down: sg.Config | None

    @property
    def name(self) -> str:
        g = "default" if self.gate_up is None else self.gate_up.name
        d = "default" if self.down is None else self.down.name
        return f"gu_{g}+down_{d}"


class SituMul:
    """Compile-time configuration: the intermediate width I (gate and up halves of h)."""

    def __init__(self, inter: int):
        if inter % VEC:
            raise ValueError(f"w_down: intermediate {inter} must be a multiple of {VEC} (16-byte loads)")
        self.inter = inter
        self.chunks = inter // VEC

    def jit_host(self):
        _, cute = runtime.cutlass_modules()
        from cutlass import Float32
        kernel = self.device_kernel()
        grid_x = -(-self.chunks // THREADS)

        @cute.jit
        def host(mH: cute.Tensor, mA: cute.Tensor, beta: Float32, lbeta: Float32, stream):
            gH = cute.zipped_divide(mH, (1, VEC))
            gA = cute.zipped_divide(mA, (1, VEC))
            kernel(gH, gA, beta, lbeta).launch(grid=[grid_x, mA.shape[0], 1], block=[THREADS, 1, 1],
                                               stream=stream)

        return host

    def device_kernel(self):
        cutlass, cute = runtime.cutlass_modules()
        from cutlass import Float32
        CH = self.chunks

        @cute.kernel
        def kernel(gH: cute.Tensor, gA: cute.Tensor, beta: Float32, lbeta: Float32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, b, _ = cute.arch.block_idx()
            c = bidx * THREADS + tidx
            if c < CH:
                g = gH[None, (b, c)].load().to(Float32)
                u = gH[None, (b, CH + c)].load().to(Float32)
                res = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
                for e in cutlass.range_constexpr(VEC):
                    sig = Float32(1.0) / (Float32(1.0) + cute.math.exp(-g[e]))
                    act = beta * cute.math.tanh(g[e] / beta) * sig
                    up = lbeta * cute.math.tanh(u[e] / lbeta)
                    res[e] = act * up
                gA[None, (b, c)].store(res.load().to(gA.element_type))

        return kernel


@runtime.compile_cache("shared_experts")
def _compile(dtype: str, inter: int):
    """The SiTU-and-mul kernel: h (?, 2I), a (?, I), beta, linear beta."""
    from cutlass import Float32
    b = runtime.sym_int()
    return runtime.compile_tvm_ffi(SituMul(inter).jit_host(), runtime.fake_tensor(dtype, (b, 2 * inter)),
                                   runtime.fake_tensor(dtype, (b, inter)), Float32(4.0), Float32(25.0))


def _wg(stages: int, ksplit: int, occupancy: int) -> "sg.SkinnyGemmWgmmaConfig":
    return sg.SkinnyGemmWgmmaConfig(m_pad=64, rows=64, stages=stages, ksplit=ksplit, occupancy=occupancy)


# The GEMM pair for 33 <= B <= 64 (skinny_gemm's m_pad 64 bucket) at the K3 per-rank shapes, (D, I) ->
# (gate_up, down): the fastest pair of variants() that `bench --variants` timed at B = 64 on the H200.
# skinny_gemm's dispatcher has no wgmma default for the down GEMM's shapes (N = 7168, K = I), so it
# ran SIMT there: the dispatcher's pair took 275 / 79 / 79 us at T = 1 / 8 / 16, these 76 / 25 / 30 us.
# Below 33 and at other shapes the pair is skinny_gemm's dispatcher's.
M64_PAIRS = {
    (7168, 6144): (_wg(6, 1, 2), _wg(12, 1, 1)),
    (7168, 768): (_wg(12, 5, 1), _wg(12, 1, 1)),
    (7168, 384): (_wg(12, 11, 1), _wg(6, 1, 2)),
}


def picks(B: int, D: int, inter: int) -> tuple:
    """(gate_up, down) GEMM configs launched for B tokens of hidden D and per-rank intermediate I
    (the down GEMM's K is I padded to a multiple of 8)."""
    pair = M64_PAIRS.get((D, inter)) if 33 <= B <= 64 else None
    if pair is not None:
        return pair
    width = -(-inter // VEC) * VEC
    return sg.default_config(B, 2 * inter, D), sg.default_config(B, D, width)


def _check(x, w_gate_up, w_down, situ_beta, situ_linear_beta, out):
    check_tensor("x", x, ndim=2, dtypes=(torch.bfloat16, torch.float16))
    B, D = x.shape
    check_tensor("w_gate_up", w_gate_up, shape=(None, D), dtypes=(x.dtype,))
    if w_gate_up.shape[0] % 2:
        raise ValueError(f"w_gate_up: rows {w_gate_up.shape[0]} must be even ([gate; up] halves)")
    inter = w_gate_up.shape[0] // 2
    check_tensor("w_down", w_down, shape=(D, inter), dtypes=(x.dtype,))
    if out is not None:
        check_tensor("out", out, shape=(B, D), dtypes=(x.dtype,))
    if D % VEC:
        raise ValueError(f"x: hidden={D} must be a multiple of {VEC} (16-byte loads)")
    for name, v in (("situ_beta", situ_beta), ("situ_linear_beta", situ_linear_beta)):
        if not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{name}: {v!r} must be a positive float")
    runtime.require_cuda("x", x)


def launch(x, w_gate_up, w_down, situ_beta: float, situ_linear_beta: float, out,
           variant: SharedExpertsConfig | None = None) -> None:
    """The three launches on the current stream (no stream switch); writes out [B, D]."""
    B = x.shape[0]
    if B == 0:
        return
    inter = w_down.shape[1]
    pick_gu, pick_d = picks(B, x.shape[1], inter)
    if variant is not None:
        pick_gu, pick_d = variant.gate_up or pick_gu, variant.down or pick_d
    h = torch.empty(B, 2 * inter, dtype=x.dtype, device=x.device)
    sg.launch(x, w_gate_up, h, pick_gu)
    if inter % VEC:
        h, w_down = _padded(h, w_down)
    width = w_down.shape[1]
    a = torch.empty(B, width, dtype=x.dtype, device=x.device)
    _compile(runtime.dtype_name(x.dtype), width)(h, a, float(situ_beta), float(situ_linear_beta))
    sg.launch(a, w_down, out, pick_d)


def _padded(h, w_down):
    """A per-rank width I that is not a multiple of 8 (tiny / small splits only: every K3 width is) as
    the next multiple: h's gate and up halves each followed by zero columns (SiTU-and-mul of (0, 0) is
    exactly 0), w_down followed by zero columns (0 x 0 adds nothing to any sum)."""
    B, inter = h.shape[0], h.shape[1] // 2
    width = -(-inter // VEC) * VEC
    hp = h.new_zeros(B, 2 * width)
    hp[:, :inter] = h[:, :inter]
    hp[:, width:width + inter] = h[:, inter:]
    return hp, torch.nn.functional.pad(w_down, (0, width - inter))


_side_streams: dict[int, torch.cuda.Stream] = {}


def side_stream(device) -> torch.cuda.Stream:
    """This module's side stream of a device (created once; the custom-op form runs there)."""
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    if idx not in _side_streams:
        _side_streams[idx] = torch.cuda.Stream(device=idx)
    return _side_streams[idx]


def _fork(side: torch.cuda.Stream) -> None:
    """The side stream waits for everything the caller's current stream has queued (x, out ready)."""
    side.wait_stream(torch.cuda.current_stream(side.device))


def _join(done: torch.cuda.Event) -> None:
    """The caller's current stream waits for the side stream's last launch."""
    torch.cuda.current_stream().wait_event(done)


def _run_on_side(side, x, w_gate_up, w_down, situ_beta, situ_linear_beta, out, variant) -> torch.cuda.Event:
    """Fork, the launches on `side`, and the event after the last one (returned, not yet waited on)."""
    _fork(side)
    if not torch.cuda.is_current_stream_capturing():
        for t in (x, w_gate_up, w_down, out):       # the allocator keeps them until the side work is done
            t.record_stream(side)
    with torch.cuda.stream(side):
        launch(x, w_gate_up, w_down, situ_beta, situ_linear_beta, out, variant)
        done = torch.cuda.Event()
        done.record(side)
    return done


class Pending:
    """A started shared-experts run: `out` is valid on the caller's stream after `wait()`."""

    def __init__(self, out, done: torch.cuda.Event | None):
        self.out, self._done = out, done

    def wait(self):
        """Join: the caller's current stream waits on the side stream's last launch; returns out."""
        if self._done is None:
            _join_op()(self.out)
        else:
            _join(self._done)
        return self.out


# custom-op form: the fork's event, per output buffer, until its join
_pending: dict[int, torch.cuda.Event] = {}

_ops = None


def _custom_ops():
    global _ops
    if _ops is None:
        @runtime.register_op("shared_experts_fork", mutates_args=("out",))
        def shared_experts_fork(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                                situ_beta: float, situ_linear_beta: float, out: torch.Tensor) -> None:
            side = side_stream(x.device)
            _pending[out.data_ptr()] = _run_on_side(side, x.contiguous(), w_gate_up.contiguous(),
                                                    w_down.contiguous(), situ_beta, situ_linear_beta, out, None)

        @runtime.register_op("shared_experts_join", mutates_args=("out",))
        def shared_experts_join(out: torch.Tensor) -> None:
            done = _pending.pop(out.data_ptr(), None)
            if done is not None:
                _join(done)

        _ops = (shared_experts_fork, shared_experts_join)
    return _ops


def _join_op():
    return _custom_ops()[1]


def start(x, w_gate_up, w_down, situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, out=None,
          variant: SharedExpertsConfig | None = None, stream: torch.cuda.Stream | None = None) -> Pending:
    """Launch the shared experts on a side stream (`stream`, else this module's) after the caller's
    queued work; returns a Pending whose wait() joins them back before out is used."""
    _check(x, w_gate_up, w_down, situ_beta, situ_linear_beta, out)
    if out is None:
        out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    if variant is None and stream is None:
        _custom_ops()[0](x, w_gate_up, w_down, float(situ_beta), float(situ_linear_beta), out)
        return Pending(out, None)
    side = stream if stream is not None else side_stream(x.device)
    done = _run_on_side(side, x.contiguous(), w_gate_up.contiguous(), w_down.contiguous(),
                        situ_beta, situ_linear_beta, out, variant)
    return Pending(out, done)


def shared_experts(x, w_gate_up, w_down, situ_beta: float = 4.0, situ_linear_beta: float = 25.0, *, out=None,
                   variant: SharedExpertsConfig | None = None, stream: torch.cuda.Stream | None = None):
    """Fused replacement of references.moe.shared_experts (same signature) -> y [B, D], joined to
    the caller's stream (use `start` to overlap other work before the join)."""
    return start(x, w_gate_up, w_down, situ_beta, situ_linear_beta, out=out, variant=variant,
                 stream=stream).wait()


def variants(tensors: dict, params: dict) -> list[SharedExpertsConfig]:
    """What the harness certifies at this B: the dispatcher's pair, every gate_up GEMM variant
    skinny_gemm certifies at this M with the down GEMM's pick, and every down variant with the
    gate_up pick (the launches meet only through the wd scratch h and a, so each launch's variants
    are covered without the full product)."""
    x, w_gu, w_d = tensors["x"], tensors["w_gate_up"], tensors["w_down"]
    B, D = x.shape
    inter = w_d.shape[1]
    width = -(-inter // VEC) * VEC                  # the down GEMM's K (a padded width: see _padded)
    a = torch.empty(B, width, dtype=x.dtype, device="meta")
    w_down = torch.empty(D, width, dtype=x.dtype, device="meta")
    pick_gu, pick_d = picks(B, D, inter)
    out = [SharedExpertsConfig(pick_gu, pick_d)]
    out += [SharedExpertsConfig(g, pick_d) for g in sg.variants({"x": x, "w": w_gu}, {}) if g != pick_gu]
    out += [SharedExpertsConfig(pick_gu, d) for d in sg.variants({"x": a, "w": w_down}, {}) if d != pick_d]
    return out
