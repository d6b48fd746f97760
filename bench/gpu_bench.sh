#!/usr/bin/env bash
# `verify-kernels bench --candidate fused` over the six fused ops at T = 1, 8, 16 and B = 1..64 on the
# GPU machine: each fused kernel (certified first with the quick profile, in the same process) against
# the reference eager, torch.compile of it, its declared peers (cuBLAS; fla-core's KDA when .whl holds
# its wheel) and the floor (a copy of its bytes). Writes under $OUT/bench: bench.log (the terminal
# table), bench.json, bench.html, certificate.json, report.html (certificate + bench section), env.txt.
#
#   OUT=... bash bench/gpu_bench.sh [BUDGET_S] [more bench arguments, e.g. --ops router_topk --batch 8,64]
#
# BUDGET_S (default 240): seconds of timing, shared over the ops (bench --time-budget); the shapes not
# reached are listed in bench.json (B runs in the order 1, 64, 8, 2, 16, 4, 32, every T at each, so a cut
# op keeps a spread of batches; the first shape of each op also pays its compiles). The quick
# certification before it takes 1-2 minutes; the whole command is killed at BUDGET_S + CERT_S (default
# 180) s, keeping every row timed so far. One device call allows 600 s: BUDGET_S up to ~400.
# Run from the repository root of a tree carrying .device (the CuTe DSL bundle, shared/device/README.md)
# and .whl (fla-core and einops wheels: `pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp -d .whl fla-core einops`). Exit status: the bench command's (0 all timed, 1 a
# candidate refused, failed or not reached, 2 no GPU), or 124 when it was killed at the limit.
set -u
BUDGET=${1:-240}; shift || true
OUT=${OUT:-gpu-out}; R="$OUT/bench"; mkdir -p "$R"
[ -d /tmp/site/nvidia_cutlass_dsl ] || { mkdir -p /tmp/site && tar xJf .device/cutedsl.tar.xz -C /tmp/site; }
for x in .device/cutedsl-extra*.tar.xz; do [ -f "$x" ] && tar xJf "$x" -C /tmp/site; done
[ -d /tmp/site/pydantic ] || [ ! -f .device/wheels.tar.xz ] || tar xJf .device/wheels.tar.xz -C /tmp/site
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
export VERIFY_GIT_COMMIT=${VERIFY_GIT_COMMIT:-$(cat .device/commit 2>/dev/null || git rev-parse HEAD 2>/dev/null)}
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1 ||
  echo "pip install -e . failed (install.log); running the package from the tree (PYTHONPATH)" | tee -a "$R/install.log"
if ls .whl/*.whl > /dev/null 2>&1; then      # fla-core (pure Python + Triton) and what it needs
  python3 -m pip install -q --no-deps --no-index .whl/*.whl >> "$R/install.log" 2>&1 || echo "wheels in .whl: install failed" >> "$R/install.log"
fi
OPS=attn_res_rmsnorm,kda_decode,mla_cache_write,mxfp4_dequant,router_topk,skinny_gemm
CMD=(python3 -m verify.cli bench --candidate fused --ops "$OPS" --tp 1,8,16 --batch 1,2,4,8,16,32,64
     --time-budget "$BUDGET" --out "$R" "$@")
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import fla; print('fla-core', fla.__version__)" 2>&1 | tail -1
  echo "commit $VERIFY_GIT_COMMIT"; echo "command: ${CMD[*]}"; } > "$R/env.txt" 2>&1
t0=$(date +%s)
timeout "$((BUDGET + ${CERT_S:-180}))" "${CMD[@]}" > "$R/bench.log" 2>&1
rc=$?
echo "bench rc=$rc $(( $(date +%s) - t0 ))s" >> "$R/env.txt"
if [ -f "$R/certificate.json" ] && [ -f "$R/bench.json" ]; then
  python3 -m verify.cli report "$R/certificate.json" -o "$R/report.html" >> "$R/env.txt" 2>&1
fi
if [ ! -f "$R/bench.html" ] && [ -f "$R/bench.json" ]; then      # a run cut at the limit: its rows so far
  python3 -c "import sys; from verify.bench import html, output; open(sys.argv[2], 'w').write(html.page(output.load(sys.argv[1])))" \
    "$R/bench.json" "$R/bench.html" >> "$R/env.txt" 2>&1
fi
grep -v "^W[0-9]" "$R/bench.log" | tail -150
cat "$R/env.txt"
exit $rc
