"""The plan and its slices: a run lists every case before judging any, and every way of spreading a
run (`--shard I/N` + `merge`, `--jobs N`, `--resume`) judges slices of that list, so the certificate is
the same case for case. CPU only, in-process candidates (--no-isolate) to stay fast."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from verify.judge.candidates import Candidate
from verify.model.case import Case
from verify.model.profile import get_profile
from verify.model.verdict import FAIL, PASS, VACUOUS, CaseVerdict
from verify.ops.registry import get_op
from verify.plan.plan import PairScope, make_plan
from verify.record.compare import judged_view as _judged
from verify.run.runner import InProcess, Judged, summarise

ROOT = Path(__file__).resolve().parent.parent
OPS = "mxfp4_dequant,router_topk"          # fast on a CPU; one bitwise, one tie-aware + derived
BUG = "property_tests.planted.attn_res:attn_res_rmsnorm_keys_unnormalised"


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


def _cli(args, cwd, check_rc=None):
    r = subprocess.run([sys.executable, "-m", "verify.cli", *args], cwd=cwd, env=_env(), capture_output=True,
                       text=True, timeout=900)
    if check_rc is not None:
        assert r.returncode == check_rc, r.stdout + r.stderr
    return r


def _cert(d: Path) -> dict:
    return json.loads((d / "certificate.json").read_text())


RUN = ["run", "--ops", OPS, "--candidate", "reference", "--profile", "ci", "--examples", "4", "--no-isolate"]


def test_sharded_then_merged_equals_unsharded(tmp_path):
    _cli(RUN + ["--out", "whole"], tmp_path, 0)
    for i in range(3):
        r = _cli(RUN + ["--out", f"s{i}", "--shard", f"{i}/3"], tmp_path, 0)
        assert f"shard {i}/3 of plan" in r.stdout
        assert not (tmp_path / f"s{i}" / "certificate.json").exists()      # a slice is no certificate
    _cli(["merge", "s0", "s1", "s2", "--out", "merged"], tmp_path, 0)
    whole, merged = _cert(tmp_path / "whole"), _cert(tmp_path / "merged")
    assert whole["options"]["plan"] == merged["options"]["plan"]
    assert _judged(whole) == _judged(merged)
    assert all(len(rs) > 5 for e in whole["ops"].values() for rs in e["cases"].values())


def _indices(log: Path) -> list[int]:
    return [x["index"] for x in map(json.loads, log.read_text().splitlines()) if x["kind"] == "case"]


def test_jobs_equal_an_unsharded_run(tmp_path):
    _cli(RUN + ["--out", "whole"], tmp_path, 0)
    _cli(RUN + ["--out", "jobs", "--jobs", "3"], tmp_path, 0)
    assert _judged(_cert(tmp_path / "whole")) == _judged(_cert(tmp_path / "jobs"))
    judged = [i for j in range(3) for i in _indices(tmp_path / "jobs" / "shards" / str(j) / "run.jsonl")]
    assert sorted(judged) == sorted(set(judged))                  # the children's claims never overlap
    assert len(judged) == len(json.loads((tmp_path / "whole" / "plan.json").read_text())["cases"])
    # A rerun with fewer jobs in the same directory does not read the earlier children's logs.
    _cli(RUN + ["--seed", "2", "--out", "jobs", "--jobs", "2"], tmp_path, 0)
    assert not (tmp_path / "jobs" / "shards" / "2").exists()


def test_shards_spread_over_jobs_merge_to_the_unsharded_run(tmp_path):
    _cli(RUN + ["--out", "whole"], tmp_path, 0)
    _cli(RUN + ["--out", "s0", "--shard", "0/2", "--jobs", "2"], tmp_path, 0)
    _cli(RUN + ["--out", "s1", "--shard", "1/2"], tmp_path, 0)
    _cli(["merge", "s0", "s1", "--out", "merged"], tmp_path, 0)
    assert _judged(_cert(tmp_path / "whole")) == _judged(_cert(tmp_path / "merged"))


def test_jobs_resume_claims_what_the_logs_hold(tmp_path, monkeypatch):
    """--resume with --jobs: each case a child's log holds is claimed before any child starts, so none
    is judged twice although the children may now start elsewhere."""
    from verify.plan.plan import load
    from verify.run import execute

    _cli(RUN + ["--out", "whole"], tmp_path, 0)
    _cli(RUN + ["--out", "jobs", "--jobs", "2"], tmp_path, 0)
    plan = load(tmp_path / "jobs" / "plan.json")
    log = tmp_path / "jobs" / "shards" / "0" / "run.jsonl"
    kept = log.read_text().splitlines()[:3]                        # the start line and two verdicts
    log.write_text("\n".join(kept) + "\n")
    (tmp_path / "jobs" / "shards" / "1" / "run.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    judged, problems = execute.run_jobs(plan, execute.config_of(plan, isolate=False), Path("jobs"), 2, resume=True)
    assert problems == []
    again = _indices(log)
    assert len(again) == len(set(again))
    assert sorted(judged.verdicts) == list(range(len(plan.cases)))


def test_merge_refuses_mixed_plans_and_missing_shards(tmp_path):
    _cli(RUN + ["--out", "a0", "--shard", "0/2"], tmp_path, 0)
    _cli(RUN + ["--out", "a1", "--shard", "1/2"], tmp_path, 0)
    _cli(RUN + ["--seed", "1", "--out", "b1", "--shard", "1/2"], tmp_path, 0)
    mixed = _cli(["merge", "a0", "b1", "--out", "m"], tmp_path, 2)
    assert "different plans" in mixed.stderr and len(mixed.stderr.strip().splitlines()) == 1
    missing = _cli(["merge", "a0", "--out", "m"], tmp_path, 2)
    assert "have no verdict" in missing.stderr
    nothing = _cli(["merge", "nowhere", "--out", "m"], tmp_path, 2)
    assert "not a `verify-kernels run` output directory" in nothing.stderr
    _cli(["merge", "a0", "a1", "--out", "m"], tmp_path, 0)


def test_partial_merge_certifies_the_pairs_judged_in_full(tmp_path):
    """A run cut before its last cases (a time limit): `merge --partial` gives the verdicts of the pairs
    whose every case was judged, as the whole run gave them, and fails the others as incomplete."""
    _cli(RUN + ["--out", "whole"], tmp_path, 0)
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "plan.json").write_text((tmp_path / "whole" / "plan.json").read_text())
    lines = (tmp_path / "whole" / "run.jsonl").read_text().splitlines()
    last = max(i for i, line in enumerate(lines) if json.loads(line).get("op") == "router_topk")
    (cut / "run.jsonl").write_text("\n".join(lines[:last] + lines[last + 1:]) + "\n")
    refused = _cli(["merge", "cut", "--out", "m"], tmp_path, 2)
    assert "--partial" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    _cli(["merge", "cut", "--partial", "--out", "m"], tmp_path, 1)
    whole, merged = _cert(tmp_path / "whole"), _cert(tmp_path / "m")
    assert merged["ops"]["mxfp4_dequant"] == whole["ops"]["mxfp4_dequant"]
    verdict = merged["ops"]["router_topk"]["verdicts"]["reference"]
    assert verdict["status"] == FAIL and "1 of" in verdict["reason"] and "incomplete" in verdict["reason"]


CUT = """import os, sys
from verify.run import runlog
k, written, write_case = int(sys.argv[1]), [0], runlog.RunLog.case
def case_then_cut(self, index, v):
    write_case(self, index, v)
    written[0] += 1
    if written[0] == k:
        os._exit(137)
