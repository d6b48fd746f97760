"""Release gate: fault isolation of planted candidates, the JSONL log, --resume, waivers, carry-forward,
certificate diff and the HTML report. CPU only; op attn_res_rmsnorm (fast, never vacuous)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from verify.record import certificate  # noqa: E402
from verify.cli import main  # noqa: E402
from verify.ops.registry import get_op  # noqa: E402

OP = "attn_res_rmsnorm"
P = "property_tests.planted_release:"
PLANTED = {  # candidate -> (stage, words the reason must contain)
    P + "raising": ("candidate", "RuntimeError: planted"),
    P + "hanging": ("timeout", "per-case timeout"),
    P + "exiting": ("crash", "exited with status 3"),
    P + "segfaulting": ("crash", "SIGSEGV"),
    P + "corrupting": ("guard:canaries", "writes outside the tensors: delta"),
}


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "run.jsonl").read_text().splitlines()]


def test_planted_candidates_fail_alone_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cands = ["reference", P + "printing", *PLANTED, "reference"][:-1]
    rc = main(["run", "--ops", OP, "--candidate", ",".join(cands), "--examples", "2", "--case-timeout", "8",
               "--out", str(tmp_path), "--junit", str(tmp_path / "junit.xml")])
    assert rc == 1
    cert = certificate.load(tmp_path / "certificate.json")
    verdicts = cert["ops"][OP]["verdicts"]
    assert verdicts["reference"]["status"] == "pass"
    assert verdicts[P + "printing"]["status"] == "pass"
    for cand, (stage, words) in PLANTED.items():
        v = verdicts[cand]
        assert v["status"] == "fail", cand
        assert v["failure"]["stage"] == stage, (cand, v["reason"])
        assert words in v["reason"], (cand, v["reason"])
        assert "verify-kernels repro" in v["repro"]
    cases_logged = [r for r in _log(tmp_path) if r["kind"] == "case"]
    for c in cands:   # every case the op verdict counted is in the log (after a hang: the rest not judged)
        n = verdicts[c]["cases_run"]
        assert sum(r["candidate"] == c and r["record"]["status"] != "skip" for r in cases_logged) == n >= 1
    assert (tmp_path / "junit.xml").read_text().count("<failure") == len(PLANTED)


def test_waived_case_that_passes_fails_the_run(monkeypatch):
    from verify.run import runner as certify
    from verify.judge.candidates import Candidate
    from verify.model.profile import get_profile
    from verify.model.specs import Waiver, load_spec

    spec = load_spec(OP).model_copy(deep=True)
    spec.waivers.append(Waiver(candidate="reference", match={"dtype": "bfloat16"}, reason="planted stale waiver",
                               expected_error="none: it passes"))
    monkeypatch.setattr(certify, "load_spec", lambda name: spec)
    from verify.ops.registry import get_op

    v = certify.certify_op(get_op(OP), Candidate("reference"),
                           certify.RunOptions(profile=get_profile("quick"), examples=2))
    assert v.status == "unexpected_pass"
    assert "remove the waiver" in v.reason


@pytest.fixture(scope="module")
def base_cert(tmp_path_factory):
    out = tmp_path_factory.mktemp("base")
    assert main(["run", "--ops", f"{OP},allreduce_attn_res_rmsnorm", "--candidate", "reference",
                 "--examples", "2", "--no-isolate", "--out", str(out)]) == 0
    return out / "certificate.json"


def test_changed_since_certifies_only_the_changed_op(base_cert, tmp_path, monkeypatch):
    real = certificate.op_sources

    def edited(op):   # as if references/attn_res.py had changed for allreduce_attn_res_rmsnorm only
        s = real(op)
        return dict(s, reference="0" * 64) if op.name == "allreduce_attn_res_rmsnorm" else s

    monkeypatch.setattr(certificate, "op_sources", edited)
    rc = main(["run", "--ops", f"{OP},allreduce_attn_res_rmsnorm", "--candidate", "reference", "--examples", "2",
               "--no-isolate", "--changed-since", str(base_cert), "--out", str(tmp_path)])
    assert rc == 0
    assert {r["op"] for r in _log(tmp_path) if r["kind"] == "case"} == {"allreduce_attn_res_rmsnorm"}
    cert = certificate.load(tmp_path / "certificate.json")
    assert "carried_from" in cert["ops"][OP]["verdicts"]["reference"]
    assert "carried_from" not in cert["ops"]["allreduce_attn_res_rmsnorm"]["verdicts"]["reference"]


def test_diff_names_the_change(base_cert, tmp_path, capsys):
    old = json.loads(base_cert.read_text())
    new = json.loads(json.dumps(old))
    v = new["ops"][OP]["verdicts"]["reference"]
    v["status"], v["reason"] = "fail", "compare:out: planted"
    w = new["ops"]["allreduce_attn_res_rmsnorm"]["verdicts"]["reference"]["worst_ratio"]
    w["out"] = w["out"] * 3
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert main(["diff", str(base_cert), str(tmp_path / "new.json")]) == 1
    text = capsys.readouterr().out
    assert "NEW FAILURES (1)" in text and f"{OP} [reference]: pass -> fail" in text
    assert "error growth" in text and "allreduce_attn_res_rmsnorm" in text and "(x3.00)" in text
    assert main(["diff", str(tmp_path / "new.json"), str(base_cert)]) == 0
    assert "fixed (1)" in capsys.readouterr().out


def test_diff_names_the_judged_code_that_changed(base_cert, tmp_path, capsys):
    """Between two certificates, an op whose source hashes differ is listed with the groups that
    changed and, where both keep per-file hashes, the files (changed, + only in NEW, - only in OLD);
    a code change alone is not a failure (exit 0)."""
    old = json.loads(base_cert.read_text())
    assert "source_files" in old["ops"][OP]                     # written by this tree's certificates
    new = json.loads(json.dumps(old))
    e = new["ops"][OP]
    e["sources"]["reference"] = "0" * 64
    file = next(f for f in e["source_files"] if f.startswith("references/"))
    e["source_files"][file] = "0" * 64
    e["source_files"]["references/new_helper.py"] = "1" * 64
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert main(["diff", str(base_cert), str(tmp_path / "new.json")]) == 0
    text = capsys.readouterr().out
    assert "judged code changed (1):" in text
    assert f"  {OP}: changed: reference ({file}, +references/new_helper.py)" in text
    del e["source_files"]                                       # an older certificate: groups only
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert main(["diff", str(base_cert), str(tmp_path / "new.json")]) == 0
    assert f"  {OP}: changed: reference\n" in capsys.readouterr().out + "\n"
    assert main(["diff", str(base_cert), str(base_cert)]) == 0
    assert "no changes" in capsys.readouterr().out


def test_report_is_one_self_contained_page(base_cert, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.html"
    assert main(["report", str(base_cert), "-o", str(out)]) == 0
    html = out.read_text()
    assert html.count("data:image/png;base64,") == 2
    assert "bfloat16 T=1" in html and "src=\"http" not in html and "<link" not in html


def test_diff_does_not_call_a_skipped_failure_fixed(base_cert, tmp_path, capsys):
    old = json.loads(base_cert.read_text())
    failed, skipped = json.loads(json.dumps(old)), json.loads(json.dumps(old))
    failed["ops"][OP]["verdicts"]["reference"]["status"] = "fail"
    skipped["ops"][OP]["verdicts"]["reference"].update(status="skip", reason="needs a CUDA device")
    (tmp_path / "f.json").write_text(json.dumps(failed))
    (tmp_path / "s.json").write_text(json.dumps(skipped))
    main(["diff", str(tmp_path / "f.json"), str(tmp_path / "s.json")])
    text = capsys.readouterr().out
    assert "fixed" not in text and "failed before, not run now" in text


def _dtype_scoped_candidate(declared):
    """A module-level candidate (the reference) whose module declares the dtypes it implements and
    which raises on any other: the harness must draw only the declared ones and say so."""
    import sys
    import types

    from references.mxfp4 import mxfp4_dequant as ref

    mod = types.ModuleType("vk_scoped_candidate")
    mod.DTYPES = declared

    def dequant(packed, scale, out_dtype="bfloat16"):
        if out_dtype not in declared:
            raise TypeError(f"{out_dtype} not implemented")
        return ref(packed, scale, out_dtype)

    dequant.__module__ = mod.__name__
    mod.dequant = dequant
    sys.modules[mod.__name__] = mod
    return "vk_scoped_candidate:dequant"


def test_candidate_declared_dtypes_scope_the_draws():
    import json

    from verify.judge.candidates import parse_candidate
    from verify.model.profile import PROFILES
    from verify.run.runner import RunOptions, certify_op
    from verify.ops.registry import get_op

    seen = []
    label = _dtype_scoped_candidate(("bfloat16", "float16"))
    v = certify_op(get_op("mxfp4_dequant"), parse_candidate(label),
                   RunOptions(device="cpu", profile=PROFILES["ci"], examples=12, on_case=seen.append))
    assert v.status == "pass", v.reason
    assert "float32 not drawn" in v.reason and "vk_scoped_candidate declares DTYPES" in v.reason
    drawn = {json.loads(c.case)["dtype"] for c in seen}
    assert drawn and drawn <= {"bfloat16", "float16"}


def test_candidate_declaring_no_drawn_dtype_is_skipped_and_undeclared_raise_fails():
    from verify.judge.candidates import parse_candidate
    from verify.model.profile import PROFILES
    from verify.run.runner import RunOptions, certify_op
    from verify.ops.registry import get_op

    op = get_op("mxfp4_dequant")
    quick = PROFILES["quick"]                       # draws the op's first dtype only: bfloat16
    v = certify_op(op, parse_candidate(_dtype_scoped_candidate(("float32",))), RunOptions(device="cpu", profile=quick))
    assert v.status == "skip" and "not drawn: bfloat16" in v.reason
    # the same raising candidate without the declaration: a failure, never a silent narrowing
    import sys
    label = _dtype_scoped_candidate(("bfloat16",))
    del sys.modules["vk_scoped_candidate"].DTYPES
    v = certify_op(op, parse_candidate(label), RunOptions(device="cpu", profile=PROFILES["ci"], examples=12))
    assert v.status == "fail" and "candidate raised TypeError" in v.reason


def test_changed_since_recertifies_everything_after_a_harness_change(base_cert, tmp_path, monkeypatch):
    """A verdict judged by another version of the harness (guards, comparison) is not carried forward."""
    monkeypatch.setattr(certificate, "harness_hash", lambda: "1" * 64)
    rc = main(["run", "--ops", f"{OP},allreduce_attn_res_rmsnorm", "--candidate", "reference", "--examples", "2",
               "--no-isolate", "--changed-since", str(base_cert), "--out", str(tmp_path)])
    assert rc == 0
    assert {r["op"] for r in _log(tmp_path) if r["kind"] == "case"} == {OP, "allreduce_attn_res_rmsnorm"}
    cert = certificate.load(tmp_path / "certificate.json")
    assert all("carried_from" not in e["verdicts"]["reference"] for e in cert["ops"].values())


def test_the_harness_hash_covers_every_module_that_draws_runs_judges_or_counts_cases():
    """A verdict depends on how its cases were drawn, run, isolated, judged, sharded, resumed and
    counted (an over-counting bug once sat in the code that spread a run over processes, outside the
    hash). The recording side stays out, so a report template does not stale a verdict."""
    names = {str(p.relative_to(certificate.ROOT / "verify")) for p in certificate.harness_files()}
    assert names >= {"model/case.py", "model/values.py", "model/specs.py", "plan/draw.py", "plan/plan.py",
                     "judge/pipeline.py", "judge/compare.py", "judge/split.py", "judge/candidates.py",
                     "judge/placement.py", "judge/guards/gpu.py", "run/runner.py", "run/execute.py",
                     "run/runlog.py", "run/worker.py", "run/distributed.py"}
    assert not any(n.startswith(("record/", "ops/")) or n in ("cli.py", "pytest_plugin.py") for n in names)


def test_source_hash_covers_the_modules_a_kernel_imports(tmp_path):
    """An op's fused (or reference) hash covers every project module it imports, transitively and
    from inside functions: editing a helper (skinny_gemm -> skinny_gemm_wgmma) un-carries the verdict;
    editing an unrelated module does not."""
    pkg = tmp_path / "fused"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "op.py").write_text("from fused import helper\n\ndef f():\n    from fused.deep import g\n    return g\n")
    (pkg / "helper.py").write_text("import torch\nfrom fused.runtime import X\n")
    (pkg / "runtime.py").write_text("X = 1\n")
    (pkg / "deep.py").write_text("def g(): return 1\n")
    (pkg / "other.py").write_text("Y = 2\n")
    h0 = certificate.sha256_closure(pkg / "op.py", root=tmp_path)
    (pkg / "other.py").write_text("Y = 3\n")
    assert certificate.sha256_closure(pkg / "op.py", root=tmp_path) == h0
    for name in ("helper.py", "runtime.py", "deep.py"):
        before = certificate.sha256_closure(pkg / "op.py", root=tmp_path)
        (pkg / name).write_text((pkg / name).read_text() + "# edited\n")
        assert certificate.sha256_closure(pkg / "op.py", root=tmp_path) != before, name
    real = certificate.op_sources(get_op("skinny_gemm"))["fused"]
    assert real == certificate.sha256_closure(certificate.ROOT / "fused" / "skinny_gemm.py")
    assert real != certificate.sha256_file(certificate.ROOT / "fused" / "skinny_gemm.py")


def test_cprofile_dir_writes_one_profile_per_case(tmp_path, monkeypatch):
    """VERIFY_CPROFILE_DIR: each judged case's cProfile stats, for finding where a run's time goes."""
    import pstats

    monkeypatch.setenv("VERIFY_CPROFILE_DIR", str(tmp_path / "prof"))
    assert main(["run", "--ops", "mxfp4_dequant", "--candidate", "reference", "--examples", "2",
                 "--no-isolate", "--out", str(tmp_path / "out")]) == 0
    dumps = sorted((tmp_path / "prof").glob("mxfp4_dequant-*.pstats"))
    assert dumps
    assert any("evaluate_case" in fn for (_, _, fn) in pstats.Stats(str(dumps[0])).stats)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "profile_summary.py"), str(tmp_path / "prof"),
                          "--top", "5"], capture_output=True, text=True, check=True).stdout
    assert f"{len(dumps)} cases" in out and "evaluate_case" in out


def test_a_gzipped_certificate_reads_as_the_plain_one(base_cert, tmp_path, capsys):
    """results/ keeps certificates as .json.gz: check and diff read them as the plain file; a .gz
    that is not gzip is a one-line error naming the file."""
    import gzip

    gz = tmp_path / "certificate.json.gz"
    gz.write_bytes(gzip.compress(base_cert.read_bytes()))
    assert certificate.load(gz) == certificate.load(base_cert)
    assert main(["diff", str(base_cert), str(gz)]) == 0
    capsys.readouterr()
    bad = tmp_path / "broken.json.gz"
    bad.write_bytes(base_cert.read_bytes())             # JSON text under a .gz name
    got = subprocess.run([sys.executable, "-m", "verify.cli", "check", str(bad)], cwd=ROOT, capture_output=True,
                         text=True)
    assert got.returncode == 2 and "cannot read it" in got.stderr and len(got.stderr.strip().splitlines()) == 1, \
        got.stderr
