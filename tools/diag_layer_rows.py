"""Which tokens of a layer bench row differ from the reference, and whether they are the tokens whose
experts differ: a near-tie of the router (a token inside the tie band may choose either top-k set; the
certification judges it tie-aware, the bench's peer check cannot) against a wrong kernel (rows differ
whose experts agree).

    python3 tools/diag_layer_rows.py --op kda_layer --tp 1 --batch 64 [--candidate fused.layers:layer_steps]

Builds the bench's inputs for the row (verify.bench.shapes: K3 weights drawn on the GPU, one step), runs
the reference registry form and the candidate on copies of the state, and prints per token: the
relative max difference of its output row and whether its expert set matches the reference's.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="kda_layer")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--candidate", default="fused.layers:layer_steps")
    args = ap.parse_args()
    from verify.bench.shapes import Shape, build_inputs, case_for
    from verify.ops.registry import get_op, import_callable

    op = get_op(args.op)
    case = case_for(op, Shape(op.name, args.tp, args.batch, (("steps", 1),)))
    inputs = build_inputs(op, case, "cuda")

    def run(fn):
        t = {k: v.clone() if k in op.state else v for k, v in inputs.tensors.items()}
        out = fn(**t, **inputs.params)
        torch.cuda.synchronize()
        return out

    ref_prefix, ref_ids = run(import_callable(op.reference))
    cand_prefix, cand_ids = run(import_callable(args.candidate))
    a, b = ref_prefix[-1].double(), cand_prefix[-1].double()           # [B, D], the last step
    scale = a.abs().max()
    per_row = ((a - b).abs().amax(-1) / scale).tolist()
    same = (ref_ids[-1].sort(-1).values == cand_ids[-1].to(ref_ids.dtype).sort(-1).values).all(-1).tolist()
    print(f"{args.op} T={args.tp} B={args.batch}: max |cand - ref| / max |ref| = {max(per_row):.3g}; "
          f"tokens whose experts differ: {same.count(False)} of {len(same)}")
    for i, (d, s) in enumerate(zip(per_row, same)):
        flag = "" if s else "  experts differ"
        if d > 0.02 or not s:
            print(f"  token {i:3d}: {d:.3g}{flag}")
    clean = [d for d, s in zip(per_row, same) if s]
    print(f"rows with the same experts: worst {max(clean) if clean else float('nan'):.3g}, "
          f"median {sorted(clean)[len(clean) // 2] if clean else float('nan'):.3g}")


if __name__ == "__main__":
    main()
