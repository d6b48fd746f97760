"""`verify-kernels check`: which certificate still holds for the tree. A verdict holds only while
every source it was judged on is unchanged; the newest holding verdict decides; a stale, failed,
skipped or missing op fails the gate with what to do."""
import json

import pytest

from verify.record import gate
from verify.record.certificate import op_sources
from verify.cli import main
from verify.ops.registry import get_op

OPS = [get_op("skinny_gemm"), get_op("router_topk")]


def _cert(created, status="pass", profile="release", device="cuda", sources=None, ops=("skinny_gemm", "router_topk"),
          candidate="fused"):
    return {"format": "verify-kernels/certificate/v1", "created": created,
            "environment": {"device": device, "git_commit": "abc1234def"}, "options": {"profile": profile},
            "ops": {name: {"sources": sources(name) if sources else op_sources(get_op(name)),
                           "verdicts": {candidate: {"status": status, "reason": f"{status} reason"}}}
                    for name in ops}}


def _stale(field):
    def sources(name):
        s = dict(op_sources(get_op(name)))
        s[field] = "0" * 64
        return s
    return sources


def test_the_newest_holding_verdict_decides():
    old_pass = ("a.json", _cert("2026-11-29T00:00:00+00:00"))
    new_fail = ("b.json", _cert("2026-11-30T00:00:00+00:00", status="fail"))
    newer_stale = ("c.json", _cert("2026-12-01T00:00:00+00:00", sources=_stale("fused")))
    states = gate.check(OPS, [old_pass, newer_stale, new_fail], "fused")
    assert [(s.state, s.certificate) for s in states] == [("failed", "b.json")] * 2
    states = gate.check(OPS, [old_pass, newer_stale], "fused")
    assert [(s.state, s.certificate, s.ok) for s in states] == [("certified", "a.json", True)] * 2


@pytest.mark.parametrize("field", ["fused", "reference", "spec", "registry", "harness"])
def test_a_changed_source_makes_the_op_stale_and_names_it(field):
    (st, _) = gate.check(OPS, [("a.json", _cert("2026-11-30T00:00:00+00:00", sources=_stale(field)))], "fused")
    assert st.state == "stale" and not st.ok
    assert f"changed since its newest verdict: {field};" in st.detail


def test_skipped_missing_and_waived():
    states = gate.check(OPS, [("a.json", _cert("2026-11-30T00:00:00+00:00", status="skip", ops=("skinny_gemm",)))],
                        "fused")
    assert [s.state for s in states] == ["not_certified", "missing"]
    assert "no certificate judged fused" in states[1].detail
    (st, _) = gate.check(OPS, [("a.json", _cert("2026-11-30T00:00:00+00:00", status="waived"))], "fused")
    assert st.ok
    (st, _) = gate.check(OPS, [("a.json", _cert("2026-11-30T00:00:00+00:00"))], "compiled")
    assert st.state == "missing"


def test_profile_and_device_requirements():
    certs = [("ci.json", _cert("2026-11-30T00:00:00+00:00", profile="ci")),
             ("cpu.json", _cert("2026-11-30T01:00:00+00:00", device="cpu"))]
    assert [s.certificate for s in gate.check(OPS, certs, "fused")] == ["cpu.json"] * 2          # the newest
    assert [s.certificate for s in gate.check(OPS, certs, "fused", profile="release")] == ["cpu.json"] * 2
    assert [s.certificate for s in gate.check(OPS, certs, "fused", profile="ci")] == ["ci.json"] * 2
    assert [s.certificate for s in gate.check(OPS, certs, "fused", device="cuda")] == ["ci.json"] * 2
    missing = gate.check(OPS, certs, "fused", profile="release", device="cuda")
    assert all(s.state == "missing" and "(profile release on cuda)" in s.detail for s in missing)


def test_cli_exit_codes_and_json(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_cert("2026-11-30T00:00:00+00:00")))
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps(_cert("2026-12-01T00:00:00+00:00", sources=_stale("harness"))))
    assert main(["check", str(good), "--ops", "skinny_gemm,router_topk", "--profile", "release", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and [o["op"] for o in out["ops"]] == ["skinny_gemm", "router_topk"]
    assert main(["check", str(stale), "--ops", "skinny_gemm"]) == 1
    assert "stale" in capsys.readouterr().out
    assert main(["check", str(good)]) == 1            # every op with a fused kernel: the others are missing
    assert main(["check", str(good), "--ops", "nope"]) == 2
    assert "unknown op 'nope'" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "absent.json")]) == 2


def _with_files(name, old_hash_of=None, drop=None, extra=None):
    """A certificate entry's per-file hashes as `build` writes them, with one file's hash changed
    (as if it was judged on other bytes), one file missing, or one file the tree no longer has."""
    from verify.record.certificate import source_files
    files = dict(source_files(get_op(name)))
    if old_hash_of:
        files[old_hash_of] = "0" * 64
    if drop:
        files.pop(drop)
    if extra:
        files[extra] = "1" * 64
    return files


