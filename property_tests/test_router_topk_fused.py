"""The one-launch router (fused/router_topk_fused.py): every static configuration compiles for sm_90a on
a CPU-only machine, its PTX holds the acquire/release ticket and no float atomic or local memory, the
shipped router kernels' PTX is byte-identical to before the refactor that lets both kernels share
their device code; on a CUDA device it gives the two launches' bits, replays in a CUDA graph and
falls back to two launches when its waiting CTAs would fill the SMs."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(896, 7168, 16), (64, 256, 4)]              # (E, D, top_k): K3 and a small one


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("E,D,k", SHAPES, ids=[f"E{e}_D{d}_k{k}" for e, d, k in SHAPES])
def test_one_launch_compiles_every_config(dtype, E, D, k):
    """The SIMT bucket (B = 1) and every split-K MMA bucket (B = 2..64)."""
    from fused import router_topk as fr
    from fused import router_topk_fused as rf
    fns = rf.compile_all_for(dtype, E, D, k)
    assert fns and all(f is not None for f in fns)
    kinds = {type(fr.logits_config(M, E, D)).__name__ for M in (1, 8, 64)}
    assert kinds == {"SkinnyGemmConfig", "SkinnyGemmMmaConfig"}        # both GEMM flavours fused


def test_one_launch_new_batch_size_does_not_recompile():
    from fused import router_topk as fr
    from fused import router_topk_fused as rf
    rf._compile("bfloat16", 896, 7168, 16, fr.logits_config(9, 896, 7168))
    before = runtime.cache_info()
    for B in (10, 13, 16):                               # the m16 bucket: one compiled kernel
        rf._compile("bfloat16", 896, 7168, 16, fr.logits_config(B, 896, 7168))
    after = runtime.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 3


def test_one_launch_is_experimental_only():
    from fused import router_topk as fr
    exp = [c for c in fr.experimental_variants({}, {}) if c.one_launch]
    assert len(exp) == 1 and exp[0].name == "one_launch"
    for B in (1, 8, 64):
        tensors = {"x": torch.empty(B, 7168, device="meta"), "w_gate": torch.empty(896, 7168, device="meta")}
        assert not any(c.one_launch for c in fr.variants(tensors, {}))
    assert not fr.RouterTopkConfig().one_launch                         # the default dispatch


def test_fits_counts_the_waiting_ctas_against_the_sms(monkeypatch):
    """W = min(B, CTAs) CTAs wait; the launch is one kernel only while W < SMs (module docstring)."""
    from fused import router_topk as fr
    from fused import router_topk_fused as rf
    g8, g1 = fr.logits_config(8, 896, 7168), fr.logits_config(1, 896, 7168)
    assert rf.num_ctas(8, 896, g8) == 56 * g8.ksplit and rf.num_ctas(1, 896, g1) == 896
    small = fr.logits_config(64, 64, 256)
    assert rf.waiters(64, 64, small) == rf.num_ctas(64, 64, small) == 4      # a CTA folds several tokens
    for sms, B, ok in ((132, 64, True), (132, 1, True), (64, 64, False), (65, 64, True), (1, 1, False)):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda dev, sms=sms: SimpleNamespace(multi_processor_count=sms))
        assert rf.fits("cuda:0", B, 896, fr.logits_config(B, 896, 7168)) is ok, (sms, B)


# ------------------------------------------------------------------------------- PTX (fresh process)
def _run_fresh(code: str) -> str:
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, capture_output=True, text=True)
    return out.stdout


# Compiles each kernel in a fresh process with the PTX dump on, one dump directory per kernel (kernels
# with the same host signature share a file name), and prints {name: sha256[:16] of its PTX}.
_DUMP = r'''
import hashlib, json, os, pathlib, tempfile
d = pathlib.Path(tempfile.mkdtemp())
os.environ.update(CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DUMP_DIR=str(d))
from fused import router_topk as fr, skinny_gemm as sg, router_topk_fused as rf
items = ITEMS
out = {}
for name, fn in items:
    fn()
    ptx = sorted(d.glob("*.ptx"))
    assert len(ptx) == 1, (name, ptx)
    out[name] = (PTX_OUT)(ptx[0].read_text())
    for p in d.iterdir():
        p.unlink()
print(json.dumps(out))
'''

_SHIPPED_ITEMS = '''[
    *[(f"topk_{c.name}_S{S}", lambda c=c, S=S: fr._compile(896, 16, c.tokens_per_cta, S, c.warps_per_token))
      for c in fr.all_configs() if c.select == "rounds" for S in (1, 4, 7)],
    *[(f"topk_pdl_S{S}", lambda S=S: fr._compile(896, 16, 1, S, 4, True)) for S in (1, 4, 7)],
    *[(f"gemm_{dt}_B{B}_{fr.logits_config(B, 896, 7168).name}",
       lambda dt=dt, B=B: sg._compile(dt, "float32", 896, 7168, fr.logits_config(B, 896, 7168)))
      for dt in ("bfloat16", "float16") for B in (1, 8, 16, 32, 64)]]'''

# sha256[:16] of each shipped router kernel's PTX at f98d482 (before the top-k and GEMM device code
# became @cute.jit functions shared with the one-launch kernel), nvidia-cutlass-dsl 4.8.1, sm_90a.
# If the DSL is upgraded, regenerate at that commit: the comparison is meaningful only like for like.
SHIPPED_PTX_SHA = {
    "topk_cta_argmax_w4_S1": "2231a31db0acba7e",
    "topk_cta_argmax_w4_S4": "98cd8bdea080e3a2",
    "topk_cta_argmax_w4_S7": "67f55c34c4af41a5",
    "topk_warp_argmax_t4_S1": "5cf554ffd4b7e99e",
    "topk_warp_argmax_t4_S4": "e6288205c870f71b",
    "topk_warp_argmax_t4_S7": "595ccb373db5b84c",
    "topk_warp_argmax_t1_S1": "ac49d660e692051b",
    "topk_warp_argmax_t1_S4": "e8df0ca01a973f08",
    "topk_warp_argmax_t1_S7": "2f821f6fd7b73fdf",
    "topk_pdl_S1": "911c347ef9dc0235",
    "topk_pdl_S4": "b7b625bab552e5ce",
    "topk_pdl_S7": "663091041d8f9358",
    "gemm_bfloat16_B1_gemv_m1_n1": "f69710abd17ff69f",
    "gemm_bfloat16_B8_mma_m8_r16_w8_u4_s7_f": "24ef8bcac01a0e32",
    "gemm_bfloat16_B16_mma_m16_r16_w8_u4_s7_f": "0a293845d4567708",
    "gemm_bfloat16_B32_mma_m32_r16_w8_u2_s7_f": "5046bd59a5a0d5d3",
    "gemm_bfloat16_B64_mma_m64_r16_w8_u1_s4_f": "cde4ee1de099c0b9",
    "gemm_float16_B1_gemv_m1_n1": "b6d7b653420e5bb1",
    "gemm_float16_B8_mma_m8_r16_w8_u4_s7_f": "10a3fc17aa3d0307",
    "gemm_float16_B16_mma_m16_r16_w8_u4_s7_f": "c4cd264ea743e175",
    "gemm_float16_B32_mma_m32_r16_w8_u2_s7_f": "bff92b25480b9a3a",
    "gemm_float16_B64_mma_m64_r16_w8_u1_s4_f": "7842c2dafb6bab07",
}


def test_shipped_router_kernels_ptx_is_byte_identical():
    """Every top-k config of all_configs() at S = 1, 4, 7 (and the PDL kernel), and the logits GEMM
    of each token bucket (B = 1, 8, 16, 32, 64), bf16 and fp16: the PTX hashes recorded before the
    refactor. A change to the shipped kernels' code fails here."""
    code = _DUMP.replace("ITEMS", _SHIPPED_ITEMS).replace(
        "PTX_OUT", "lambda t: hashlib.sha256(t.encode()).hexdigest()[:16]")
    got = json.loads(_run_fresh(code))
    assert got == SHIPPED_PTX_SHA, {k: (got.get(k), v) for k, v in SHIPPED_PTX_SHA.items() if got.get(k) != v}


