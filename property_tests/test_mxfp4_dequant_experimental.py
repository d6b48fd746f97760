"""mxfp4_dequant's experimental launches (`experimental_variants()`: 16-byte group loads, streaming
cache hints, a persistent grid). On the CPU: each compiles for sm_90a, its PTX holds the intended
memory instructions and no local memory, it stays out of the certified/dispatched set, and the
shipped variants' PTX is byte-identical to the PTX before the experimental code was added. On a
CUDA device: bit-identical to the default kernel and to the reference (every scale byte), on the K3
shape and an odd shape, with offset views."""
import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")      # before any cutlass import

import pytest
import torch

cutlass = pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
pytest.importorskip("tvm_ffi", reason="needs apache-tvm-ffi (the kernels compile for the TVM-FFI call path)")

from fused import mxfp4_dequant as fm  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K3 = (7168, 4096)                  # weight [O, I]: packed [7168, 2048]
ODD = (67, 32 * 37)                # a row count and a group count that leave partial chunks

# sha256 of the PTX of every shipped (certified) variant, taken before the experimental kernel was
# added (nvidia-cutlass-dsl 4.8.1, sm_90a); a change to the shipped kernels' code must update these
# deliberately (and be re-certified).
SHIPPED_PTX_SHA256 = {
    ("bfloat16", 256, 4): "a52210e712308540993ef5c663336c4fff322168e0cb20b92c95353840d2fb43",
    ("bfloat16", 128, 8): "73ed066df150ccd640041ac281820f8151fec47e1836b3daf4e5419edb808a01",
    ("bfloat16", 256, 1): "4245bf63ddbbdddf3d3034ac7f23a305dbca113b4394353b85e4d6dda59e7020",
    ("bfloat16", 256, 8): "0f654f5e4c47b5195f0e14fa05a92346a1774661d5388fe729b7d6ad2662aa36",
    ("bfloat16", 512, 4): "6e842fd6800d66610169371c7377ddcd0592956984a558a05b8da5e3cce5d1c2",
    ("float16", 256, 4): "e458190ee499dcb1e817e61a093037081ec4bc2850c66cbe042b8569a5963c25",
    ("float16", 128, 8): "c59208240b6c1803d3d2ec60baaa0c01e838274b1e495cbe221e9dd6ab137e65",
    ("float16", 256, 1): "3056b6e77f7039e4fbf4898f55c88d2ee37631ffe28c283964323a9ac9335cab",
    ("float16", 256, 8): "d54a18264152d1945eaa74b6c86dde04637037990fbdf36d5aaae145b712f39f",
    ("float16", 512, 4): "062bacfa7b5eb3d75b3699a53f8723a3d1223670a5589a2d87ea410ad17d19e4",
    ("float32", 256, 4): "041ee4d7c3ac7f267d42706f29ee7e18dcce74720edcf24c5c0270407cf24d65",
    ("float32", 128, 8): "2ac31271f5b419f20febaa009e306352367eb17b90db5af57a36ce9065fa84d9",
    ("float32", 256, 1): "a23caeafc4ee56abe94181bfa9af9fa5c062ebbed8ab3da82473a55f43cc5264",
    ("float32", 256, 8): "ba15fb6283d12dfe14d859dfb9f58f4908022faec9ecc8f00ee247160448df7f",
    ("float32", 512, 4): "f5bb3b1192a0068f7168cde610be85f1fbad86b91a255e15ae8a2e42f5df5323",
}

# the listed variants plus persistent ones that loop many times over a small grid (GPU tests)
GPU_VARIANTS = fm.experimental_variants() + [
    fm.Mxfp4DequantXConfig(128, 3, ctas_per_sm=1),
    fm.Mxfp4DequantXConfig(256, 4, group_loads=False, streaming=True, ctas_per_sm=1)]


