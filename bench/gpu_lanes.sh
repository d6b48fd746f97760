#!/usr/bin/env bash
# Device run on one host of N GPUs (nvidia-h200-x8 ideally): the full release profile of every fused
# op, one op per GPU, beside `verify-kernels bench` and the GPU tests on the spare GPUs. Jobs are dealt
# to GPUs round-robin in the order of JOBS; each GPU runs its jobs one after another, each under its
# own time limit (`name@seconds` overrides the default), so one slow job cannot take the others'
# results. Logs, certificates and per-case logs go to $R, packed every 20 s and at the end into
# $OUT/results.tgz: a call returns only a few files, and a cut call still returns what was written.
# A certification job whose log is in results/gpu/resume/cert_OP/ goes on from it (--resume).
# Run from the repository root carrying .device (the CuTe DSL bundle: shared/device/README.md) and,
# for fla-core's peers in bench jobs, .whl (bench/gpu_bench.sh says how to fill it).
set -u
OUT=${OUT:-gpu-out}; R=${R:-/tmp/gpu-r}; mkdir -p "$OUT" "$R"
pack() { tar czf "$OUT/results.tgz.tmp" -C "$(dirname "$R")" "$(basename "$R")" && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"; }
( while sleep 20; do pack; done ) & PACKER=$!
[ -d /tmp/site/nvidia_cutlass_dsl ] || { mkdir -p /tmp/site && tar xJf .device/cutedsl.tar.xz -C /tmp/site; }
for x in .device/cutedsl-extra*.tar.xz; do [ -f "$x" ] && tar xJf "$x" -C /tmp/site; done   # files a trimmed bundle left out
[ -d /tmp/site/pydantic ] || [ ! -f .device/wheels.tar.xz ] || tar xJf .device/wheels.tar.xz -C /tmp/site   # the wheels unpacked, xz (smaller)
[ -d /tmp/site/pydantic ] || for w in .device/wheels/*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" /tmp/site; done
[ -d /tmp/site/fla ] || for w in .whl/*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" /tmp/site; done   # fla-core, einops
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
export VERIFY_GIT_COMMIT=${VERIFY_GIT_COMMIT:-$(cat .device/commit 2>/dev/null)}
NG=$(nvidia-smi -L | wc -l)
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, 'gpus', torch.cuda.device_count())"
  echo "commit $VERIFY_GIT_COMMIT"; } > "$R/env.txt" 2>&1
CERT_S=${CERT_S:-520}; BENCH_S=${BENCH_S:-300}
# certification cases run in workers, a hang past CERT_ISOLATE s failing its case (session 23: an in-process
# finishing child stalled 300 s on a case its isolated rerun judged in 14 s); CERT_ISOLATE=0: in-process
ISO="--case-timeout ${CERT_ISOLATE:-120}"; [ "${CERT_ISOLATE:-}" = 0 ] && ISO=--no-isolate
cmd_for() { case $1 in        # job name -> "limit command..."
  cert_*) local op=${1#cert_}; echo "$CERT_S python3 -m verify.cli run --ops $op --candidate fused --device cuda \
            --profile release $ISO ${CERT_ARGS:-} --out $R/cert_$op --junit $R/cert_$op/junit.xml" ;;
  smoke) echo "$CERT_S python3 -m verify.cli run --candidate fused --device cuda --profile quick --no-isolate \
            ${CERT_ARGS:-} --out $R/smoke" ;;   # minutes: every fused op, quick profile (before a long release run)
  certall) echo "$CERT_S python3 -m verify.cli run --candidate fused --device cuda --profile release $ISO \
            --jobs ${CERT_JOBS:-8} --shards ${CERT_SHARDS:-4} ${CERT_ARGS:-} --out $R/certall --junit $R/certall/junit.xml" ;;
  bench) echo "$BENCH_S python3 -m verify.cli bench --candidate ${BENCH_CANDIDATES:-fused} --time-budget $((BENCH_S - 120)) \
            ${BENCH_ARGS:-} --out $R/bench" ;;   # speed of the certified candidates (quick-certified first), BENCH_ARGS e.g. "--ops router_topk --batch 8,64"
  benchprof_*) echo "$BENCH_S python3 -m verify.cli bench --ops ${1#benchprof_} --candidate fused --batch ${PROF_BATCHES:-1,64} \
            --tp ${PROF_TPS:-1} --profile-kernels ${PROF_TOOL:-ncu} --out $R/$1" ;;   # one op's kernels under Nsight Compute (PROF_TOOL=torch: torch.profiler)
  san_*) local t=${1#san_}; echo "$BENCH_S python3 -m verify.cli run --sanitize ${t%%_*} --ops ${t#*_} --candidate fused \
            --out $R/$1" ;;   # san_TOOL_OP, e.g. san_memcheck_skinny_gemm
  prof_*) local op=${1#prof_}; echo "$BENCH_S env VERIFY_CPROFILE_DIR=$R/$1 python3 -m verify.cli run --ops $op \
            --candidate fused --device cuda --profile release --examples ${PROF_EXAMPLES:-30} --no-isolate --out $R/$1/run" ;;
  gpu_tests_a) echo "200 python3 -m pytest -q -m gpu ${GPU_TESTS_A:-} -p no:cacheprovider -rs" ;;
  gpu_tests_b) echo "200 python3 -m pytest -q -m gpu ${GPU_TESTS_B:-} -p no:cacheprovider -rs" ;;
  gpu_tests) echo "200 python3 -m pytest -q -m gpu ${GPU_TESTS:-property_tests} -p no:cacheprovider -rs" ;;
  nccl) echo "200 python3 -m pytest -q -m multi_gpu property_tests/test_distributed_nccl.py -p no:cacheprovider -rs" ;;   # every GPU
  *) echo "0 false unknown job $1" ;;
esac; }
JOBS=${JOBS:-"cert_skinny_gemm cert_kda_decode cert_attn_res_rmsnorm cert_router_topk cert_mxfp4_dequant cert_mla_cache_write bench gpu_tests"}
declare -A lane
if [ -n "${LANES:-}" ]; then            # explicit: LANES="0:jobA jobB;1:jobC"; "0b:jobD": a second lane on GPU 0
  IFS=';' read -ra spec <<< "$LANES"; for l in "${spec[@]}"; do lane[${l%%:*}]="${l#*:}"; done
else i=0; for j in $JOBS; do g=$(( i % NG )); lane[$g]="${lane[$g]:-} $j"; i=$((i + 1)); done; fi
for g in "${!lane[@]}"; do (
  dev=${g%%[!0-9]*}                      # lane "0b" runs on GPU 0 beside lane "0" (correctness jobs, not timing ones)
  for j in ${lane[$g]}; do
    set -- $(cmd_for "${j%@*}"); limit=$1; shift; [ "${j#*@}" != "$j" ] && limit=${j#*@}; t0=$(date +%s)
    n=${j%@*}; if [ -f "${RESUME_DIR:-results/gpu/resume}/$n/run.jsonl" ] && [ "${n#cert_}" != "$n" ]; then
      mkdir -p "$R/$n"; cp "${RESUME_DIR:-results/gpu/resume}/$n/run.jsonl" "$R/$n/"; set -- "$@" --resume; fi   # a cut run goes on
    jobs_from=${RESUME_JOBS:-${RESUME_DIR:-results/gpu/resume}/certall/jobs}   # RESUME_JOBS: a recorded jobs/ dir
    if [ "$n" = certall ] && [ -d "$jobs_from" ]; then     # its per-op/shard logs (xz-compressed ones unpacked)
      mkdir -p "$R/certall"; cp -r "$jobs_from" "$R/certall/"; find "$R/certall/jobs" -name '*.xz' -exec xz -df {} +
      set -- "$@" --resume; fi
    if [ "$n" = certall ]; then gpus=${CERTALL_GPUS:-$(seq -s, 0 $((NG - 1)))}; else gpus=$dev; fi   # certall: every GPU (or CERTALL_GPUS)
    [ "$n" = nccl ] && gpus=$(seq -s, 0 $((NG - 1)))                                               # nccl: one rank per GPU
    CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" "$@" > "$R/${j%@*}.log" 2>&1
    echo "$j gpu=$dev lane=$g rc=$? $(( $(date +%s) - t0 ))s" >> "$R/env.txt"
  done ) & done
wait $(jobs -p | grep -v "^$PACKER$")
kill $PACKER 2>/dev/null; pack
for f in "$R"/*.log; do echo "== $f"; grep -E "certified|FAILED|failed|passed|skipped|Error|error|TIME|status|CHECK.*False" "$f" | head -25; done
cat "$R/env.txt"
