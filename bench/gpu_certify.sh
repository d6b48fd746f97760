#!/usr/bin/env bash
# Certify every fused kernel on the GPU machine with the harness, then run the GPU-marked tests.
# Run from the repository root on the device, carrying .device (CuTe DSL bundle + wheels):
#   bash bench/gpu_certify.sh [EXAMPLES]        # results under $OUT (default ./gpu-out)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
EXAMPLES=${1:-40}
[ -d /tmp/site/nvidia_cutlass_dsl ] || { mkdir -p /tmp/site && tar xJf .device/cutedsl.tar.xz -C /tmp/site; }
[ -d /tmp/site/pydantic ] || for w in .device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages CUTE_DSL_ARCH=sm_90a
FUSED=mxfp4_dequant,mla_cache_write,router_topk,skinny_gemm,attn_res_rmsnorm,kda_decode
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } > "$OUT/env.txt" 2>&1
t0=$(date +%s)
timeout 200 python3 -m verify.cli run --ops $FUSED --candidate fused --device cuda --profile quick \
  --no-isolate --out "$OUT/quick" > "$OUT/quick.log" 2>&1; echo "quick rc=$? $(( $(date +%s) - t0 ))s" >> "$OUT/env.txt"
t1=$(date +%s)
timeout 330 python3 -m verify.cli run --ops $FUSED --candidate fused --device cuda --profile release \
  --examples "$EXAMPLES" --out "$OUT/release" --junit "$OUT/release/junit.xml" > "$OUT/release.log" 2>&1
echo "release rc=$? $(( $(date +%s) - t1 ))s" >> "$OUT/env.txt"
timeout 60 python3 -m pytest -q -m gpu property_tests -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
echo "pytest gpu rc=$?" >> "$OUT/env.txt"
tail -40 "$OUT/quick.log"; tail -60 "$OUT/release.log"; tail -5 "$OUT/pytest_gpu.log"; cat "$OUT/env.txt"
