"""Diagnose one case of a fused op on the GPU: the harness's own verdict with every failing check's
worst elements, and the fused outputs (first call, and on the refreshed-inputs run's values) saved
for a CPU-side analysis. Usage: python3 tools/diag_case.py OUT CASE_JSON [CASE_JSON ...]"""
from __future__ import annotations

import sys

import torch

from verify.judge.candidates import Candidate
from verify.model.case import Case
from verify.judge.calls import on_device
from verify.judge.context import refreshed_inputs
from verify.judge.pipeline import evaluate_case, launch_variants
from verify.ops.registry import get_op


def main() -> None:
    out = sys.argv[1]
    for i, text in enumerate(sys.argv[2:]):
        case = Case.from_json(text)
        op = get_op(case.op)
        fn = Candidate("fused").resolve(op, "cuda")
        v = evaluate_case(op, case, fn, "fused", "cuda")
        print(f"== {text}\n  {v.status} {v.stage}: {v.reason}", flush=True)
        for c in v.checks:
            if not c.ok:
                print(f"  {c.name}: {c.detail}\n    metrics {c.metrics}\n    worst {c.worst}", flush=True)
        inputs = op.make_inputs(case)
        found = refreshed_inputs(op, case, inputs)
        saved = {}
        for tag, inp in (("first", inputs), ("refreshed", found[1] if found else None)):
            if inp is None:
                continue
            for label, fn_v in launch_variants(fn, inp):
                d = on_device(inp, "cuda")
                t = {k: x.clone() for k, x in d.tensors.items()}
                res = fn_v(**t, **d.params)
                res = res if isinstance(res, (tuple, list)) else (res,)
                saved[f"{tag}:{label or 'default'}"] = {n: r.cpu() for n, r in zip(op.outputs, res)}   # no state: size
        torch.save({"case": text, "outputs": saved}, f"{out}/diag_{i}.pt")
        print(f"  saved {sorted(saved)}", flush=True)


if __name__ == "__main__":
    main()