def test_a_stale_verdict_names_the_files_that_changed():
    """With the certificate's per-file hashes, a stale op names the files behind the changed source:
    a changed helper module of the kernel, a file the verdict did not depend on (+), one the tree no
    longer has (-)."""
    cert = _cert("2026-11-30T00:00:00+00:00", sources=_stale("fused"), ops=("skinny_gemm",))
    entry = cert["ops"]["skinny_gemm"]
    entry["source_files"] = _with_files("skinny_gemm", old_hash_of="fused/skinny_gemm_wgmma.py")
    (st,) = gate.check(OPS[:1], [("a.json", cert)], "fused")
    assert st.state == "stale"
    assert st.detail == "changed since its newest verdict: fused (fused/skinny_gemm_wgmma.py); run it again"
    entry["source_files"] = _with_files("skinny_gemm", drop="fused/runtime.py", extra="fused/gone.py")
    (st,) = gate.check(OPS[:1], [("a.json", cert)], "fused")
    assert "fused (+fused/runtime.py, -fused/gone.py);" in st.detail
    entry["source_files"] = _with_files("skinny_gemm")         # same files: nothing to name, still stale
    (st,) = gate.check(OPS[:1], [("a.json", cert)], "fused")
    assert st.state == "stale" and st.detail == "changed since its newest verdict: fused; run it again"


def test_certificates_record_each_source_file_hash():
    """`build` keeps, beside each op's source hashes, the sha256 of every file behind them (kernel
    closure, reference closure, spec, registry entry, harness modules), by path from the repo root."""
    import hashlib

    from verify.record import certificate
    from verify.model.verdict import OpVerdict
    ops = {"skinny_gemm": get_op("skinny_gemm")}
    cert = certificate.build([OpVerdict("skinny_gemm", "fused", "pass")], ops, {}, "cpu")
    files = cert["ops"]["skinny_gemm"]["source_files"]
    assert {"fused/skinny_gemm.py", "fused/skinny_gemm_wgmma.py", "fused/runtime.py", "references/gemm.py",
            "tolerance_specs/skinny_gemm.toml", "verify/ops/gemm.py", "verify/run/runner.py",
            "verify/ops/common_splits.py"} <= set(files)       # the registry helpers that draw its inputs
    root = certificate.ROOT
    assert all(h == hashlib.sha256((root / f).read_bytes()).hexdigest() for f, h in files.items())
    assert "verify/cli.py" not in files and "verify/record/gate.py" not in files     # reporting side, not judged by
    assert "verify/ops/mla.py" not in files                                   # another family's entry


def test_without_file_hashes_git_names_the_files_since_the_certificates_commit(tmp_path, monkeypatch):
    """An older certificate (no per-file hashes) names its commit: `git diff --name-only COMMIT`
    over the op's files names what changed since, committed or not; an unknown commit names none."""
    import subprocess

    from verify.record import certificate
    git = ["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t"]
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "k.py").write_text("a = 1\n")
    (tmp_path / "fused" / "same.py").write_text("b = 1\n")
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "judged"], check=True)
    commit = subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "fused" / "k.py").write_text("a = 2\n")
    cert = _cert("2026-11-30T00:00:00+00:00", sources=_stale("fused"), ops=("skinny_gemm",))
    cert["environment"]["git_commit"] = commit
    monkeypatch.setattr(certificate, "source_files", lambda op: {"fused/k.py": "x", "fused/same.py": "y"})
    since = certificate.changed_files_since
    assert since(commit, OPS[0], root=tmp_path) == ["fused/k.py"]
    assert since("0" * 40, OPS[0], root=tmp_path) is None
    assert since(None, OPS[0], root=tmp_path) is None
    monkeypatch.setattr(certificate, "changed_files_since", lambda c, op: since(c, op, root=tmp_path))
    (st,) = gate.check(OPS[:1], [("a.json", cert)], "fused")
    assert st.detail == f"changed since its newest verdict: fused (per git since {commit[:12]}: fused/k.py); run it again"


def test_carried_entries_gain_the_file_hashes_of_their_unchanged_sources():
    """`--changed-since` carries an op whose sources are unchanged; an entry from a certificate older
    than the per-file hashes gets the tree's (its sources equal the tree's, so its files do), and an
    entry that has them keeps its own."""
    from verify.record.certificate import carry_forward, source_files
    old = _cert("2026-11-30T00:00:00+00:00", ops=("skinny_gemm",))
    carried, changed = carry_forward(old, {"skinny_gemm": OPS[0]}, ["fused"])
    assert changed == [] and carried["skinny_gemm"]["source_files"] == source_files(OPS[0])
    assert "source_files" not in old["ops"]["skinny_gemm"]                     # the old certificate untouched
    old["ops"]["skinny_gemm"]["source_files"] = {"fused/skinny_gemm.py": "kept"}
    carried, _ = carry_forward(old, {"skinny_gemm": OPS[0]}, ["fused"])
    assert carried["skinny_gemm"]["source_files"] == {"fused/skinny_gemm.py": "kept"}


