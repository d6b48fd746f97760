#!/usr/bin/env bash
# fla-core's Triton KDA recurrence (property_tests/thirdparty/fla_kda.py) certified as kda_decode on a
# CUDA GPU in its declared scope (PARAMS: l2_eps = 1e-6 only), and failed without the declaration.
# Run from the repository root; fla-core's and einops' wheels in .whl/ (repo root); logs under $OUT.
#   OUT=/tmp/out bash property_tests/thirdparty/gpu_fla_kda.sh
# Exits non-zero if any expectation fails; $OUT/record.txt holds date, device, commit, commands, exit codes.
set -u
OUT=${OUT:-out/fla_kda}
mkdir -p "$OUT"
ROOT=$(pwd)
SITE="$OUT/site"
python3 -m pip install --quiet --no-deps --target "$SITE" .whl/einops-*.whl .whl/fla_core-*.whl || { echo "pip install of .whl/ failed"; exit 2; }
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
# the harness's own dependencies (pydantic, ...) where they are not installed: the .device bundle, as
# .ci/gpu-certify unpacks it (../shared/device/README.md)
if ! python3 -c "import pydantic" 2>/dev/null && [ -d .device/wheels ]; then
  for w in .device/wheels/*.whl; do python3 -m zipfile -e "$w" "$SITE"; done
fi
REC="$OUT/record.txt"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  echo "commit: ${VERIFY_GIT_COMMIT:-$(cat .device/commit 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)}"
  echo "torch: $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)')"
  echo "fla-core: $(python3 -c 'import importlib.metadata as m; print(m.version("fla-core"))' 2>/dev/null || ls .whl/fla_core-*.whl)"
} > "$REC"
fail=0
step() {   # step NAME EXPECTED_RC COMMAND...
  local name=$1 want=$2; shift 2
  local t0=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc (expected $want) $(( $(date +%s) - t0 )) s: $*" | tee -a "$REC"
  [ "$rc" = "$want" ] || fail=1
}
DECL=property_tests.thirdparty.fla_kda:kda_decode
UNDECL=property_tests.thirdparty.fla_kda_undeclared:kda_decode
RUN="python3 -m verify.cli run --ops kda_decode --device cuda --profile release --examples 60"
# 1. in its declared scope: certified, the verdict names the scope
step scoped 0 $RUN --candidate $DECL --out "$OUT/scoped"
step scoped_check 0 python3 -m verify.cli check "$OUT/scoped/certificate.json" --ops kda_decode --candidate $DECL
step scoped_check_full_scope 1 python3 -m verify.cli check "$OUT/scoped/certificate.json" --ops kda_decode \
     --candidate $DECL --full-scope
python3 - "$OUT/scoped/certificate.json" "$DECL" >> "$REC" 2>&1 <<'PY' || fail=1
import json, sys
v = json.load(open(sys.argv[1]))["ops"]["kda_decode"]["verdicts"][sys.argv[2]]
print("scoped verdict:", v["status"], v["cases_passed"], "/", v["cases_run"], "cases;", v["scope"])
assert v["status"] == "pass" and any("l2_eps = 1e-06 only" in s for s in v["scope"]), v
PY
# 2. without the declaration: judged on the whole contract, l2_eps = 1e-5 fails (rows of small q/k)
step undeclared 1 $RUN --candidate $UNDECL --out "$OUT/undeclared"
python3 - "$OUT/undeclared/certificate.json" "$UNDECL" >> "$REC" 2>&1 <<'PY' || fail=1
import json, sys
v = json.load(open(sys.argv[1]))["ops"]["kda_decode"]["verdicts"][sys.argv[2]]
print("undeclared verdict:", v["status"], v["reason"][:300])
print("  failing case:", (v.get("failure") or {}).get("case"))
assert v["status"] == "fail", v["status"]
PY
CASE='{"batch":4,"config":"k3","dist":"small_rows","dtype":"bfloat16","extra":[["l2_eps",1e-05]],"op":"kda_decode","seed":0,"tp":1}'
step undeclared_repro_l2_eps_1e-5 1 python3 -m verify.cli repro "$CASE" --candidate $UNDECL --device cuda
CASE6='{"batch":4,"config":"k3","dist":"small_rows","dtype":"bfloat16","extra":[["l2_eps",1e-06]],"op":"kda_decode","seed":0,"tp":1}'
step undeclared_repro_l2_eps_1e-6 0 python3 -m verify.cli repro "$CASE6" --candidate $UNDECL --device cuda
echo "result: $([ $fail = 0 ] && echo ALL EXPECTATIONS MET || echo EXPECTATION FAILED)" | tee -a "$REC"
exit $fail