def _ptx_of(code: str, dump_dir) -> str:
    """The PTX that running `code` dumps, compiled in a fresh process (no cache hit), one kernel per
    dump dir (dumps of the same signature overwrite each other)."""
    env = dict(os.environ, CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DUMP_DIR=str(dump_dir), CUTE_DSL_ARCH="sm_90a",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, capture_output=True)
    ptx = sorted(dump_dir.glob("*.ptx"))
    assert len(ptx) == 1, f"expected one PTX dump in {dump_dir}, found {[p.name for p in ptx]}"
    return ptx[0].read_text()


def test_experimental_variants_are_not_certified_nor_dispatched():
    xs = fm.experimental_variants()
    assert 2 <= len(xs) <= 4 and len({c.name for c in xs}) == len(xs)
    assert all(isinstance(c, fm.Mxfp4DequantXConfig) for c in xs)
    shipped = fm.all_configs() + fm.variants({}, {})
    assert not any(isinstance(c, fm.Mxfp4DequantXConfig) for c in shipped)
    assert isinstance(fm.Mxfp4DequantConfig(), fm.Mxfp4DequantConfig)      # launch()'s default


@pytest.mark.parametrize("cfg", GPU_VARIANTS, ids=lambda c: c.name)
def test_experimental_variant_compiles(cfg):
    """The kernel is shape-generic (dynamic word count, the grid is a launch argument): one compile
    serves K3 and the odd shape; their grids are checked below."""
    assert fm._compile_experimental("bfloat16", cfg) is not None
    with pytest.raises(ValueError, match="^out_dtype"):
        fm._compile_experimental("float32", cfg)