@pytest.mark.parametrize("body, words", [
    ("[]", "a JSON object is expected"),
    ('{"format": "verify-kernels/certificate/v1", "created": 5, "ops": {}}', "'created' must be"),
    ('{"format": "verify-kernels/certificate/v1", "created": "x", "ops": 3}', "'ops' must be"),
    ('{"format": "verify-kernels/certificate/v1", "created": "x", "ops": {"a": 1}}', "ops.a must be"),
    ('{"format": "verify-kernels/certificate/v1", "created": "x", "ops": {"a": {"verdicts": []}}}',
     "ops.a.verdicts must be"),
    ('{"format": "verify-kernels/certificate/v1", "created": "x", "options": [], "ops": {}}', "'options' must be"),
])
def test_a_malformed_certificate_is_named_not_a_traceback(tmp_path, body, words):
    """`load` (behind check, report, diff and --changed-since) checks the fields they read (valid
    JSON of the wrong shape must not give AttributeError / TypeError from inside the gate)."""
    from verify.record import certificate
    p = tmp_path / "c.json"
    p.write_text(body)
    with pytest.raises(ValueError, match=words.replace("(", r"\(")) as e:
        certificate.load(p)
    assert str(p) in str(e.value)


# ---------------------------------------------------------------------------------------------- a candidate by import path
def _user_package(root, body="def kernel(x, w):\n    return helper.scale(x @ w.T)\n"):
    """A user's kernel package under root: kern.main:kernel imports kern.helper."""
    pkg = root / "kern"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("def scale(y):\n    return y\n")
    (pkg / "main.py").write_text("from kern import helper\n\n\n" + body)
    return pkg


@pytest.fixture
def user_kernel(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("kern", "kern.main", "kern.helper"):
        monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    return _user_package(tmp_path)


def _cert_with_own_sources(label):
    from verify.record.certificate import candidate_sources

    cert = _cert("2026-11-30T00:00:00+00:00", candidate=label, ops=("skinny_gemm",))
    cert["ops"]["skinny_gemm"]["candidate_sources"] = {label: candidate_sources(label)}
    return cert


def test_a_user_kernels_verdict_holds_until_its_module_or_a_module_it_imports_changes(user_kernel):
    """The op's sources do not cover a candidate named by import path: its verdict names its own
    module and the modules it imports from its package, and an edit to either makes it stale."""
    label = "kern.main:kernel"
    cert = ("a.json", _cert_with_own_sources(label))
    assert sorted(cert[1]["ops"]["skinny_gemm"]["candidate_sources"][label]["files"]) == \
        ["kern/__init__.py", "kern/helper.py", "kern/main.py"]
    (st,) = gate.check(OPS[:1], [cert], label)
    assert st.state == "certified", st.detail
    (user_kernel / "helper.py").write_text("def scale(y):\n    return 2 * y\n")
    (st,) = gate.check(OPS[:1], [cert], label)
    assert st.state == "stale" and "candidate (kern/helper.py)" in st.detail, st.detail


def test_a_user_kernels_verdict_without_its_own_sources_does_not_hold(user_kernel):
    """A certificate that recorded no candidate sources (written before they were kept, or edited) cannot
    show the kernel judged is the one in the tree: stale, saying so."""
    (st,) = gate.check(OPS[:1], [("a.json", _cert("2026-11-30T00:00:00+00:00", candidate="kern.main:kernel",
                                                      ops=("skinny_gemm",)))], "kern.main:kernel")
    assert st.state == "stale" and "does not record the candidate's own sources" in st.detail, st.detail


def test_a_layer_candidate_covers_the_kernels_it_resolves_by_name():
    """fused.layers resolves its kernels from 'fused.<op>:<fn>' strings, not imports: they count."""
    from verify.record.certificate import candidate_sources

    files = candidate_sources("fused.layers:layer_steps")["files"]
    assert {"fused/layers.py", "fused/mla_decode_attn.py", "fused/kda_decode.py", "stock/layers.py"} <= set(files)
    assert candidate_sources("fused") is None and candidate_sources("nosuch.module:f")["hash"] is None


def test_carry_forward_judges_a_changed_user_kernel_again(user_kernel):
    from verify.record.certificate import carry_forward

    label = "kern.main:kernel"
    old = _cert_with_own_sources(label)
    carried, changed = carry_forward(old, {"skinny_gemm": OPS[0]}, [label])
    assert list(carried) == ["skinny_gemm"] and changed == []
    (user_kernel / "main.py").write_text("from kern import helper\n\n\ndef kernel(x, w):\n    return x @ w.T\n")
    carried, changed = carry_forward(old, {"skinny_gemm": OPS[0]}, [label])
    assert carried == {} and changed == ["skinny_gemm"]


def test_the_dsl_version_is_recorded_without_dist_metadata_or_a_loaded_kernel():
    """On the GPU machine the CuTe DSL travels unpacked (no dist metadata) and the bench writes its
    environment before any kernel imports it: the version then comes from the module, imported there."""
    import subprocess
    import sys

    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    code = ("import sys; from verify.record.certificate import _loaded_cutlass_version as v; "
            "assert 'cutlass' not in sys.modules; print(v())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "CUTE_DSL_ARCH": "sm_90a"})
    assert out.returncode == 0, out.stderr[-500:]
    import cutlass

    assert out.stdout.strip() == cutlass.__version__