runlog.RunLog.case = case_then_cut
from verify.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_resume_judges_only_the_cases_the_log_lacks(tmp_path):
    _cli(RUN + ["--out", "whole"], tmp_path, 0)
    cut = subprocess.run([sys.executable, "-c", CUT, "5", *RUN, "--out", "cut"], cwd=tmp_path,
                         env={**_env(), "PYTHONHASHSEED": "12345"}, capture_output=True, text=True, timeout=900)
    assert cut.returncode == 137, cut.stderr
    _cli(RUN + ["--out", "cut", "--resume"], tmp_path, 0)
    lines = [json.loads(x) for x in (tmp_path / "cut" / "run.jsonl").read_text().splitlines()]
    indices = [x["index"] for x in lines if x["kind"] == "case"]
    assert len(indices) == len(set(indices))             # nothing judged twice
    assert _judged(_cert(tmp_path / "whole")) == _judged(_cert(tmp_path / "cut"))
    other = _cli(RUN + ["--seed", "3", "--out", "cut", "--resume"], tmp_path, 2)
    assert "--resume" in other.stderr and "plan" in other.stderr


def test_a_failure_is_found_and_shrunk_alike_in_shards(tmp_path):
    args = ["run", "--ops", "attn_res_rmsnorm", "--candidate", BUG, "--profile", "ci", "--examples", "6",
            "--no-isolate"]
    whole = _cli(args + ["--out", "whole"], tmp_path, 1)
    _cli(args + ["--out", "s0", "--shard", "0/2"], tmp_path)
    _cli(args + ["--out", "s1", "--shard", "1/2"], tmp_path)
    _cli(["merge", "s0", "s1", "--out", "m"], tmp_path, 1)
    a = _cert(tmp_path / "whole")["ops"]["attn_res_rmsnorm"]["verdicts"][BUG]
    b = _cert(tmp_path / "m")["ops"]["attn_res_rmsnorm"]["verdicts"][BUG]
    assert a["status"] == b["status"] == "fail"
    assert a["reason"] == b["reason"] and a["repro"] == b["repro"]
    assert "verify-kernels repro" in whole.stdout


def _plan(seed=0, examples=6):
    op = get_op("attn_res_rmsnorm")
    return make_plan([op], ["reference"], get_profile("ci"), seed, None, examples, {}, {"seed": seed})


