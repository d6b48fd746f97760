#!/usr/bin/env bash
# Device run for the release gate on 2 GPUs (nvidia-h200-x2): router_topk diagnosis, timing and
# certification, NCCL rank splits (pytest -m multi_gpu and the CLI), and every compute-sanitizer
# tool over every fused op. Each step has its own time limit; logs go to gpu-results/, packed into
# $OUT/gpu-results.tgz. Run from the repository root carrying .device (see bench/gpu_certify.sh).
set -u
OUT=${OUT:-gpu-out}; R=${R:-gpu-results}; mkdir -p "$OUT" "$R"   # R=$OUT/... keeps partial results of a cut run
[ -d /tmp/site/nvidia_cutlass_dsl ] || { mkdir -p /tmp/site && tar xJf .device/cutedsl.tar.xz -C /tmp/site; }
[ -d /tmp/site/pydantic ] || for w in .device/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
export PYTHONPATH=$PWD:$PWD/bench:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages CUTE_DSL_ARCH=sm_90a
export VERIFY_GIT_COMMIT=${VERIFY_GIT_COMMIT:-$(cat .device/commit 2>/dev/null)}
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, 'gpus', torch.cuda.device_count())"; } > "$R/env.txt" 2>&1
step() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$R/$name.log" 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$R/env.txt"; }
FUSED_OPS=mxfp4_dequant,mla_cache_write,router_topk,skinny_gemm,attn_res_rmsnorm,kda_decode
for s in ${STEPS:-bench cert repro gpu_tests nccl_pytest nccl_cli sanitize}; do case $s in
  gpu_tests) step pytest_gpu 120 python3 -m pytest -q -m gpu property_tests -p no:cacheprovider -rs ;;
  bench) step bench_router 150 python3 bench/bench_router.py --out "$R" --steps ${BENCH_STEPS:-diagnose,kernels,timing} ${BENCH_ARGS:-} ;;
  cert) step cert_router_topk ${CERT_S:-200} python3 -m verify.cli run --ops router_topk --candidate fused --device cuda \
          --profile release --examples ${EXAMPLES:-20} --configs k3 --dtypes bfloat16 --no-isolate --out "$R/router_topk" \
          --junit "$R/router_topk/junit.xml" ;;
  repro) for c in '{"batch":45,"config":"k3","dist":"near_ties","dtype":"bfloat16","extra":[],"op":"router_topk","seed":0,"tp":1}' \
                  '{"batch":45,"config":"k3","dist":"wide_range","dtype":"bfloat16","extra":[],"op":"router_topk","seed":0,"tp":1}' \
                  '{"batch":45,"config":"k3","dist":"near_ties","dtype":"bfloat16","extra":[],"op":"router_topk","seed":48424,"tp":8}' \
                  '{"batch":20,"config":"k3","dist":"wide_range","dtype":"bfloat16","extra":[],"op":"router_topk","seed":5191,"tp":1}'; do
           timeout 60 python3 -m verify.cli repro "$c" --candidate fused --device cuda >> "$R/repro_router.log" 2>&1
           echo "repro rc=$?" >> "$R/repro_router.log"; done ;;
  nccl_pytest) step nccl_pytest ${NCCL_S:-300} python3 -m pytest -q -m multi_gpu property_tests/test_distributed_nccl.py -p no:cacheprovider -rs ;;
  nccl_cli) step nccl_cli ${NCCL_S:-200} python3 -m verify.cli run --distributed nccl --tp 2 --candidate reference,fused --out "$R/nccl" \
          --junit "$R/nccl/junit.xml" ;;
  sanitize) for tool in memcheck racecheck synccheck initcheck; do     # the four tools side by side
           step "sanitize_$tool" ${SAN_S:-150} python3 -m verify.cli run --ops ${SAN_OPS:-$FUSED_OPS} --candidate fused \
             --sanitize $tool --out "$R/sanitize_$tool" & done; wait ;;
esac; done
[ "$R" = gpu-results ] && tar czf "$OUT/gpu-results.tgz" "$R"
for f in "$R"/*.log; do echo "== $f"; grep -E "certified|FAILED|failed|passed|skipped|FAIL|Error|error|DIAG|TIME|status" "$f" | head -40; done
cat "$R/env.txt"
