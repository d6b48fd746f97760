"""moe_experts_mxfp4's CuTe DSL kernel compiles for sm_90a on a CPU-only machine for every static
configuration it serves (K3 per-rank shapes: the intermediate dim over T = 1, 8, 16 ranks, zero-padded
to 256 below it, and experts over 8 ranks; the CPU configs and their splits), every launch variant,
both working dtypes; the batch is dynamic (a new batch size reuses the compiled function).
Numerics run on a CUDA device only: property_tests/test_moe_experts_mxfp4_gpu.py."""
import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import runtime  # noqa: E402
from references.config import K3  # noqa: E402
from references.moe import moe_tp_shard_width  # noqa: E402

# (E, L, I, k): K3 per rank under TP T = 1, 8, 16 (all 896 experts, I = 3072 / T padded), under EP 8
K3_SHAPES = [(896, K3.latent, moe_tp_shard_width(K3.moe_inter, T), 16) for T in (1, 8, 16)] + [(112, K3.latent, K3.moe_inter, 16)]
K3_IDS = ["tp1", "tp8", "tp16", "ep8"]
# the CPU configs (tiny, small) and their smallest TP shards (I = 32: one MXFP4 group)
CPU_SHAPES = [(20, 64, 64, 4), (20, 64, 32, 4), (48, 128, 128, 8), (48, 128, 32, 8), (10, 64, 64, 4)]


def _compile(wd, ids, shape, cfg):
    return runtime.compile_for_cpu_check("moe_experts_mxfp4", wd, ids, *shape, cfg)


def test_k3_padded_width_is_256_at_t16():
    assert [s[2] for s in K3_SHAPES] == [3072, 384, 256, 3072]


