#!/usr/bin/env bash
# Builds libflashmla_sm90.so: FlashMLA's Hopper dense paged decode (split-KV attention, scheduler,
# combine) behind shim.cu's C entry point, for stock/flashmla.py. nvcc only, no GPU and no torch
# headers, so it builds on a CPU machine and loads beside any torch on an sm_90a device.
#
#   stock/flashmla/build.sh FLASHMLA_DIR OUT.so
#
# FLASHMLA_DIR: a FlashMLA checkout with its csrc/cutlass submodule (its commit goes into OUT.so.source;
# FLASHMLA_COMMIT names it for a tree without .git).
set -euo pipefail
src=${1:?usage: build.sh FLASHMLA_DIR OUT.so}
out=${2:?usage: build.sh FLASHMLA_DIR OUT.so}
here=$(cd "$(dirname "$0")" && pwd)
csrc=$src/csrc
[ -f "$csrc/sm90/decode/dense/splitkv_mla.cuh" ] || { echo "build.sh: $src has no csrc/sm90/decode/dense (not FlashMLA with sm90 dense decode)" >&2; exit 2; }
[ -d "$csrc/cutlass/include/cute" ] || { echo "build.sh: $csrc/cutlass/include is missing (git submodule update --init csrc/cutlass)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
flags=(-O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -Wno-deprecated-declarations --expt-relaxed-constexpr
       --expt-extended-lambda --use_fast_math -Xcompiler -fPIC -gencode arch=compute_90a,code=sm_90a
       -I"$csrc" -I"$csrc/kerutils/include" -I"$csrc/sm90" -I"$csrc/cutlass/include"
       -I"$csrc/cutlass/tools/util/include")
units=("$here/shim.cu" "$csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu"
       "$csrc/smxx/decode/combine/combine.cu" "$csrc/sm90/decode/dense/instantiations/bf16.cu"
       "$csrc/sm90/decode/dense/instantiations/fp16.cu")
objs=() pids=()
for u in "${units[@]}"; do
    o=$tmp/$(basename "$(dirname "$u")")_$(basename "$u" .cu).o
    nvcc "${flags[@]}" -c "$u" -o "$o" &
    objs+=("$o") pids+=($!)
done
failed=0
for p in "${pids[@]}"; do wait "$p" || failed=1; done     # every unit finishes before the temp dir goes
[ "$failed" = 0 ] || { echo "build.sh: a unit failed to compile (its errors above)" >&2; exit 1; }
nvcc -shared -cudart static -gencode arch=compute_90a,code=sm_90a "${objs[@]}" -o "$out"
{ git -C "$src" rev-parse HEAD 2>/dev/null || echo "${FLASHMLA_COMMIT:-unknown}"; } > "$out.source"
echo "built $out ($(du -h "$out" | cut -f1)), FlashMLA $(cat "$out.source")"
