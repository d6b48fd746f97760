#!/usr/bin/env bash
# Certify every fused kernel on the GPU machine with the harness, then run the GPU-marked tests and a
# compute-sanitizer pass. Run from the repository root on the device, carrying .device (CuTe DSL bundle
# and wheels). Each op runs in its own process under a time limit, so one slow or crashing op cannot
# take the others' results with it; everything is packed into $OUT/gpu-results.tgz.
#   [OPS="a b"] [GPU_TESTS=path] [NO_SANITIZE=1] bash bench/gpu_certify.sh [EXAMPLES] [SECONDS_PER_OP]
set -u
OUT=${OUT:-gpu-out}; R=gpu-results; mkdir -p "$OUT" "$R"
EXAMPLES=${1:-20}; PER_OP=${2:-70}
[ -d /tmp/site/nvidia_cutlass_dsl ] || { mkdir -p /tmp/site && tar xJf .device/cutedsl.tar.xz -C /tmp/site; }
[ -d /tmp/site/pydantic ] || for w in .device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages CUTE_DSL_ARCH=sm_90a
# the tree arrives without .git: name the commit for the certificates (write .device/commit before the call)
export VERIFY_GIT_COMMIT=${VERIFY_GIT_COMMIT:-$(cat .device/commit 2>/dev/null)}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)"; } > "$R/env.txt" 2>&1
for op in ${OPS:-mxfp4_dequant mla_cache_write router_topk skinny_gemm attn_res_rmsnorm kda_decode}; do
  t0=$(date +%s)
  timeout "$PER_OP" python3 -m verify.cli run --ops "$op" --candidate fused --device cuda --profile release \
    --examples "$EXAMPLES" --configs k3 --dtypes bfloat16 --no-isolate --out "$R/$op" \
    --junit "$R/$op/junit.xml" > "$R/$op.log" 2>&1
  echo "$op rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$R/env.txt"
done
timeout 60 python3 -m pytest -q -m gpu ${GPU_TESTS:-property_tests} -p no:cacheprovider > "$R/pytest_gpu.log" 2>&1
echo "pytest -m gpu rc=$?" | tee -a "$R/env.txt"
[ -z "${NO_SANITIZE:-}" ] && command -v compute-sanitizer >/dev/null && timeout 60 python3 -m verify.cli run --ops mla_cache_write,mxfp4_dequant \
  --candidate fused --device cuda --sanitize memcheck --out "$R/memcheck" > "$R/memcheck.log" 2>&1
echo "memcheck rc=$?" | tee -a "$R/env.txt"
tar czf "$OUT/gpu-results.tgz" "$R"
for f in "$R"/*.log; do echo "== $f"; grep -E "certified|FAILED|skipped|FAIL |waived|Error|error" "$f" | head -12; done
tail -3 "$R/pytest_gpu.log"; cat "$R/env.txt"