def test_the_plan_is_deterministic_and_names_its_options():
    a, b = _plan(), _plan()
    assert a.id == b.id and a.cases == b.cases
    assert _plan(seed=1).id != a.id
    assert a.options == {"seed": 0}
    assert [pc.index for pc in a.cases] == list(range(len(a.cases)))
    assert sum(pc.warmup for pc in a.cases) == 2                   # the plan marks guard:warmed_up's cases
    assert {s.index for s in a.slice(0, 2)} | {s.index for s in a.slice(1, 2)} == set(range(len(a.cases)))


_DRAW = """import sys, json
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "before":
    import many_constants  # noqa: F401
from verify.model.profile import get_profile
from verify.ops.registry import get_op
from verify.plan.plan import make_plan
print(json.dumps([pc.case for pc in make_plan([get_op("attn_res_rmsnorm")], ["reference"], get_profile("release"),
                                              0, None, 120, {}, {}).cases]))
"""


def test_the_plan_does_not_depend_on_the_modules_imported(tmp_path):
    """Hypothesis mixes constants of every non-site-packages module in sys.modules into its draws; a
    plan must be the same in every process (shards, resumes and merges plan again)."""
    (tmp_path / "many_constants.py").write_text(
        "TABLE = (" + ", ".join(str(7919 * i + 104729 * i * i) for i in range(1, 300)) + ")\n")
    draws = [subprocess.run([sys.executable, "-c", _DRAW, str(tmp_path), when], cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=600) for when in ("before", "after")]
    for d in draws:
        assert d.returncode == 0, d.stderr
    a, b = (json.loads(d.stdout.strip().splitlines()[-1]) for d in draws)
    assert len(a) >= 100 and a == b


def test_summary_reads_cases_in_plan_order_only():
    plan = _plan(examples=4)
    pcs = plan.cases
    judged = Judged({pc.index: CaseVerdict(pc.op, pc.candidate, pc.case, PASS) for pc in pcs})
    assert summarise(plan, judged, "cpu")[0].status == PASS
    late, early = pcs[-1].index, pcs[1].index
    judged.verdicts[late] = CaseVerdict(pcs[-1].op, "reference", pcs[-1].case, FAIL, "compare:y", "late")
    judged.verdicts[early] = CaseVerdict(pcs[1].op, "reference", pcs[1].case, FAIL, "compare:y", "early")
    v = summarise(plan, judged, "cpu")[0]
    assert v.status == FAIL and v.reason == "compare:y: early"       # the first in plan order, whatever came first
    del judged.verdicts[early], judged.verdicts[late]
    assert summarise(plan, judged, "cpu")[0].failure.stage == "incomplete"
    vac = Judged({pc.index: CaseVerdict(pc.op, pc.candidate, pc.case, VACUOUS) for pc in pcs})
    assert summarise(plan, vac, "cpu")[0].reason == "inputs: every planned case was vacuous"


def test_a_pair_that_cannot_run_is_planned_with_its_reason():
    op = get_op("mxfp4_dequant")
    plan = make_plan([op], ["fused"], get_profile("quick"), 0, None, 2,
                     {("mxfp4_dequant", "fused"): PairScope("skip", "needs a CUDA device")}, {})
    assert plan.cases == () and summarise(plan, Judged(), "cpu")[0].reason == "needs a CUDA device"


def test_a_case_verdict_does_not_depend_on_what_ran_before_it():
    """guard:warmed_up runs on the cases the plan marks, not once per process: the same case judged in
    a fresh evaluator and after others gives the same checks."""
    op = get_op("mxfp4_dequant")
    plan = make_plan([op], ["reference"], get_profile("ci"), 0, None, 3, {}, {})
    marked = next(pc for pc in plan.cases if pc.warmup)
    names = []
    for history in ([], [pc for pc in plan.cases if pc is not marked][:2]):
        ev = InProcess({"reference": Candidate("reference")})
        for pc in history + [marked]:
            v = ev.evaluate(op, Case.from_json(pc.case), "reference", "cpu", pc.strided_run, pc.warmup)
        names.append(sorted(c.name for c in v.checks))
    assert names[0] == names[1] and "guard:warmed_up" in names[0]


def test_a_failing_case_is_reported_shrunk(tmp_path):
    """The planted K-tail bug fails its first off-tile case at B = 5; the same case at B = 1 fails too,
    so the report names the smaller case and the one it was shrunk from (kept in the log for merges)."""
    bug = "property_tests.planted.gemm:skinny_gemm_drops_k_tail"
    run = _cli(["run", "--ops", "skinny_gemm", "--candidate", bug, "--no-isolate", "--out", "q"], tmp_path, 1)
    v = _cert(tmp_path / "q")["ops"]["skinny_gemm"]["verdicts"][bug]
    assert '"batch":1' in v["failure"]["case"] and "(shrunk from the case at B=5, tiny, bfloat16, T=1)" in v["reason"], v["reason"]
    assert '"batch":1' in v["repro"] and "verify-kernels repro" in run.stdout and "shrunk from the case" in run.stdout
    lines = [json.loads(x) for x in (tmp_path / "q" / "run.jsonl").read_text().splitlines()]
    assert any(x["kind"] == "shrunk" and isinstance(x["index"], int) for x in lines)
