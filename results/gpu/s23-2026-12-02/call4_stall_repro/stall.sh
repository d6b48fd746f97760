#!/usr/bin/env bash
# Re-run session 23 call 1's kda_decode finishing child in-process from its log (the 10 cases it judged
# replay), on tree 8769e88, and dump every Python thread's stack if it stalls (SIGABRT -> faulthandler).
set -u
cd "$(dirname "$0")"
[ -d /tmp/site/nvidia_cutlass_dsl ] || { mkdir -p /tmp/site && tar xJf ../.device/cutedsl.tar.xz -C /tmp/site; }
[ -d /tmp/site/pydantic ] || tar xJf ../.device/wheels.tar.xz -C /tmp/site
export PYTHONPATH=$PWD:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export OMP_NUM_THREADS=8 MKL_NUM_THREADS=8 VERIFY_GIT_COMMIT=8769e8861d7f6753fb174e23b9fc446c8b84ff69
mkdir -p /tmp/r/kda && cp resume/run.jsonl /tmp/r/kda/
( for i in $(seq 1 40); do sleep 5; echo "t=$((i*5)) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader) $(wc -l < /tmp/r/kda/run.jsonl)"; done ) > $OUT/smi.txt 2>&1 &
timeout -s ABRT ${STALL_S:-170} python3 -m verify.cli run --candidate fused --device cuda --profile release --no-isolate \
  --ops kda_decode --out /tmp/r/kda --resume > $OUT/child.log 2>&1
echo "rc=$?" >> $OUT/child.log
tail -c 60000 /tmp/r/kda/run.jsonl > $OUT/run_tail.jsonl