@pytest.mark.parametrize("shape", [K3, ODD], ids=["K3", "odd"])
def test_experimental_grid_covers_every_unit(shape, monkeypatch):
    O, I = shape
    nwords = O * I // 8
    monkeypatch.setitem(fm._SMS, "fake-h200", 132)
    for cfg in fm.experimental_variants():
        chunk = cfg.threads * cfg.units * cfg.words_per_unit
        chunks = -(-nwords // chunk)
        grid = fm._experimental_grid(cfg, nwords, "fake-h200")
        if cfg.ctas_per_sm:
            assert grid == min(chunks, 132 * cfg.ctas_per_sm)
        else:
            assert grid == chunks
        assert grid * -(-chunks // grid) * chunk >= nwords        # the grid-stride loop reaches the end
    # the default launch's last partial wave, quoted in the module doc (8 CTAs/SM at 30 registers)
    if shape == K3:
        assert -(-nwords // 1024) == 3584 and 3584 - 3 * 1056 == 416


def _experimental_ptx(i, tmp_path):
    d = tmp_path / f"x{i}"
    d.mkdir()
    return _ptx_of("from fused import mxfp4_dequant as fm; "
                   f"fm._compile_experimental('bfloat16', fm.experimental_variants()[{i}])", d), d


@pytest.mark.parametrize("i", range(len(fm.experimental_variants())),
                         ids=[c.name for c in fm.experimental_variants()])
def test_experimental_ptx_has_the_intended_memory_instructions(i, tmp_path):
    cfg = fm.experimental_variants()[i]
    ptx, d = _experimental_ptx(i, tmp_path)
    lines = [ln.strip() for ln in ptx.splitlines()]
    loads = [ln for ln in lines if ln.startswith("ld.global") and ".b8" not in ln]
    stores = [ln for ln in lines if ln.startswith("st.global")]
    assert ".local" not in ptx and "local.u" not in ptx, "local memory (spills) in the PTX"
    assert len(loads) == cfg.units and len(stores) == cfg.units * cfg.words_per_unit, (loads, stores)
    assert all(".v4.b32" in s for s in stores), stores
    assert all((".v4.b32" in ld) == cfg.group_loads for ld in loads), loads
    assert all(("L1::no_allocate" in ld) == cfg.streaming for ld in loads), loads
    assert all((".cs." in s) == cfg.streaming for s in stores), stores
    ptxas = shutil.which("ptxas")
    if ptxas:                                               # registers and spills of the real code
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(next(d.glob("*.ptx"))), "-o", str(d / "k.cubin")],
                              capture_output=True, text=True, check=True).stderr
        assert "0 bytes spill stores, 0 bytes spill loads" in info, info
        regs = int(info.split("Used ")[1].split(" registers")[0])
        assert regs <= 32, f"{regs} registers: fewer than 8 CTAs of 256 threads per SM"


@pytest.mark.skipif(cutlass.__version__ != "4.8.1", reason="hashes were taken with nvidia-cutlass-dsl 4.8.1")
def test_shipped_variants_ptx_is_byte_identical(tmp_path):
    """Adding the experimental launches left every certified kernel's PTX as it was."""
    def one(key):
        dt, t, u = key
        d = tmp_path / f"{dt}_{t}_{u}"
        d.mkdir()
        ptx = _ptx_of("from fused import mxfp4_dequant as fm, runtime; runtime.compile_for_cpu_check("
                      f"'mxfp4_dequant', '{dt}', fm.Mxfp4DequantConfig({t}, {u}))", d)
        return key, hashlib.sha256(ptx.encode()).hexdigest()

    keys = [(dt, c.threads, c.units) for dt in ("bfloat16", "float16", "float32") for c in fm.all_configs()]
    assert set(keys) == set(SHIPPED_PTX_SHA256), "all_configs() changed: update SHIPPED_PTX_SHA256 deliberately"
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        got = dict(pool.map(one, keys))
    changed = [k for k in keys if got[k] != SHIPPED_PTX_SHA256[k]]
    assert not changed, f"shipped mxfp4_dequant PTX changed for {changed}"


# ---------------------------------------------------------------------------------------- GPU only
def _inputs(O, I, seed):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (O, I // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 256, (O, I // 32), generator=g, dtype=torch.uint8)
    scale.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)          # every scale byte value
    scale.view(-1)[-8:] = torch.tensor([0, 1, 2, 126, 127, 253, 254, 255], dtype=torch.uint8)
    return packed, scale



@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", [K3, ODD], ids=["K3", "odd"])
def test_experimental_bitwise_equals_default_and_reference(shape):
    from references.mxfp4 import mxfp4_dequant as ref_dq
    O, I = shape
    packed, scale = _inputs(O, I, seed=O)
    ref = ref_dq(packed, scale, "bfloat16")
    nan = ref.isnan()
    pk, sc = packed.cuda(), scale.cuda()
    default = fm.mxfp4_dequant(pk, sc, "bfloat16", variant=fm.Mxfp4DequantConfig()).cpu()
    for cfg in GPU_VARIANTS:
        out = torch.full((O, I), float("nan"), dtype=torch.bfloat16, device="cuda")   # poisoned
        got = fm.mxfp4_dequant(pk, sc, "bfloat16", out=out, variant=cfg).cpu()
        assert torch.equal(got.view(torch.int16), default.view(torch.int16)), cfg.name
        assert torch.equal(got.isnan(), nan), cfg.name
        assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan]), cfg.name


@pytest.mark.gpu
@needs_gpu
def test_experimental_offset_views_give_the_aligned_bits():
    """packed 5 bytes and out 1 element past an aligned start: copied to aligned storage, same bits."""
    O, I = ODD
    packed, scale = _inputs(O, I, seed=7)
    pk, sc = packed.cuda(), scale.cuda()
    base = torch.zeros(packed.numel() + 5, dtype=torch.uint8, device="cuda")
    base[5:] = pk.reshape(-1)
    pk_off = base[5:].view(O, I // 2)
    want = fm.mxfp4_dequant(pk, sc, "bfloat16").view(torch.int16)
    for cfg in GPU_VARIANTS:
        ob = torch.full((O * I + 1,), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = ob[1:].view(O, I)
        got = fm.mxfp4_dequant(pk_off, sc, "bfloat16", out=out, variant=cfg)
        assert got is out and torch.equal(out.view(torch.int16), want), cfg.name
        with pytest.raises(ValueError, match="^out_dtype"):
            fm.mxfp4_dequant(pk, sc, "float32", variant=cfg)
