#!/usr/bin/env bash
# Nsight Compute on bench/ncu_probe.py's workloads (one NVTX range each): speed of light, warp
# states, scheduler, occupancy, launch and memory sections, as a report and as text. Arg: out dir.
set -eu
out=${1:-ncu-out}; mkdir -p "$out"
ranges=(router_b1 router_b64 gemm_7168x3584_m8 gemm_7168x3584_m64 gemm_1536x7168_m8 dequant)
args=(); for r in "${ranges[@]}"; do args+=(--nvtx-include "$r/"); done
ncu --nvtx "${args[@]}" --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    -f -o "$out/probe" python3 bench/ncu_probe.py
ncu --import "$out/probe.ncu-rep" --page details > "$out/probe.txt"
grep -E "^  [a-z_]|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Grid Size|Block Size|Warp Cycles Per Issued|No Eligible" "$out/probe.txt" | head -150