@pytest.mark.parametrize("shape", K3_SHAPES, ids=K3_IDS)
def test_every_variant_compiles_at_k3_shapes(shape):
    from fused import moe_experts_mxfp4 as fm
    E, L, inter, k = shape
    cfgs = fm.variants({"z": torch.empty(1, L, device="meta"),
                        "w2_packed": torch.empty(E, L, inter // 2, dtype=torch.uint8, device="meta")}, {})
    assert cfgs == fm.all_configs() and fm.DEFAULT in cfgs
    for cfg in cfgs:
        assert _compile("bfloat16", "int64", shape, cfg) is not None


@pytest.mark.parametrize("shape", K3_SHAPES, ids=K3_IDS)
def test_fp16_and_int32_ids_compile_at_k3_shapes(shape):
    from fused import moe_experts_mxfp4 as fm
    assert _compile("float16", "int64", shape, fm.DEFAULT) is not None
    assert _compile("bfloat16", "int32", shape, fm.DEFAULT) is not None


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=[f"E{s[0]}_L{s[1]}_I{s[2]}" for s in CPU_SHAPES])
def test_every_variant_compiles_at_cpu_config_shapes(shape):
    from fused import moe_experts_mxfp4 as fm
    for cfg in fm.all_configs():
        if fm.supports(cfg, shape[1], shape[2]):
            assert _compile("bfloat16", "int64", shape, cfg) is not None
    assert _compile("float16", "int64", shape, fm.DEFAULT) is not None


def test_variant_refuses_shapes_it_does_not_tile():
    from fused import moe_experts_mxfp4 as fm
    with pytest.raises(ValueError, match="L % 64"):
        fm.MoeExperts("bfloat16", "int64", 8, 96, 64, 4, fm.MoeExpertsConfig(warps=2, down_frag=4, unroll=4))
    assert fm.MoeExpertsConfig(warps=2, down_frag=4, unroll=4) not in fm.variants(
        {"z": torch.empty(1, 96, device="meta"), "w2_packed": torch.empty(8, 96, 32, dtype=torch.uint8, device="meta")}, {})


def test_batch_is_dynamic_so_a_new_batch_size_does_not_recompile(ir_of):
    """The compile key is (wd, ids dtype, E, L, I, k, variant): no batch. The compiled function takes
    z and y as (?, L) and the (token, slot) lists as (?,): the batch is a runtime extent."""
    import inspect

    from fused import moe_experts_mxfp4 as fm
    assert list(inspect.signature(fm._compile.__wrapped__).parameters) == ["wd", "ids_dtype", "E", "L", "inter", "k", "cfg"]
    ir = ir_of("from fused import moe_experts_mxfp4 as fm; fm._compile('bfloat16', 'int64', 20, 64, 64, 4, fm.DEFAULT)")
    assert '"(?,64):(64,1)"' in ir and '"(?):(1)"' in ir
    # w13 as int32 words (E * 2I rows, static) and w2 (E * L rows), each row stride a 64-bit runtime value
    # (16-byte rows), so element offsets are 64-bit; the scales' too
    assert '"(2560,8):(?{i64 div=4},1)"' in ir and '"(1280,8):(?{i64 div=4},1)"' in ir
    assert '"(2560,2):(?{i64},1)"' in ir and '"(1280,2):(?{i64},1)"' in ir


def test_ptx_streams_16_byte_weight_loads_into_mma_without_spills(ptx_of, ptxas_regs):
    """Four kernels; the two GEMMs issue mma.sync on bf16 and 16-byte global loads, SiTU uses the
    accurate tanh (no tanh.approx), nothing spills to local memory; the route kernel (the first)
    skips ids outside 0..E-1 with one unsigned compare against E - 1."""
    ptx = ptx_of("from fused import moe_experts_mxfp4 as fm; fm._compile('bfloat16', 'int64', 896, 3584, 384, 16, fm.DEFAULT)")
    assert ptx.count(".visible .entry") == 4
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    assert ptx.count("ld.global.v4") >= 16
    assert "tanh.approx" not in ptx and ".local" not in ptx
    route = ptx[ptx.index(".visible .entry"):]
    route = route[:route.index("\n}")]
    assert re.search(r"setp\.gt\.u32\s+%p\d+, %r\d+, 895;", route), "ids outside 0..E-1 must be skipped"
    entries = re.split(r"(?=\.visible \.entry)", ptx)
    header = entries[0]
    for body in entries[1:]:
        regs, spills = ptxas_regs(header + body)
        assert spills == 0 and regs <= 255


def test_custom_op_registers_under_project_namespace():
    from fused import moe_experts_mxfp4 as fm
    fm._custom_op()
    assert hasattr(torch.ops.verify_kernels, "moe_experts_mxfp4")


def test_fused_refuses_fp32_and_cpu_tensors_with_the_argument_name():
    from fused import moe_experts_mxfp4 as fm
    from verify.model.case import Case
    from verify.ops.registry import get_op
    t = get_op("moe_experts_mxfp4").make_inputs(Case("moe_experts_mxfp4", 0, 3, "tiny", "bfloat16", "normal", 1)).tensors
    with pytest.raises(ValueError, match="z: the fused kernel needs a CUDA tensor"):
        fm.moe_experts_mxfp4(**t)
    with pytest.raises(TypeError, match="z: dtype"):
        fm.moe_experts_mxfp4(**{**t, "z": t["z"].float()})
    assert fm.DTYPES == ("bfloat16", "float16")


def _meta_operands(E: int, L: int, inter: int, B: int = 1, k: int = 16) -> dict:
    meta = dict(device="meta")
    return dict(z=torch.empty(B, L, dtype=torch.bfloat16, **meta), ids=torch.empty(B, k, dtype=torch.int64, **meta),
                weights=torch.empty(B, k, dtype=torch.float32, **meta),
                w13_packed=torch.empty(E, 2 * inter, L // 2, dtype=torch.uint8, **meta),
                w13_scale=torch.empty(E, 2 * inter, L // 32, dtype=torch.uint8, **meta),
                w2_packed=torch.empty(E, L, inter // 2, dtype=torch.uint8, **meta),
                w2_scale=torch.empty(E, L, inter // 32, dtype=torch.uint8, **meta))


def test_unsplit_k3_experts_past_2_31_words_are_taken_and_2_31_rows_refused():
    """896 experts x the whole intermediate dim (K3 at T = 1): w13 holds 2.47e9 words, past 32-bit
    offsets; the kernels' 64-bit row strides take it (only the device is wrong here: meta tensors,
    nothing allocated). 2^31 weight rows would overflow the 32-bit row ids: refused before launch."""
    from fused import moe_experts_mxfp4 as fm
    k3 = _meta_operands(896, 3584, 3072)
    assert k3["w13_packed"].numel() // 4 > 2**31
    with pytest.raises(ValueError, match="CUDA tensor"):
        fm.moe_experts_mxfp4(**k3)
    with pytest.raises(ValueError, match="w13_packed: 2147483648 weight rows .* row ids are 32-bit"):
        fm.moe_experts_mxfp4(**_meta_operands(2**20, 64, 1024))
