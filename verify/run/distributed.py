"""Real multi-process rank splits with torch.distributed: gloo on CPU, NCCL on GPUs (one GPU per rank).

Every rank rebuilds the case's inputs from its seed, takes its shard (`OpDef.split.shard`), runs the
candidate on it, and the combine runs over real collectives: all_gather of every rank's outputs, then
`OpDef.split.combine` (a rank-ordered fold for partial sums). Rank 0 judges the result against the
unsplit oracle; where a reduction order is declared, also bitwise against the unsplit reference run in
the working dtype (which uses that order). Collective forms that are not a shard/combine:
  allreduce_attn_res_rmsnorm  rank r holds only partial delta r; gathered, stacked in rank order.
  router_topk                 scores split by expert range (router_choice_scores per rank), gathered.
Modes (`reduce`): "fold" = the declared order; "allreduce" = a plain dist.all_reduce(SUM) in fp32;
"reverse" = gathered in reverse rank order; "residual_first" (AttnRes) = prefix added inside the fold.
The last three exist to show that an order-sensitive input catches a reduction whose order differs.

    verify-kernels run --distributed gloo --tp 2,4 [--ops ...] [--candidate reference]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUM_KINDS = ("partial_sum", "row", "experts")
MODES = ("fold", "allreduce", "reverse", "residual_first")


def collective_ops(ops) -> list:
    """Ops with a collective: those whose registry entry declares one, and any whose split sums across ranks."""
    return [op for op in ops if op.collective is not None or (op.split is not None and op.split.kind in SUM_KINDS)]


def dist_cases(op, seed: int, T: int, n: int = 2) -> list:
    """An order-sensitive case where the op draws one, then plain cases; small config, working dtype."""
    from verify.model.case import Case
    from verify.model.profile import CONFIG_ORDER

    config = next(c for c in CONFIG_ORDER if c in op.configs)
    dists = (["order_sensitive"] if "order_sensitive" in op.dists else []) + [d for d in op.dists if d != "order_sensitive"]
    return [Case(op.name, seed + 101 * i + T, min(5, op.max_batch), config, op.dtypes[0], dists[i % len(dists)], T)
            for i in range(n)]


# --------------------------------------------------------------------------------------- inside a rank
def _gather(dist, t):
    """all_gather one tensor (shapes equal across ranks: a real collective; else pickled objects)."""
    shapes = [None] * dist.get_world_size()
    dist.all_gather_object(shapes, (tuple(t.shape), str(t.dtype)))
    if all(s == shapes[0] for s in shapes):
        out = [torch_empty_like(t) for _ in shapes]
        dist.all_gather(out, t.contiguous())
        return out
    objs = [None] * len(shapes)
    dist.all_gather_object(objs, t.cpu())
    return [o.to(t.device) for o in objs]


def torch_empty_like(t):
    import torch

    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _allreduce_sum(dist, t):
    import torch

    acc = t.to(torch.float64 if t.dtype == torch.float64 else torch.float32).contiguous()
    dist.all_reduce(acc)
    return acc.to(t.dtype)


def _run_shard(fn, op, shard, device):
    from verify.judge.calls import guarded_call, run_plain
    from verify.judge.candidates import reference_fn

    expected = run_plain(reference_fn(op), op, shard, device)
    res = guarded_call(fn, op, shard, expected, device)
    if res.error:
        raise RuntimeError(f"candidate raised {res.error}")
    bad = [c for c in res.checks if not c.ok]
    if bad:
        raise RuntimeError(f"{bad[0].name}: {bad[0].detail}")
    return res.results


def _attn_res_form(dist, op, fn, inputs, rank, T, device, reduce):
    import torch
    from verify.judge.calls import run_plain
    from verify.model.opdef import OpInputs

    t = {k: v.to(device) for k, v in inputs.tensors.items()}
    mine = t["deltas"][rank]
    if reduce == "allreduce":
        deltas = _allreduce_sum(dist, mine)[None]
    elif reduce == "residual_first":      # prefix + d0 + d1 + ... in fp32, one rounding: a fused-kernel slip
        parts = _gather(dist, mine)
        acc = t["prefix"].float()
        for p in parts:
            acc = acc + p.float()
        deltas, t["prefix"] = acc.to(mine.dtype)[None], torch.zeros_like(t["prefix"])
    else:
        parts = _gather(dist, mine)
        deltas = torch.stack(parts[::-1] if reduce == "reverse" else parts)
    t["deltas"] = deltas
    return run_plain(fn, op, OpInputs(t, dict(inputs.params)), device)


def _router_form(dist, op, fn, inputs, rank, T, device, reduce):
    import torch
    from references.moe import expert_ranges, renormalise, router_choice_scores, select_topk

    t = {k: v.to(device) for k, v in inputs.tensors.items()}
    lo, hi = expert_ranges(t["w_gate"].shape[0], T)[rank]
    s, choice = router_choice_scores(t["x"], t["w_gate"][lo:hi], t["bias"][lo:hi])
    s_all, c_all = _gather(dist, s), _gather(dist, choice)
    if reduce == "reverse":
        s_all, c_all = s_all[::-1], c_all[::-1]
    s, choice = torch.cat(s_all, dim=1), torch.cat(c_all, dim=1)
    ids = select_topk(choice, inputs.params["top_k"])
    return {"ids": ids, "weights": renormalise(s, ids, inputs.params["routed_scale"])}


FORMS = {"gathered_partials": _attn_res_form, "gathered_scores": _router_form}     # OpDef.collective


def _generic_form(dist, op, fn, inputs, rank, T, device, reduce):
    shard = op.split.shard(inputs, T)[rank]
    mine = _run_shard(fn, op, shard, device)
    if reduce == "allreduce" and op.split.kind in SUM_KINDS:
        return {n: _allreduce_sum(dist, v) for n, v in mine.items()}
    gathered = {n: _gather(dist, mine[n]) for n in sorted(mine)}
    per_rank = [{n: gathered[n][r] for n in gathered} for r in range(T)]
    if reduce == "reverse":
        per_rank = per_rank[::-1]
    return op.split.combine(per_rank, inputs)


def judge_distributed(op, case, combined, device, fn=None) -> tuple[str, str, list]:
    """(status, reason, checks) of the combined result against the unsplit oracle and declared order."""
    from verify.judge.candidates import reference_fn
    from verify.judge.compare import compare_bitwise
    from verify.judge.calls import run_plain, to_oracle
    from verify.judge.classes import derived_vacuity, judge_outputs as judge
    from verify.model.specs import SpecError, load_spec

    inputs = op.make_inputs(case)
    ref = reference_fn(op)
    inputs64 = to_oracle(inputs)
    oracle, base = run_plain(ref, op, inputs64, device), run_plain(ref, op, inputs, device)
    cand = {n: combined[n].to(device) for n in op.outputs + op.state}
    declared = base
    if op.collective not in FORMS:    # the declared order is the fold over the reference's own per-rank results
        declared = op.split.combine([run_plain(ref, op, s, device) for s in op.split.shard(inputs, case.tp)], inputs)
    checks = []
    try:
        spec = load_spec(op.name)
    except SpecError as e:
        spec, note = None, f"no spec ({e}); judged against the declared order only"
    else:
        note = ""
        if derived_vacuity(op, spec, oracle) is None:
            checks += judge(op, spec, cand, oracle, base, inputs, inputs64)
    order = (spec.claims.reduction_order if spec else None) or (op.split.reduction_order if op.split else "none")
    if not order.startswith("none") and op.name != "router_topk":
        for n in op.outputs + op.state:
            c = compare_bitwise(n, cand[n], declared[n])
            checks.append(type(c)(f"order:{n}", c.ok, f"vs the declared order ({order}): {c.detail}",
                                  c.metrics, c.worst))
    bad = [c for c in checks if not c.ok]
    if bad:
        return "fail", f"T={case.tp}: {bad[0].name}: {bad[0].detail}", checks
    return "pass", note, checks


def rank_main(rank: int, world: int, backend: str, store: str, request: dict, result: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from verify.judge.candidates import Candidate, CandidateUnavailable
    from verify.model.case import Case
    from verify.ops.registry import get_op

    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=request.get("timeout", 300)))
    out = []
    for item, reduce in request["cases"]:
        case, t0 = Case.from_json(item), time.perf_counter()
        op = get_op(case.op)
        form = FORMS.get(op.collective, _generic_form)
        try:
            fn = Candidate(request["candidate"]).resolve(op, "cuda" if backend == "nccl" else "cpu")
            combined = form(dist, op, fn, op.make_inputs(case), rank, world, device, reduce)
            status, reason, checks = judge_distributed(op, case, combined, device) if rank == 0 else ("pass", "", [])
        except CandidateUnavailable as e:
            status, reason, checks = "skip", str(e), []
        except Exception as e:  # a rank's failure is this case's verdict; the group stays in step
            status, reason, checks = "fail", f"rank {rank}/{world}: {type(e).__name__}: {str(e)[:300]}", []
        flags = [None] * world
        dist.all_gather_object(flags, reason if status == "fail" else "")
        bad = next((f for f in flags if f), "")
        out.append({"case": item, "reduce": reduce, "status": "fail" if bad else status, "reason": bad or reason,
                    "checks": [c.__dict__ for c in checks], "seconds": time.perf_counter() - t0})
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(result).write_text(json.dumps(out, default=str))


def run_group(cases: list, candidate: str, backend: str, world: int, timeout: float = 600.0) -> list[dict]:
    """Start `world` rank processes for the (case, reduce) pairs; per-case result dicts (a hang or crash
    fails them all). One group serves every op and mode: a rank process costs seconds to import torch."""
    with tempfile.TemporaryDirectory(prefix="vk-dist-") as tmp:
        store, result = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        req = json.dumps({"cases": [(c.to_json(), m) for c, m in cases], "candidate": candidate,
                          "timeout": timeout})
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, "-m", "verify.run.distributed", str(r), str(world), backend, store,
                                   req, result], stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
        deadline, why = time.monotonic() + timeout, ""
        for r, p in enumerate(procs):
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                why = f"rank group timed out after {timeout:g} s"
                break
        for r, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                p.wait()
            elif p.returncode and not why:
                logs[r].seek(0)
                tail = " | ".join(logs[r].read().strip().splitlines()[-2:])
                why = f"rank {r} exited with status {p.returncode}: {tail[-400:]}"
        if not why and os.path.exists(result):
            return json.loads(Path(result).read_text())
        return [{"case": c.to_json(), "reduce": m, "status": "fail", "reason": why or "rank 0 wrote no result", "checks": [],
                 "seconds": 0.0} for c, m in cases]


def certify_distributed(ops, candidate: str, backend: str, tps: list[int], seed: int = 0,
                        reduces: tuple[str, ...] = ("fold",), cases_per_op: int = 2, on_case=None,
                        timeout: float = 600.0) -> list:
    """One rank group per T over every op, case and reduce mode; OpVerdicts labelled
    '<candidate>/<backend>' (plus '/<mode>' for a deliberately wrong reduction)."""
    from verify.model.verdict import FAIL, PASS, SKIP, OpVerdict
    from verify.run.runlog import verdict_from_dict

    def label(m):
        return f"{candidate}/{backend}" + ("" if m == "fold" else f"/{m}")

    if backend == "nccl":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < max(tps):
            return [OpVerdict(op.name, label(m), SKIP, reason=f"needs {max(tps)} CUDA devices for NCCL, found {n}")
                    for op in ops for m in reduces]
    per: dict[tuple[str, str], list] = {(op.name, m): [] for op in ops for m in reduces}
    for T in tps:
        cases = [(c, m) for op in ops if op.split is not None or op.collective in FORMS
                 for c in dist_cases(op, seed, T, cases_per_op) for m in reduces]
        for r in run_group(cases, candidate, backend, T, timeout) if cases else []:
            d = {"op": json.loads(r["case"])["op"], "candidate": label(r["reduce"]), "case": r["case"],
                 "status": r["status"], "stage": "" if r["status"] in (PASS, SKIP) else "distributed", "reason": r["reason"],
                 "checks": r["checks"], "seconds": r["seconds"]}
            v = verdict_from_dict(d)
            per[(v.op, r["reduce"])].append(v)
            if on_case:
                on_case(v)
    out = []
    for (name, m), seen in per.items():
        if not seen or all(v.status == SKIP for v in seen):
            why = seen[0].reason if seen else "op has no split rule or collective form"
            out.append(OpVerdict(name, label(m), SKIP, reason=why))
            continue
        bad = next((v for v in seen if v.status != PASS), None)
        out.append(OpVerdict(name, label(m), FAIL if bad else PASS, cases_run=len(seen),
                             cases_passed=sum(v.status == PASS for v in seen),
                             reason=f"distributed: {bad.reason}" if bad else "", failure=bad,
                             seconds=sum(v.seconds for v in seen),
                             details=tuple(f"T={json.loads(v.case)['tp']} {json.loads(v.case)['dist']}: {v.status}"
                                           for v in seen)))
    return out


if __name__ == "__main__":
    r, w, backend, store, req, res = sys.argv[1:7]
    rank_main(int(r), int(w), backend, store, json.loads(req), res)