def test_one_launch_ptx_has_the_ticket_and_no_float_atomics_or_local_memory(tmp_path):
    items = '''[(f"B{B}", lambda B=B: rf._compile("bfloat16", 896, 7168, 16, fr.logits_config(B, 896, 7168)))
                for B in (1, 8, 64)]'''
    got = json.loads(_run_fresh(_DUMP.replace("ITEMS", items).replace("PTX_OUT", "str")))
    assert set(got) == {"B1", "B8", "B64"}
    for name, ptx in got.items():
        assert re.search(r"atom\.global\.acq_rel(\.gpu)?\.add\.u32", ptx), name      # arrive (release)
        assert "ld.acquire.gpu.global.s32" in ptx, name                               # the waiters' spin
        assert ptx.count("fence.acq_rel.gpu") >= 2, name
        assert not re.search(r"\b(atom|red)(\.[a-z_0-9]+)*\.(f16|bf16|f32|f64)\b", ptx), name
        assert ".local" not in ptx, name
    assert "mma.sync.aligned.m16n8k16" in got["B8"] and "mma.sync" not in got["B1"]
    _ptxas_no_spills_and_resident_on_h200(got, tmp_path)


def _ptxas_no_spills_and_resident_on_h200(ptx_by_b: dict, tmp_path):
    """Where ptxas is installed: no spills after register allocation, and (beyond what the launch
    needs: only the waiters must leave an SM free) the whole grid fits the H200's 132 SMs at the
    occupancy the registers allow."""
    import shutil
    from fused import router_topk as fr
    from fused import router_topk_fused as rf
    if shutil.which("ptxas") is None:
        return
    for name, ptx in ptx_by_b.items():
        B = int(name[1:])
        src = tmp_path / f"{name}.ptx"
        src.write_text(ptx)
        info = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(src), "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
        assert "0 bytes spill stores, 0 bytes spill loads" in info, (name, info)
        regs = int(re.search(r"Used (\d+) registers", info).group(1))
        op = rf.RouterTopkOneLaunch(896, 7168, 16, fr.logits_config(B, 896, 7168))
        per_sm = min(65536 // (-(-regs // 8) * 8 * op.threads), 2048 // op.threads, 32)
        assert rf.num_ctas(B, 896, op.gemm) <= 132 * per_sm, (name, regs, per_sm)


# ---------------------------------------------------------------------------------------- GPU only
def _inputs(B, dtype, tied, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + B)
    x = torch.randn(B, 7168, device="cuda", generator=g).to(dtype)
    w = (torch.randn(896, 7168, device="cuda", generator=g) * 7168 ** -0.5).to(dtype)
    bias = torch.randn(896, device="cuda", generator=g) * 0.01
    if tied:                       # 8 distinct gate rows and biases: exact ties in every token's choice
        w = w[torch.arange(896, device="cuda") % 8].contiguous()
        bias = bias[torch.arange(896, device="cuda") % 8].contiguous()
    return x, w, bias


def _same(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tied", [False, True], ids=["random", "tied"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("B", [1, 2, 8, 9, 16, 33, 64])
def test_one_launch_equals_two_launches_bit_for_bit(B, dtype, tied):
    from fused import router_topk as fr
    from fused import router_topk_fused as rf
    one = next(c for c in fr.experimental_variants({}, {}) if c.one_launch)
    x, w, bias = _inputs(B, dtype, tied)
    assert rf.fits(x.device, B, 896, fr.logits_config(B, 896, 7168))       # the one-launch path runs
    ref = fr.router_topk(x, w, bias, 16, 2.5)
    got = fr.router_topk(x, w, bias, 16, 2.5, variant=one)
    assert _same(got, ref), (B, dtype, tied)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("k", [3, 4])
@pytest.mark.parametrize("B", [1, 5, 64])
def test_one_launch_small_shape_folds_several_tokens_per_cta(B, k):
    """E = 64, D = 256: 4 CTAs (S = 1), so a waiter runs the top-k of several tokens one after
    another (odd k: the shared-memory buffer parity wraps between tokens)."""
    from fused import router_topk as fr
    one = next(c for c in fr.experimental_variants({}, {}) if c.one_launch)
    g = torch.Generator(device="cuda").manual_seed(B * 10 + k)
    x = torch.randn(B, 256, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(64, 256, device="cuda", generator=g) / 16).to(torch.bfloat16)
    bias = torch.randn(64, device="cuda", generator=g) * 0.01
    ref = fr.router_topk(x, w, bias, k, 1.5)
    for _ in range(2):
        assert _same(fr.router_topk(x, w, bias, k, 1.5, variant=one), ref), (B, k)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("B", [1, 8, 64])
def test_one_launch_back_to_back_and_in_a_cuda_graph(B):
    """Two launches in a row (the counter was reset), then a CUDA graph of two launches replayed
    3 times on poisoned outputs and logits: the two-launch bits every time."""
    from fused import router_topk as fr
    one = next(c for c in fr.experimental_variants({}, {}) if c.one_launch)
    x, w, bias = _inputs(B, torch.bfloat16, False, seed=1)
    ids_ref, w_ref = fr.router_topk(x, w, bias, 16, 2.5)
    for _ in range(2):
        assert _same(fr.router_topk(x, w, bias, 16, 2.5, variant=one), (ids_ref, w_ref))
    ids, wts = torch.empty_like(ids_ref), torch.empty_like(w_ref)
    logits = fr.logits_workspace(B, 896, 7168, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fr.launch(x, w, bias, 16, 2.5, ids, wts, logits, one)             # warm-up: compile, counter
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            fr.launch(x, w, bias, 16, 2.5, ids, wts, logits, one)
            fr.launch(x, w, bias, 16, 2.5, ids, wts, logits, one)
    for _ in range(3):
        ids.fill_(-1)
        wts.fill_(float("nan"))
        logits.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _same((ids, wts), (ids_ref, w_ref))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("B", [1, 64])
def test_one_launch_falls_back_when_the_waiters_would_fill_the_sms(B, monkeypatch):
    from fused import router_topk as fr
    from fused import router_topk_fused as rf
    one = next(c for c in fr.experimental_variants({}, {}) if c.one_launch)
    x, w, bias = _inputs(B, torch.bfloat16, False, seed=2)
    ref = fr.router_topk(x, w, bias, 16, 2.5)
    real = torch.cuda.get_device_properties

    class FewSMs:
        multi_processor_count = B                        # W = B waiters would hold every SM

        def __init__(self, props):
            self._props = props

        def __getattr__(self, name):
            return getattr(self._props, name)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev=None: FewSMs(real(dev)))

    def no_one_launch(*args, **kwargs):
        raise AssertionError("the one-launch kernel ran on a device its waiters would fill")

    monkeypatch.setattr(rf, "launch", no_one_launch)
    assert _same(fr.router_topk(x, w, bias, 16, 2.5, variant=one), ref)
