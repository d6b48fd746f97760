#!/usr/bin/env bash
# Nsight Compute on bench/ncu_probe.py's workloads (one NVTX range each; NCU_RANGES picks some, all
# by default): speed of light, warp states, scheduler, occupancy, launch and memory sections, as a
# report and as text (NCU_SOURCE=1: also each kernel's SASS with its warp-stall samples, source.csv).
# Arg: out dir.
set -eu
out=${1:-ncu-out}; mkdir -p "$out"
read -ra ranges <<< "${NCU_RANGES:-$(python3 bench/ncu_probe.py --list)}"
args=(); for r in "${ranges[@]}"; do args+=(--nvtx-include "$r/"); done
ncu --nvtx "${args[@]}" --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section SourceCounters \
    -f -o "$out/probe" python3 bench/ncu_probe.py "${ranges[@]}"
ncu --import "$out/probe.ncu-rep" --page details > "$out/probe.txt"
if [ -n "${NCU_SOURCE:-}" ]; then    # per-SASS-instruction warp-stall samples of every profiled kernel
  ncu --import "$out/probe.ncu-rep" --page source --print-source sass --csv > "$out/source.csv" 2> "$out/source.err" ||
    echo "ncu --page source failed (see source.err)"
fi
grep -E "^  [a-z_]|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Grid Size|Block Size|Warp Cycles Per Issued|No Eligible|Stall|stall" "$out/probe.txt" | head -250
