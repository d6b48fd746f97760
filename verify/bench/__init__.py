"""`verify-kernels bench`: speed beside correctness, with the same ops, candidates and shapes.

Modules, one job each: timing (the timing core: CUDA events over CUDA-graph replays of rotated input
sets), shapes (which shapes, one rank's inputs), floor (the op's declared bytes as a device copy),
peers (other libraries' implementations), peer_check (a whole-op peer against the reference, once
per row), certified (which candidates hold a passing verdict), run
(one run: rows of timings, each judged), score (the speed rule and the per-candidate score), output
(bench.json and the terminal table), html (the report's section), diff (speed changes between two
records), profile (--profile-kernels), command (the CLI's arguments and command).
"""
